"""Flocking (GRIFFIN, Dong et al. 2024): the tokens of one sequence lean on largely the same FFN neurons, so
the neurons its prompt used most (its flock) can serve the whole generation.

A sequence's first call (its prompt) goes through each layer's FlockPrefill: the layer's cold region streamed
once for all the prompt's tokens (as hybrid mode streams a token's), every neuron computed under the mode's
activation rule, so that the prompt's keys and values are the model's own. GRIFFIN's statistic scores each
neuron: every token's coefficients scaled to unit length, then the neuron's length over the tokens. The layer's
`share` of neurons with the highest scores is its flock; its cold neurons go into the layer's neuron cache,
pinned until the next sequence's prompt (the burst: their rows came with the stream). Later tokens follow the
flock's rule:
- add: the mode's own mask (exact mode: lossless); flock neurons are cache hits, others read as before;
- within: the mode's mask restricted to the flock: nothing read after the burst;
- core: every flock neuron, no predictor and no gate (GRIFFIN as published; predicted mode's images).
Hot neurons are in RAM whatever the rule: every token computes them.
"""

from __future__ import annotations

import numpy as np

from lsparse.runtime.costs import timed
from lsparse.runtime.ffn_streamed import StreamedFFN

CHUNK = 64  # prompt tokens computed at once: coefficients (CHUNK, d_ff) at a time, not (prompt, d_ff)


def griffin_scores(coefficients: np.ndarray) -> np.ndarray:
    """(t, n) each token's coefficient of each neuron -> (n,): GRIFFIN's statistic, summed squares of the
    tokens' unit-length rows (its square root orders the neurons the same)."""
    z = np.asarray(coefficients, dtype=np.float64)
    norms = np.linalg.norm(z, axis=1, keepdims=True)
    return ((z / np.where(norms > 0, norms, 1.0)) ** 2).sum(0)


def flock_size(share: float, d_ff: int) -> int:
    return min(d_ff, max(1, int(round(share * d_ff))))


class FlockPrefill(StreamedFFN):
    """One layer's FFN for a prompt, choosing the flock of `paged` (a PagedFFN) from it."""

    def __init__(self, paged, fetcher, components: tuple[str, ...], share: float):
        super().__init__(paged.layer, paged.products, paged.hot, fetcher, paged.check, components, paged.costs)
        self.paged, self.size = paged, flock_size(share, paged.layer.d_ff)

    def __call__(self, args, w, x, xp):
        cost = self.costs.now
        bundles = self.stream(cost)  # (cold count, stride) in file order
        with timed(cost, "mem_s"):
            rows = self.products.hold(bundles, self.components)
        hot = self.hot
        parts = [(n, s, p) for n, s, p in ((hot.neurons, hot.rows, hot.products),
                                           (self.layer.cold_order, rows, self.products)) if len(n)]
        neurons = np.concatenate([n for n, _, _ in parts])  # (d_ff,) hot, then cold in file order
        scores, outs = np.zeros(len(neurons)), []
        with timed(cost, "compute_s"):
            for start in range(0, x.shape[0], CHUNK):
                chunk = x[start:start + CHUNK]
                coefficients = [p.coefficients(chunk, n, s, None) for n, s, p in parts]  # (t, n) each
                outs.append(sum(p.down(stores, None, c) for (_, stores, p), c in zip(parts, coefficients, strict=True)))
                scores += griffin_scores(np.concatenate(self.products.kernels.host(*coefficients), axis=1))
            out = self.products.finish(outs[0] if len(outs) == 1 else xp.concatenate(outs))
        flock = np.sort(neurons[np.argsort(-scores, kind="stable")[: self.size]])
        with timed(cost, "mem_s"):
            self.paged.follow(flock, bundles)
        return out
