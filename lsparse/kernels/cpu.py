"""The kernels' operations in numpy, on the same rows (image row format) and slot lists: the reference every
implementation is checked against, and the CPU path. On these machines numpy's fp32 matrix-vector products
beat MLX's CPU backend several times over (docs/BENCHMARKS.md), so the CPU path decodes the gathered rows
and multiplies in fp32."""

from __future__ import annotations

import numpy as np

from lsparse.image.quantize import dequantize_rows
from lsparse.model.layers import silu


def _rows(w: np.ndarray, slots: np.ndarray, d: int, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    valid = np.flatnonzero(slots >= 0)
    data = np.ascontiguousarray(w[slots[valid]]).view(np.uint8)
    return valid, dequantize_rows(data.reshape(len(valid), -1), d, bits, group)


def gather_mv(w: np.ndarray, slots: np.ndarray, x: np.ndarray, bits: int, group: int) -> np.ndarray:
    """y[i] = row(slots[i]) . x, 0 where slots[i] is -1 (padding)."""
    valid, rows = _rows(w, slots, x.shape[0], bits, group)
    y = np.zeros(len(slots), dtype=np.float32)
    y[valid] = rows @ x
    return y


def gather_down(w: np.ndarray, slots: np.ndarray, a: np.ndarray, bits: int, d: int, group: int) -> np.ndarray:
    """sum_i a[i] * row(slots[i]) over the slots that are not padding."""
    valid, rows = _rows(w, slots, d, bits, group)
    return a[valid].astype(np.float32) @ rows


def gather_gate_up(gate_w: np.ndarray, up_w: np.ndarray, slots: np.ndarray, x: np.ndarray, cut: float, bits: int,
                   group: int, skip: bool) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) over the same slots; with `skip` (ReLU-family gates), up is 0 where gate <= cut."""
    gate, up = gather_mv(gate_w, slots, x, bits, group), gather_mv(up_w, slots, x, bits, group)
    return gate, np.where(gate > cut, up, 0).astype(np.float32) if skip else up


def gate_passes(pre: np.ndarray, cut: float, cats: bool) -> np.ndarray:
    """Which neurons are active from the gate (OPT: fc1) pre-activation: pre > cut for ReLU-family gates (cut 0,
    or FATReLU's threshold); |silu(pre)| > cut with CATS (SwiGLU images)."""
    return np.abs(silu(pre, np)) > cut if cats else pre > cut


def compact_active(pre: np.ndarray, cut: float, cats: bool) -> tuple[np.ndarray, np.ndarray]:
    """(indices, count) as the compact_active kernel writes them: the active neurons ascending, then -1."""
    active = np.flatnonzero(gate_passes(pre, cut, cats)).astype(np.int32)
    indices = np.full(len(pre), -1, dtype=np.int32)
    indices[: len(active)] = active
    return indices, np.array([len(active)], dtype=np.int32)


def _mlx_parts(rows: np.ndarray, d: int, bits: int, group: int):
    """Packed rows (n, row bytes) uint8 as MLX's (codes, scales, biases), scales and biases in fp32 (the
    fp16 ones run 35x slower in MLX's CPU quantized_matmul here)."""
    import mlx.core as mx
    code_bytes, groups = d * bits // 8, d // group
    rows = np.ascontiguousarray(rows)
    codes = np.ascontiguousarray(rows[:, :code_bytes]).view(np.uint32)
    scales = np.ascontiguousarray(rows[:, code_bytes:code_bytes + 2 * groups]).view(np.float16)
    biases = np.ascontiguousarray(rows[:, code_bytes + 2 * groups:]).view(np.float16)
    return mx.array(codes), mx.array(scales.astype(np.float32)), mx.array(biases.astype(np.float32))


def packed_parts(rows: np.ndarray, d: int, bits: int, group: int) -> tuple:
    """Packed rows prepared once for packed_mv and packed_vm, for rows that do not change (hot neurons)."""
    return _mlx_parts(rows, d, bits, group)


def packed_mv(x: np.ndarray, rows, d: int, bits: int, group: int) -> np.ndarray:
    """x (t, d) @ rows.T for packed 4- or 8-bit rows (n, row bytes) or their packed_parts, without decoding
    them: (t, n)."""
    import mlx.core as mx
    q, s, b = rows if isinstance(rows, tuple) else _mlx_parts(rows, d, bits, group)
    return np.array(mx.quantized_matmul(mx.array(x), q, s, b, transpose=True, group_size=group, bits=bits))


def packed_vm(a: np.ndarray, rows, d: int, bits: int, group: int) -> np.ndarray:
    """a (t, n) @ rows for packed rows (n, row bytes) or their packed_parts, each a down column: (t, d)."""
    import mlx.core as mx
    q, s, b = rows if isinstance(rows, tuple) else _mlx_parts(rows, d, bits, group)
    return np.array(mx.quantized_matmul(mx.array(a.astype(np.float32)), q, s, b, transpose=False,
                                        group_size=group, bits=bits))
