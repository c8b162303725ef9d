"""Rows of weights as stored on flash: fp16, or MLX's affine 4-/8-bit groups (a scale and a bias per group).

A quantized row is its packed codes (uint32 words, element i in word i*bits//32 at bit (i*bits) % 32, as
`mx.quantize` packs them) followed by the fp16 scales and the fp16 biases of its groups, so that gathered rows
feed `mx.quantized_matmul` unchanged and numpy can dequantize them on the CPU path.
"""

from __future__ import annotations

import numpy as np

from lsparse.errors import LsparseError

BITS = (4, 8, 16)


def row_bytes(d: int, bits: int, group_size: int) -> int:
    if bits == 16:
        return 2 * d
    return d * bits // 8 + 2 * 2 * (d // group_size)


def check(d: int, bits: int, group_size: int) -> None:
    if bits not in BITS:
        raise LsparseError(f"unsupported bit width {bits} (supported: {', '.join(map(str, BITS))})")
    if bits != 16 and (group_size not in (32, 64, 128) or d % group_size):
        raise LsparseError(f"{bits}-bit groups of {group_size} need rows of a multiple of {group_size} "
                           f"(rows here have {d}); use --bits 16 or another --group-size (32, 64, 128)")


def quantize_rows(rows: np.ndarray, bits: int, group_size: int = 64) -> np.ndarray:
    """(n, d) float -> (n, row_bytes) uint8."""
    n, d = rows.shape
    check(d, bits, group_size)
    if bits == 16:
        return rows.astype(np.float16).view(np.uint8).reshape(n, 2 * d)
    import mlx.core as mx
    q, scales, biases = mx.quantize(mx.array(rows.astype(np.float16)), group_size=group_size, bits=bits)
    parts = [np.array(q).view(np.uint8), np.array(scales).view(np.uint8), np.array(biases).view(np.uint8)]
    return np.concatenate([p.reshape(n, -1) for p in parts], axis=1)


def dequantize_rows(data: np.ndarray, d: int, bits: int, group_size: int = 64) -> np.ndarray:
    """(n, row_bytes) uint8 -> (n, d) float32, in numpy (the CPU path)."""
    n = data.shape[0]
    if bits == 16:
        return np.ascontiguousarray(data).view(np.float16).astype(np.float32).reshape(n, d)
    code_bytes, groups = d * bits // 8, d // group_size
    codes = data[:, :code_bytes]
    if bits == 4:
        codes = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(n, d)
    scales = np.ascontiguousarray(data[:, code_bytes:code_bytes + 2 * groups]).view(np.float16)
    biases = np.ascontiguousarray(data[:, code_bytes + 2 * groups:]).view(np.float16)
    w = codes.reshape(n, groups, group_size).astype(np.float32)
    w = w * scales.astype(np.float32)[:, :, None] + biases.astype(np.float32)[:, :, None]
    return w.reshape(n, d)
