"""The array library the model computes with: MLX where Metal is available, numpy elsewhere.

MLX's Linux wheel uses a reference BLAS; numpy with OpenBLAS does the decoder's matrix-vector products
3-5x faster on the CPU (docs/BENCHMARKS.md). Model code is written once against the functions both share.
"""

from __future__ import annotations

import numpy as np

from lsparse.errors import LsparseError

BACKENDS = ("numpy", "mlx")


def default_backend() -> str:
    import mlx.core as mx
    return "mlx" if mx.metal.is_available() else "numpy"


def array_module(name: str):
    if name == "numpy":
        return np
    if name == "mlx":
        import mlx.core as mx
        return mx
    raise LsparseError(f"unknown backend {name!r} (choose from {', '.join(BACKENDS)})")


def to_numpy(a) -> np.ndarray:
    return a if isinstance(a, np.ndarray) else np.array(a, copy=False)


def evaluate(xp, *arrays) -> None:
    """MLX is lazy: force the computation so that timings and memory are real."""
    if xp is not np:
        xp.eval(*arrays)
