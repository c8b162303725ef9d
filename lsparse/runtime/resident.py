"""Resident weight matrices kept as stored (4/8-bit rows, `compile --resident-bits`): the model code multiplies
them as it multiplies arrays (`x @ w.T`, `w[tokens]`), and the kernel backend does the work on the rows as they
lie, so that attention and embeddings cost RAM and bandwidth as stored, not as fp32."""

from __future__ import annotations

import mmap

import numpy as np

from lsparse.image.quantize import dequantize_rows
from lsparse.kernels import backends
from lsparse.source.safetensors_store import mapping_of

NOT_MATRICES = ("hot_bundles", "exact_rows", "cold_row_sums")


class StoredMatrix:
    """A matrix (out, in) held as `out` rows of `in` weights in the image's row format."""
    __array_ufunc__ = None  # numpy defers `x @ w.T` to our __rmatmul__

    def __init__(self, rows: np.ndarray, width: int, bits: int, group: int, kernel):
        self.rows, self.width, self.bits, self.group = rows, width, bits, group
        self.kernel = kernel
        self.store = kernel.hold(kernel.prepare(rows, 1)[:, 0])  # (out, row bytes) or decoded (out, in)
        self.shape = (len(rows), width)
        # Rows left in the image file (the plan's `mapped`): each product's pages are dropped after it, so that
        # the process holds one such matrix at a time and the OS's page cache the rest, as the budget allows.
        self.mapping = mapping_of(self.store)
        self.read_ahead = []  # mappings to start reading when this matrix is multiplied (read_ahead_in_turn)

    @property
    def T(self) -> "_Transposed":
        return _Transposed(self)

    def __getitem__(self, index) -> np.ndarray:
        """Rows decoded to float32 (an embedding lookup); index: token numbers, numpy or MLX."""
        index = np.asarray(index)
        return dequantize_rows(np.atleast_2d(self.rows[index]), self.width, self.bits, self.group).reshape(
            *index.shape, self.width)


class _Transposed:
    __array_ufunc__ = None

    def __init__(self, matrix: StoredMatrix):
        self.matrix = matrix

    def __rmatmul__(self, x) -> np.ndarray:
        """x (t, in) @ w.T -> (t, out), through the kernel backend."""
        m = self.matrix
        for mapping in m.read_ahead:  # the OS reads them while this product and the ones after it run
            mapping.madvise(mmap.MADV_WILLNEED)
        y = m.kernel.mv(m.store, None, x if m.kernel.lazy else np.asarray(x, dtype=np.float32))
        if m.mapping is not None:
            m.mapping.madvise(mmap.MADV_DONTNEED)
        return y


def read_ahead_in_turn(groups: list[list]) -> None:
    """Groups of matrices in the order a token multiplies them (each layer's attention, then the head): the
    first matrix of each group that is mapped from the image file starts the reads of the next such group's,
    the last group's the first's (the next token's)."""
    mapped = [[m for m in group if isinstance(m, StoredMatrix) and m.mapping is not None] for group in groups]
    mapped = [group for group in mapped if group]
    for group, following in zip(mapped, mapped[1:] + mapped[:1], strict=True):
        group[0].read_ahead = [m.mapping for m in following]


def row_width(row_bytes: int, bits: int, group: int) -> int:
    """The weights in a stored row of this many bytes (row_bytes = width * bits / 8 + 4 * width / group)."""
    return int(round(row_bytes / (bits / 8 + 4 / group)))


def weights(tensors: dict, matrices: tuple[str, ...], bits: int, group: int, kernel_name: str,
            leave_out: tuple[str, ...] = ()) -> dict:
    """A resident file's tensors for the model code: stored matrices wrapped (multiplied by the backend
    `kernel_name` makes for their width), float tensors as float32; bundles, checksums and `leave_out` not."""
    out, kernels = {}, {}
    for name, t in tensors.items():
        if name in NOT_MATRICES or name in leave_out:
            continue
        if t.dtype == np.uint8 and name in matrices:
            width = row_width(t.shape[1], bits, group)
            if width not in kernels:
                kernels[width] = backends.select(kernel_name, width, bits, group)
            out[name] = StoredMatrix(t, width, bits, group, kernels[width])
        elif t.dtype.kind == "f":
            out[name] = t.astype(np.float32)
    return out
