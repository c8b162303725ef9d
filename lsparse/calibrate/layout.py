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


def coalesced_reads(positions: np.ndarray, max_gap: int) -> tuple[int, int]:
    """Reads needed for bundles at the given file positions when a gap of at most `max_gap` bundles is read
    through rather than starting a new request. Returns (reads, bundles read)."""
    if len(positions) == 0:
        return 0, 0
    p = np.sort(positions)
    breaks = np.flatnonzero(np.diff(p) > max_gap + 1)
    starts = np.concatenate([[p[0]], p[breaks + 1]])
    ends = np.concatenate([p[breaks], [p[-1]]])
    return len(starts), int((ends - starts + 1).sum())


def read_stats(active: np.ndarray, position: np.ndarray, bundle_bytes: int, max_gap: int) -> dict:
    """Mean reads per token and mean read size, for masks (tokens, n) and each neuron's file position
    (-1: not on flash)."""
    reads, read_bundles, needed = [], [], []
    for row in active:
        pos = position[row]
        pos = pos[pos >= 0]
        r, b = coalesced_reads(pos, max_gap)
        reads.append(r)
        read_bundles.append(b)
        needed.append(len(pos))
    total_reads = max(sum(reads), 1)
    return {"reads_per_token": float(np.mean(reads)),
            "mean_read_bytes": float(sum(read_bundles) * bundle_bytes / total_reads),
            "bytes_read_per_token": float(np.mean(read_bundles) * bundle_bytes),
            "bytes_needed_per_token": float(np.mean(needed) * bundle_bytes)}
