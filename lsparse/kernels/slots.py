"""The Metal backend and its two Linux stand-ins (reference, emulated): rows as stored in MLX arrays, products
over slot lists by lsparse's Metal kernels (lsparse/kernels/metal/), held rows by MLX's quantized_matmul.

Lazy: every product is an MLX graph, and the model around it runs in MLX, so nothing is computed until the
host reads a value. The host reads through `host` only, once per layer: the active list of exact gating (the
rows to read from flash depend on it) or a numpy predictor's input; then the sampled token's logits. On a Mac
that is one GPU round trip per layer, where answering each call in numpy took three (issue #15).
"""

from __future__ import annotations

import numpy as np

from lsparse.errors import LsparseError
from lsparse.kernels.backends import MlxKernels
from lsparse.kernels.cpu import as_mlx, gate_passes


class SlotKernels(MlxKernels):
    """A cache store is (capacity, row words) uint32 and a slot list travels at its length rounded up to 8,
    padded with -1. `ops` answers the Metal kernel calls: lsparse.kernels.metal itself, or a stand-in with the
    same signatures (ReferenceOps, emulate.Ops)."""
    lazy = True

    def __init__(self, d, bits, group, ops, name: str):
        from lsparse.kernels.metal import GROUPS, kernel_group
        if bits != 16 and group not in GROUPS:
            raise LsparseError(f"--kernels {name}: lsparse's Metal kernels take groups of "
                               f"{', '.join(map(str, GROUPS))}; this image's rows have groups of {group}")
        super().__init__(d, bits, group)
        self.ops, self.name, self.kernel_group = ops, name, kernel_group(bits, group)

    def host(self, *arrays) -> tuple[np.ndarray, ...]:
        """The arrays computed (one evaluation for all of them) and read as numpy."""
        import mlx.core as mx
        mx.eval(*[a for a in arrays if isinstance(a, mx.array)])
        return tuple(np.array(a) for a in arrays)

    @staticmethod
    def zeros(shape):
        import mlx.core as mx
        return mx.zeros(shape, dtype=mx.float32)

    @staticmethod
    def index(neurons):
        import mlx.core as mx
        return mx.array(np.asarray(neurons, dtype=np.int32))

    def empty(self, count, prefault=False):
        import mlx.core as mx
        return mx.zeros((count, self.row_bytes // 4), dtype=mx.uint32)

    def put(self, store, slots, rows):
        import mlx.core as mx
        store[mx.array(slots.astype(np.int32))] = mx.array(np.ascontiguousarray(rows).view(np.uint32))

    def hold(self, rows):
        if self.bits == 16:
            import mlx.core as mx
            return mx.array(np.ascontiguousarray(rows).view(np.float16))
        return super().hold(rows)

    def mv(self, store, slots, x):
        import mlx.core as mx
        x = as_mlx(x)
        if slots is None:  # held rows: MLX's own kernels; fp16 rows multiplied as fp16
            if self.bits == 16:
                return (x.astype(mx.float16) @ store.T).astype(mx.float32)
            return mx.quantized_matmul(x, *store, transpose=True, group_size=self.group, bits=self.bits)
        padded = _padded(slots)
        return mx.stack([self.ops.gather_mv(store, padded, row, self.bits, self.kernel_group)[: len(slots)]
                         for row in x])

    def gate_up(self, gate_store, up_store, slots, x, skip_cut):
        """(gate, up), each (t, len(slots)), from one pass over each row of x (gather_gate_up); `skip_cut`: up
        is left 0 where the gate is at most this (ReLU-family gates), None: computed everywhere."""
        import mlx.core as mx
        if slots is None:  # held rows: MLX's own kernels, one product each
            return super().gate_up(gate_store, up_store, None, x, skip_cut)
        padded = _padded(slots)
        threshold = mx.array([0.0 if skip_cut is None else skip_cut], dtype=mx.float32)
        pairs = [self.ops.gather_gate_up(gate_store, up_store, padded, row, threshold, self.bits, self.kernel_group,
                                         skip_cut is not None) for row in as_mlx(x)]
        return tuple(mx.stack([pair[k][: len(slots)] for pair in pairs]) for k in (0, 1))

    def vm(self, store, slots, a):
        import mlx.core as mx
        a = as_mlx(a)
        if slots is None:
            if self.bits == 16:
                return (a.astype(mx.float16) @ store).astype(mx.float32)
            return mx.quantized_matmul(a, *store, transpose=False, group_size=self.group, bits=self.bits)
        padded = _padded(slots)
        a = mx.concatenate([a, mx.zeros((a.shape[0], padded.shape[0] - len(slots)), dtype=mx.float32)], axis=1)
        return mx.stack([self.ops.gather_down(store, padded, row, self.bits, self.kernel_group, self.d) for row in a])

    def gate(self, store, x, bias, cut, cats):
        """(pre-activations (t, n), an MLX graph; the active neurons, read by the host: one evaluation)."""
        return self.gates([(store, x, bias, cut, cats)])[0]

    def gates(self, requests):
        """gate(*request) for each request, their active lists read by the host in one evaluation."""
        import mlx.core as mx
        pres, lists = [], []
        for store, x, bias, cut, cats in requests:
            pre = self.mv(store, None, x)
            pres.append(pre if bias is None else pre + mx.array(bias))
            threshold = mx.array([cut], dtype=mx.float32)
            lists.append([self.ops.compact_active(row, threshold, cats) for row in pres[-1]])
        read = iter(self.host(*[array for rows in lists for pair in rows for array in pair]))
        out = []
        for pre, rows in zip(pres, lists, strict=True):
            active = [indices[: int(count[0])] for indices, count in ((next(read), next(read)) for _ in rows)]
            out.append((pre, active[0] if len(active) == 1 else np.unique(np.concatenate(active))))
        return out


def _padded(slots: np.ndarray):
    """A slot list as the kernels take it: its length rounded up to 8, padded with -1 (an MLX array)."""
    import mlx.core as mx

    from lsparse.kernels.metal import padded_length
    padded = np.full(padded_length(len(slots)), -1, dtype=np.int32)
    padded[: len(slots)] = slots
    return mx.array(padded)


def _parts(rows, bits: int, group: int, d: int):
    """Rows in the image's format, (n, row words) uint32, as MLX's (codes, scales, biases) in fp32."""
    import mlx.core as mx
    words = d * bits // 32
    halves = mx.view(rows[:, words:], mx.float16).astype(mx.float32)  # (n, 2 groups): scales, then biases
    return rows[:, :words], halves[:, : d // group], halves[:, d // group:]


class ReferenceOps:
    """The Metal kernels' calls answered by MLX's own operations (take, dequantize's quantized_matmul), lazily
    as the kernels are: what the metal backend computes, on any machine."""

    @staticmethod
    def _product(w, slots, vector, bits, group, d, transpose):
        import mlx.core as mx
        rows = w[mx.maximum(slots, 0)]
        if bits == 16:
            dense = mx.view(rows, mx.float16).astype(mx.float32)  # (n, d)
            return dense @ vector if transpose else vector @ dense
        return mx.quantized_matmul(vector[None], *_parts(rows, bits, group, d), transpose=transpose,
                                   group_size=group, bits=bits)[0]

    @classmethod
    def gather_mv(cls, w, slots, x, bits, group):
        import mlx.core as mx
        if slots.shape[0] == 0:
            return mx.zeros((0,), dtype=mx.float32)
        return mx.where(slots >= 0, cls._product(w, slots, x, bits, group, x.shape[0], True), 0.0)

    @classmethod
    def gather_gate_up(cls, gate_w, up_w, slots, x, threshold, bits, group, skip):
        import mlx.core as mx
        gate, up = cls.gather_mv(gate_w, slots, x, bits, group), cls.gather_mv(up_w, slots, x, bits, group)
        return gate, mx.where(gate > threshold[0], up, 0.0) if skip else up

    @classmethod
    def gather_down(cls, w, slots, a, bits, group, d):
        import mlx.core as mx
        if slots.shape[0] == 0:
            return mx.zeros((d,), dtype=mx.float32)
        return cls._product(w, slots, mx.where(slots >= 0, a, 0.0), bits, group, d, False)

    @staticmethod
    def compact_active(pre, threshold, cats):
        """(indices, count): the passing neurons ascending, then -1, as the compact_active kernel writes them."""
        import mlx.core as mx
        n = pre.shape[0]
        passes = gate_passes(pre, threshold[0], cats, mx)
        order = mx.argsort(mx.where(passes, 0, n) + mx.arange(n))  # the passing ones first, each in order
        count = passes.astype(mx.int32).sum(keepdims=True)
        return mx.where(mx.arange(n) < count, order.astype(mx.int32), -1), count
