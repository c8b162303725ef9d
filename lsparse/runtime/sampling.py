"""Choosing the next token from logits: greedy, temperature, nucleus (top-p), seeded."""

from __future__ import annotations

import numpy as np

from lsparse.errors import LsparseError


def make_sampler(temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None):
    if temperature < 0:
        raise LsparseError(f"--temp must be >= 0, got {temperature}")
    if not 0 < top_p <= 1:
        raise LsparseError(f"--top-p must be in (0, 1], got {top_p}")
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
