"""What the backends share outside C: the gate's rule (numpy or MLX), and products over packed 4/8-bit rows by
MLX's own quantized_matmul (the mlx backend, and the held rows of the lazy ones)."""

from __future__ import annotations

import numpy as np

from lsparse.model.layers import silu


def gate_passes(pre, cut: float, cats: bool, xp=np):
    """Which neurons are active from the gate (OPT: fc1) pre-activation: pre > cut for ReLU-family gates (cut 0,
    or FATReLU's threshold); |silu(pre)| > cut with CATS (SwiGLU images). numpy or MLX arrays (xp)."""
    return xp.abs(silu(pre, xp)) > cut if cats else pre > cut


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


def packed_mv(x, rows, d: int, bits: int, group: int):
    """x (t, d) @ rows.T for packed 4- or 8-bit rows (n, row bytes) or their packed_parts, without decoding
    them: (t, n), an MLX array (not yet evaluated). x: numpy or MLX."""
    import mlx.core as mx
    q, s, b = rows if isinstance(rows, tuple) else _mlx_parts(rows, d, bits, group)
    return mx.quantized_matmul(as_mlx(x), q, s, b, transpose=True, group_size=group, bits=bits)


def packed_vm(a, rows, d: int, bits: int, group: int):
    """a (t, n) @ rows for packed rows (n, row bytes) or their packed_parts, each a down column: (t, d), an
    MLX array (not yet evaluated)."""
    import mlx.core as mx
    q, s, b = rows if isinstance(rows, tuple) else _mlx_parts(rows, d, bits, group)
    return mx.quantized_matmul(as_mlx(a), q, s, b, transpose=False, group_size=group, bits=bits)


def as_mlx(x):
    """x as an MLX float32 array; an MLX array stays in its graph (no evaluation)."""
    import mlx.core as mx
    return x.astype(mx.float32) if isinstance(x, mx.array) else mx.array(np.asarray(x, dtype=np.float32))
