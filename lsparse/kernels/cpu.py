"""The kernels' operations in numpy, on the same rows (image row format) and slot lists: the reference every
implementation is checked against, and the CPU path. On these machines numpy's fp32 matrix-vector products
beat MLX's CPU backend several times over (docs/BENCHMARKS.md), so the CPU path decodes the gathered rows
and multiplies in fp32."""

from __future__ import annotations

import numpy as np

from lsparse.image.quantize import dequantize_rows
from lsparse.kernels.metal import GROUP


def _rows(w: np.ndarray, slots: np.ndarray, d: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    valid = np.flatnonzero(slots >= 0)
    data = np.ascontiguousarray(w[slots[valid]]).view(np.uint8)
    return valid, dequantize_rows(data.reshape(len(valid), -1), d, bits, GROUP)


def gather_mv(w: np.ndarray, slots: np.ndarray, x: np.ndarray, bits: int) -> np.ndarray:
    """y[i] = row(slots[i]) . x, 0 where slots[i] is -1 (padding)."""
    valid, rows = _rows(w, slots, x.shape[0], bits)
    y = np.zeros(len(slots), dtype=np.float32)
    y[valid] = rows @ x
    return y


def gather_down(w: np.ndarray, slots: np.ndarray, a: np.ndarray, bits: int, d: int) -> np.ndarray:
    """sum_i a[i] * row(slots[i]) over the slots that are not padding."""
    valid, rows = _rows(w, slots, d, bits)
    return a[valid].astype(np.float32) @ rows
