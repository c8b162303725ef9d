"""The sparse FFN's operations behind one interface, for each way lsparse can compute them; the runtime
(lsparse/runtime/ffn*.py) computes through nothing else.

A store holds one component's rows (gate, up, or down columns) for a set of neurons. `empty` makes one whose
rows are written by slot (a layer's neuron cache: `put`), answering products over slot lists; `hold` makes
one of fixed rows (hot neurons, the exact gate, rows read for one token), answering products over all its
rows (slots None). Values cross the interface as numpy arrays (MLX arrays for the lazy backends):
- mv(store, slots, x): x (t, d) -> (t, len(slots)), the gate or up values of those rows;
- gate_up(gate store, up store, slots, x, skip_cut): both at once, the same rows of two stores;
- vm(store, slots, a): a (t, len(slots)) -> (t, d), the down projection over them;
- gate(store, x, bias, cut, cats): exact gating, the gate of every neuron and the active ones, ascending.

Backends (KERNELS):
- cpu: the CPU path, the fastest measured here (docs/BENCHMARKS.md, `lsparse bench kernels`): lsparse's C
  kernels (lsparse/kernels/native.py) multiply rows where they lie, 4/8-bit rows as stored in large stores;
  small stores hold fp32 rows for numpy and OpenBLAS, as does everything where no C compiler is found;
- mlx: rows kept as stored (4/8-bit) and multiplied by MLX's quantized_matmul: a fifth of the RAM at 4 bits;
- metal: rows kept as stored in MLX arrays; lsparse's Metal kernels (metal/) over slot lists at their length
  rounded up to 8, padded with -1 (gate and up rows in one pass), MLX's own quantized_matmul over held rows
  and for the dense gate, compact_active for exact gating's active list;
- reference and emulated: the metal backend with each Metal kernel call answered by MLX's own operations
  (take, dequantize, quantized_matmul: lazy, as the Metal kernels are) or by the exact Metal source run in
  the CPU emulator: how the runtime's use of the kernels is tested where there is no Metal.
The metal, reference and emulated backends (lsparse/kernels/slots.py) are lazy: their products are MLX graphs
and the model around them runs in MLX, so that a layer is evaluated only where the host must read a value
(its mask, or a numpy predictor's input): `host`.
"""

from __future__ import annotations

import mmap

import numpy as np

from lsparse.errors import LsparseError
from lsparse.image.quantize import dequantize_rows, row_bytes
from lsparse.kernels import cpu
from lsparse.kernels.native import load as load_native

KERNELS = ("auto", "cpu", "mlx", "metal", "reference", "emulated")
# Below this many weights per product, a C call's fixed cost (about 9 us through ctypes) loses to numpy's
# gather-then-multiply; above it, the C kernels win (measured on these machines: d 64 to 1024, 8 to 2048 rows).
NATIVE_MIN_WEIGHTS = 100_000
# A store of fewer weights than this (4 MB as fp32: it stays in the CPU's caches) holds them decoded: there
# OpenBLAS on fp32 rows is several times faster than the C kernels on 4-bit ones (SmolLM2's 576 x 1536 layer:
# 24 us against 146), and the RAM saved would be small. Larger stores keep rows as stored: at 7B geometry the
# C kernels match single-threaded OpenBLAS on fp32 rows there, in a seventh of the RAM (BENCHMARKS).
STORED_MIN_WEIGHTS = 1 << 20


class CpuKernels:
    """With the C kernels and a 4/8-bit image, a large store (STORED_MIN_WEIGHTS) keeps its rows as stored, a
    seventh of fp32's RAM at 4 bits and never decoded, and products run on them in C; a smaller one holds rows
    decoded to fp32. Products of fewer than NATIVE_MIN_WEIGHTS weights run in numpy. fp16
    images, or no C compiler: rows decoded to fp32, products over slot lists in C (or gathered by numpy),
    over held rows by OpenBLAS."""
    name = "cpu"
    lazy = False  # products come back computed, as numpy arrays (SlotKernels: as MLX graphs)

    def __init__(self, d: int, bits: int, group: int, native: bool = True):
        self.d, self.bits, self.group = d, bits, group
        self.row_bytes = row_bytes(d, bits, group)
        self.native = load_native() if native else None
        self.gather = "native" if self.native else "numpy"  # what multiplies over slot lists
        self.quantized = self.native is not None and bits != 16  # large stores keep rows as stored

    @staticmethod
    def host(*arrays) -> tuple[np.ndarray, ...]:
        """Arrays the host reads (a mask, an input for a numpy predictor): already there."""
        return arrays

    @staticmethod
    def zeros(shape: tuple[int, ...]) -> np.ndarray:
        return np.zeros(shape, dtype=np.float32)

    @staticmethod
    def index(neurons: np.ndarray) -> np.ndarray:
        """Neuron numbers as this backend's arrays are indexed with them."""
        return neurons

    def store_row_bytes(self, count: int, held: bool) -> int:
        """The RAM one row takes in a store of `count` rows, held or a cache's (the budget plans with this)."""
        return self.row_bytes if self._keeps_stored(count) else 4 * self.d

    def prepare(self, data: np.ndarray, k: int) -> np.ndarray:
        """The first k rows of each bundle (n, bundle bytes), as this backend's stores take them: (n, k, row)."""
        n = len(data)
        rows = np.ascontiguousarray(data[:, : k * self.row_bytes]).reshape(n * k, self.row_bytes)
        if self.quantized:
            return rows.reshape(n, k, self.row_bytes)
        return self._decoded(rows).reshape(n, k, self.d)

    def _decoded(self, rows: np.ndarray) -> np.ndarray:
        return rows if rows.dtype == np.float32 else dequantize_rows(rows, self.d, self.bits, self.group)

    def _keeps_stored(self, count: int) -> bool:
        return self.quantized and count * self.d >= STORED_MIN_WEIGHTS

    def empty(self, count: int, prefault: bool = False):
        """A store of `count` rows, zeroed. `prefault`: its pages mapped now rather than at first write: writing
        fresh pages while reads and products run cost 2 ms a MB here (a 7B's cache filling during its first
        tokens), touching them at allocation 0.13."""
        shape, dtype = ((count, self.row_bytes), np.uint8) if self._keeps_stored(count) else ((count, self.d),
                                                                                              np.float32)
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if not (prefault and size and hasattr(mmap, "MAP_POPULATE")):
            return np.zeros(shape, dtype=dtype)
        pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE)
        return np.frombuffer(pages, dtype=dtype).reshape(shape)

    def put(self, store, slots: np.ndarray, rows: np.ndarray) -> None:
        store[slots] = rows if store.dtype == rows.dtype else self._decoded(rows)

    def hold(self, rows: np.ndarray):
        return np.ascontiguousarray(rows if self._keeps_stored(len(rows)) else self._decoded(rows))

    def _product(self, store, slots, vector, stored_fn, fp32_fn, numpy_fn):
        """One product over a store's rows at slots (None: all): in C where it is large enough, else numpy."""
        stored = store.dtype == np.uint8
        if self.native and len(store if slots is None else slots) * self.d >= NATIVE_MIN_WEIGHTS and (
                stored or slots is not None):  # OpenBLAS beats C over all of an fp32 store
            if not stored:
                slots = np.arange(len(store)) if slots is None else slots
            return np.stack([(stored_fn if stored else fp32_fn)(store, slots, row) for row in vector])
        rows = store if slots is None else store[slots]
        return numpy_fn(vector, self._decoded(rows))

    def mv(self, store, slots, x: np.ndarray) -> np.ndarray:
        return self._product(store, slots, x,
                             lambda w, s, v: self.native.mv_q(w, s, v, self.bits, self.group),
                             lambda w, s, v: self.native.mv(w, s, v), lambda v, rows: v @ rows.T)

    def vm(self, store, slots, a: np.ndarray) -> np.ndarray:
        return self._product(store, slots, a,
                             lambda w, s, v: self.native.vm_q(w, s, v, self.d, self.bits, self.group),
                             lambda w, s, v: self.native.vm(w, s, v), lambda v, rows: v @ rows)

    def gate_up(self, gate_store, up_store, slots, x: np.ndarray, skip_cut) -> tuple[np.ndarray, np.ndarray]:
        """(gate, up) values of the same rows, (t, len(slots)) each. `skip_cut` lets a backend leave up at 0
        where the gate is at most it (ReLU-family gates); this one computes both."""
        return self.mv(gate_store, slots, x), self.mv(up_store, slots, x)

    def gate(self, store, x: np.ndarray, bias, cut: float, cats: bool) -> tuple[np.ndarray, np.ndarray]:
        """(pre-activations (t, n), the neurons active for any row of x): the dense product, then compaction."""
        pre = self.mv(store, None, x)
        pre = pre if bias is None else pre + bias
        return pre, np.flatnonzero(cpu.gate_passes(pre, cut, cats).any(0))

    def gates(self, requests: list[tuple]) -> list[tuple]:
        """gate(*request) for each request, as one read of the host where the backend is lazy (this layer's
        gate and the lookahead's guess of the next one, from the same x)."""
        return [self.gate(*request) for request in requests]


class MlxKernels(CpuKernels):
    """A cache store is the rows' bytes in numpy, gathered and handed to MLX per product; a held store is
    MLX's (codes, scales, biases), scales and biases widened to fp32 (MLX's CPU quantized_matmul runs 35x
    slower with fp16 ones here). Keeping the cache in MLX arrays instead (gathered with `take`) measured no
    faster end to end, and MLX allocates a store whole where numpy's untouched pages cost nothing."""
    name = "mlx"

    def __init__(self, d, bits, group):
        super().__init__(d, bits, group, native=False)

    def store_row_bytes(self, count, held):  # held rows' scales and biases are widened to fp32
        return self.row_bytes + (4 * self.d // self.group if held and self.bits != 16 else 0)

    def prepare(self, data, k):
        return np.ascontiguousarray(data[:, : k * self.row_bytes]).reshape(len(data), k, self.row_bytes)

    def empty(self, count, prefault=False):
        return np.zeros((count, self.row_bytes), dtype=np.uint8)

    def hold(self, rows):
        return cpu.packed_parts(rows, self.d, self.bits, self.group)

    def mv(self, store, slots, x):
        return np.array(cpu.packed_mv(x, store if slots is None else store[slots], self.d, self.bits, self.group))

    def vm(self, store, slots, a):
        return np.array(cpu.packed_vm(a, store if slots is None else store[slots], self.d, self.bits, self.group))


def metal_available() -> bool:
    import mlx.core as mx
    return mx.metal.is_available()


def select(name: str, d: int, bits: int, group: int):
    """The backend `name` (one of KERNELS) for rows of d weights at `bits`. auto: metal where MLX has a Metal
    device, cpu elsewhere; mlx on an fp16 image is cpu (decoding fp16 is a widening copy)."""
    from lsparse.kernels.slots import ReferenceOps, SlotKernels
    if name not in KERNELS:
        raise LsparseError(f"unknown kernels {name!r} (choose from {', '.join(KERNELS)})")
    if name == "auto":
        name = "metal" if metal_available() else "cpu"
    if name == "metal":
        if not metal_available():
            raise LsparseError("--kernels metal needs a Mac with Metal (mx.metal.is_available() is False here); "
                               "use --kernels cpu or mlx")
        from lsparse.kernels import metal
        return SlotKernels(d, bits, group, metal, "metal")
    if name == "reference":
        return SlotKernels(d, bits, group, ReferenceOps, "reference")
    if name == "emulated":
        from lsparse.kernels import emulate
        return SlotKernels(d, bits, group, emulate.Ops(), "emulated")
    if name == "mlx" and bits != 16:
        return MlxKernels(d, bits, group)
    return CpuKernels(d, bits, group)
