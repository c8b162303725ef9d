"""Row-column bundles: each neuron's rows stored contiguously, so that one read fetches all it needs; and runs
of neighbouring bundles read as one request (the gap rule), at run time and in compile's layout figures."""

from __future__ import annotations

import numpy as np

from lsparse.image.quantize import dequantize_rows, quantize_rows, row_bytes

ALIGN_BUNDLE = 64
ALIGN_REGION = 4096


def stride(d_model: int, n_components: int, bits: int, group_size: int) -> int:
    size = n_components * row_bytes(d_model, bits, group_size)
    return -(-size // ALIGN_BUNDLE) * ALIGN_BUNDLE


def component_rows(weights: dict, component: str) -> np.ndarray:
    """(d_ff, d_model): a neuron's down column is a row of the transposed down projection."""
    return weights["down"].T if component == "down" else weights[component]


def encode_bundles(weights: dict, components: tuple, neurons: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """(len(neurons), stride) uint8."""
    d = weights["down"].shape[0]
    out = np.zeros((len(neurons), stride(d, len(components), bits, group_size)), dtype=np.uint8)
    rb = row_bytes(d, bits, group_size)
    for k, c in enumerate(components):
        out[:, k * rb:(k + 1) * rb] = quantize_rows(component_rows(weights, c)[neurons], bits, group_size)
    return out


def row_sums(rows: np.ndarray) -> np.ndarray:
    """rows (..., row bytes) uint8, row bytes a multiple of 4 -> (...) uint64: each row's checksum, the sum of
    its little-endian 32-bit words, word i weighted by 2i + 1, modulo 2^64 (odd weights: a change to any one
    word changes the sum). Compile records it for every cold row; the runtime checks rows as they arrive."""
    words = np.ascontiguousarray(rows).view("<u4")
    weights = np.arange(1, 2 * words.shape[-1], 2, dtype=np.uint64)
    out = np.empty(words.shape[:-1], dtype=np.uint64)
    flat, sums = words.reshape(-1, words.shape[-1]), out.reshape(-1)
    for start in range(0, len(flat), 4096):  # in chunks: the uint64 copy of a chunk is all that is made
        sums[start:start + 4096] = (flat[start:start + 4096].astype(np.uint64) * weights).sum(axis=1)
    return out


def decode_bundles(data: np.ndarray, components: tuple, d_model: int, bits: int, group_size: int) -> dict:
    """{component: (n, d_model) float32} from (n, >= len(components) rows) bundle bytes."""
    rb = row_bytes(d_model, bits, group_size)
    return {c: dequantize_rows(data[:, k * rb:(k + 1) * rb], d_model, bits, group_size)
            for k, c in enumerate(components)}


def coalesce(positions: np.ndarray, stride: int, base: int, gap_bytes: int,
             max_bytes: int | None = None) -> tuple[np.ndarray, ...]:
    """Runs of ascending bundle positions, each read as one request when the gap between neighbours costs
    less than a new request, and none longer than `max_bytes` (a reader's buffer). Returns each run's file
    offset and length, and the run of each position."""
    p = np.asarray(positions, dtype=np.int64)
    assert np.all(p[1:] >= p[:-1]), "positions must be ascending"
    first = np.ones(len(p), dtype=bool)
    first[1:] = np.diff(p) > gap_bytes // stride + 1
    if max_bytes is not None and len(p) and (p[-1] - p[0] + 1) * stride > max_bytes:  # long runs cut in pieces
        start_of_run = p[np.flatnonzero(first)][np.cumsum(first) - 1]
        piece = (p - start_of_run) // max(1, max_bytes // stride)
        first[1:] |= piece[1:] != piece[:-1]
    starts = np.flatnonzero(first)
    ends = np.append(starts[1:], len(p))[: len(starts)] - 1
    return base + p[starts] * stride, (p[ends] - p[starts] + 1) * stride, np.cumsum(first) - 1


def read_stats(active: np.ndarray, position: np.ndarray, bundle_bytes: int, max_gap: int) -> dict:
    """Mean reads per token and mean read size, for masks (tokens, n) and each neuron's file position
    (-1: not on flash)."""
    reads, read_bundles, needed = [], [], []
    for row in active:
        pos = position[row]
        pos = pos[pos >= 0]
        _, lengths, _ = coalesce(np.sort(pos), 1, 0, max_gap)  # in bundles
        reads.append(len(lengths))
        read_bundles.append(int(lengths.sum()))
        needed.append(len(pos))
    total_reads = max(sum(reads), 1)
    return {"reads_per_token": float(np.mean(reads)),
            "mean_read_bytes": float(sum(read_bundles) * bundle_bytes / total_reads),
            "bytes_read_per_token": float(np.mean(read_bundles) * bundle_bytes),
            "bytes_needed_per_token": float(np.mean(needed) * bundle_bytes)}
