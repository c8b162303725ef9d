"""Choosing the next token from logits: greedy, temperature, nucleus (top-p), seeded."""

from __future__ import annotations

import numpy as np

from lsparse.errors import LsparseError


def make_sampler(temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None):
    if not temperature >= 0 or temperature == float("inf"):  # nan fails every comparison
        raise LsparseError(f"--temp must be a number >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise LsparseError(f"--top-p must be in (0, 1], got {top_p}")
    if seed is not None and not 0 <= seed < 2**63:
        raise LsparseError(f"--seed must be between 0 and 2^63 - 1, got {seed}")
    rng = np.random.default_rng(seed)

    def sample(logits: np.ndarray) -> int:
        if temperature == 0:
            return int(np.argmax(logits))
        z = logits.astype(np.float64) / temperature
        p = np.exp(z - z.max())
        p /= p.sum()
        if top_p < 1:
            order = np.argsort(-p)
            keep = order[: int(np.searchsorted(np.cumsum(p[order]), top_p)) + 1]
            p_kept = np.zeros_like(p)
            p_kept[keep] = p[keep]
            p = p_kept / p_kept.sum()
        return int(rng.choice(len(p), p=p))

    return sample
