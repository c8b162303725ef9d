"""The order of cold neurons on flash: neurons that fire together sit together, so one read fetches several
(placement on the co-activation graph, as in Ripple and LLM in a Flash's bundling)."""

from __future__ import annotations

import numpy as np


def coactivation_order(active: np.ndarray) -> np.ndarray:
    """A greedy chain through the co-activation graph of the given (tokens, n) masks: start at the most
    frequent neuron, then always step to the unplaced neuron that fired most often with the last one
    (ties: the more frequent). Returns the column order."""
    a = active.astype(np.float32)
    co = a.T @ a
    frequency = np.diag(co).copy()
    n = len(frequency)
    placed = np.zeros(n, dtype=bool)
    order = np.empty(n, dtype=np.int64)
    current = int(np.argmax(frequency))
    tie_break = frequency / (frequency.max() + 1) * 0.5  # < 1: never outweighs one co-activation
    for i in range(n):
        order[i] = current
        placed[current] = True
        if i + 1 < n:
            candidates = np.where(placed, -np.inf, co[current] + tie_break)
            current = int(np.argmax(candidates))
    return order
