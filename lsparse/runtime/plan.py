"""Planning RAM for decoding from an image under a budget: what stays resident, what each layer's neuron cache
may hold, the buffers reads land in, the KV cache and the process itself. Refuses a budget that cannot fit,
naming the smallest that can. Everything that allocates while decoding is sized by this plan."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from lsparse.errors import LsparseError
from lsparse.image.manifest import Manifest
from lsparse.image.quantize import row_bytes as stored_row_bytes
from lsparse.kernels.backends import STORED_MIN_WEIGHTS
from lsparse.model import architecture
from lsparse.model.sparq import rank_for
from lsparse.runtime.flock import CHUNK, flock_size
from lsparse.runtime.kv_flash import READ_BUFFER_BYTES as KV_READ_BUFFER_BYTES
from lsparse.runtime.options import DecodeOptions
from lsparse.runtime.reader import ALIGN

# Python, numpy, MLX and lsparse's own code: `lsparse run` peaks at 57 MB (VmHWM) on a tiny image on Linux
# x86-64 with the mlx[cpu] wheel, weights included; with MLX's quantized kernel at work (--packed), about
# 45 MB more at 7B geometry.
PROCESS_BYTES = 112 * 2**20
MIN_READ_BUFFER = 1 << 20
F32 = 4


@dataclass(frozen=True)
class MemoryPlan:
    process: int
    attention: int
    embedding_head: int
    kv_cache: int
    hot_neurons: int
    exact_gate: int
    predictors: int
    working_set: int              # one layer's reads in flight: the reader's buffer and the rows it yields
    neuron_cache: int
    mapped: int                   # bytes of matrices left in the image file, paged by the OS (0: all held)
    held_attention_layers: int    # the first this many layers hold their attention in RAM; the rest map it
    head_mapped: bool             # the output head (and the embeddings, whenever anything is) mapped
    total: int
    smallest_budget: int
    read_buffer_bytes: int        # one reader's buffer (the lookahead's reader has another)
    cache_slots: tuple[int, ...]  # per layer: neurons its cache holds

    def report(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "cache_slots"}


def _most_loaded(manifest: Manifest, mode: str) -> np.ndarray:
    """Per layer, the largest share of its neurons one calibration token loaded in this mode."""
    return np.array([layer.max_predicted_fraction if mode == "predicted" else layer.max_active_fraction
                     for layer in manifest.layers])


def _kv_bytes(args, n_kv: int, n_layers: int, options: DecodeOptions) -> int:
    """The KV cache: every layer's keys and values for the whole context, or, paged to flash, for the newest 2R
    tokens, with the spill file's read buffer and a step's gathered key components (heads, context, r)."""
    context, h = options.context, args.head_dim
    if options.kv_ram_tokens is None:
        return n_layers * 2 * n_kv * context * h * F32
    rank = rank_for(options.kv_rank, h)
    return (n_layers * 2 * n_kv * min(context, 2 * options.kv_ram_tokens) * h * F32 + KV_READ_BUFFER_BYTES +
            args.num_attention_heads * context * rank * F32)


def _resident_bytes(manifest: Manifest, mode: str, options: DecodeOptions, row_bytes, hot_row_bytes) -> dict:
    """What stays in RAM whatever the cache holds."""
    arch, args = architecture(manifest.config)
    d, h = args.hidden_size, args.head_dim
    n_kv, _ = arch.kv_shape(args)
    n_layers = len(manifest.layers)
    d_ffs = np.array([layer.d_ff for layer in manifest.layers])

    def matrix(out: int, width: int) -> int:  # fp32 as the model code holds fp16 ones, or rows as stored
        if manifest.resident_bits == 16:
            return out * width * F32
        return out * stored_row_bytes(width, manifest.resident_bits, manifest.resident_group_size)

    heads = args.num_attention_heads * h
    attention = (matrix(heads, d) + 2 * matrix(n_kv * h, d) + matrix(d, heads)) * n_layers
    tied = manifest.config.get("tie_word_embeddings")
    ranks = [layer.predictor_rank or 0 for layer in manifest.layers]
    rows = len(manifest.bundle.components)
    return {
        "process": PROCESS_BYTES, "attention": attention,
        "embedding_head": matrix(args.vocab_size, d) * (1 if tied else 2) + 2 * d * F32,
        "kv_cache": _kv_bytes(args, n_kv, n_layers, options),
        "hot_neurons": sum(len(layer.hot) * hot_row_bytes(len(layer.hot)) for layer in manifest.layers) * rows,
        "exact_gate": sum(int(n) * row_bytes(n) for n in d_ffs) if mode == "exact" else 0,
        "predictors": int(sum((d + n + 1) * r + n for r, n in zip(ranks, d_ffs, strict=True))) * F32
        if mode == "predicted" else 0,
    }


@dataclass(frozen=True)
class Mappable:
    """The matrices the kernels multiply where they lie, as stored (4/8-bit rows on the C kernels), which can
    stay in the image file (SafetensorsFile.mapped) when the budget cannot hold them: each layer's attention
    and the output head are read whole every token, so a share of them held in RAM saves its reads every
    token; the embeddings are touched a row a token."""
    layers: int
    layer_attention: int  # bytes of one layer's q, k, v and o
    head: int             # the output head's bytes (the embeddings' where they are tied)
    embeddings: int       # the embeddings' bytes where the head is a matrix of its own, else 0

    @classmethod
    def of(cls, manifest: Manifest, fixed: dict, kernels) -> "Mappable":
        arch, args = architecture(manifest.config)
        smallest = min(args.num_attention_heads, arch.kv_shape(args)[0]) * args.head_dim * args.hidden_size
        if manifest.resident_bits == 16 or not getattr(kernels, "quantized", False) or \
                smallest < STORED_MIN_WEIGHTS:  # a smaller matrix is held decoded, in RAM (kernels/backends.py)
            return cls(0, 0, 0, 0)
        n = len(manifest.layers)
        tied = manifest.config.get("tie_word_embeddings")
        matrices = fixed["embedding_head"] - 2 * args.hidden_size * F32
        return cls(n, fixed["attention"] // n, matrices if tied else matrices // 2, 0 if tied else matrices // 2)

    @property
    def total(self) -> int:
        return self.layers * self.layer_attention + self.head + self.embeddings

    @property
    def streaming(self) -> int:
        """What a token touches of mapped matrices at once: a layer's attention in use, the next one's read ahead,
        and the head."""
        return 2 * self.layer_attention + self.head


def _row_bytes(kernels, d_model: int):
    def row_bytes(count: int, held: bool = True) -> int:  # one row in a store of `count` rows
        return kernels.store_row_bytes(int(count), held) if kernels else d_model * F32
    return row_bytes


def plan(manifest: Manifest, kernels, options: DecodeOptions, hot_kernels=None) -> MemoryPlan:
    """Bytes per component, each layer's cache capacity and the read buffers, for rows held as the kernel
    backend `kernels` holds them (None: decoded to fp32), the hot tier's as `hot_kernels` (None: `kernels`). A
    cache holds at most `window` tokens' worth of neurons where a window is set, else all the layer's cold
    neurons; a budget cuts that to fit."""
    b, mode = manifest.bundle, options.mode
    row_bytes = _row_bytes(kernels, b.d_model)
    hot_row_bytes = _row_bytes(hot_kernels or kernels, b.d_model)
    fixed = _resident_bytes(manifest, mode, options, row_bytes, hot_row_bytes)
    mappable = Mappable.of(manifest, fixed, kernels)
    d_ffs = np.array([layer.d_ff for layer in manifest.layers])
    cold = np.array([layer.region.count for layer in manifest.layers])
    rows = b.exact_prefix if mode == "exact" else len(b.components)
    zeros = np.zeros_like(cold)
    if mode == "dense":  # every neuron held, as hot ones are
        fixed["hot_neurons"] = sum(len(layer.hot) * hot_row_bytes(len(layer.hot)) + int(n) * row_bytes(n)
                                   for layer, n in zip(manifest.layers, cold, strict=True)) * len(b.components)
        return _fit(fixed, 0, 0, zeros, zeros, None, options.ram_budget, mode, mappable)
    # hybrid's tokens and a flock's prompt: one layer's cold bundles at a time, read whole, held and dropped
    stream_buffer = -(-int(cold.max()) * b.stride // ALIGN) * ALIGN + ALIGN
    stream = stream_buffer + int(cold.max()) * len(b.components) * row_bytes(cold.max())
    if mode == "hybrid":
        return _fit(fixed, stream, stream_buffer, zeros, zeros, None, options.ram_budget, mode, mappable)
    # A token's own neurons should fit: a quarter more than the most calibration saw one token load. A token
    # that loads more still runs, through rows of its own and reads in several batches, at the cost of rereads.
    minimum = np.minimum(cold, np.ceil(1.25 * _most_loaded(manifest, mode) * d_ffs).astype(int))
    if options.flock:  # the flock's cold neurons pinned beside a token's own
        minimum = np.minimum(cold, minimum + np.array([flock_size(options.flock, n) for n in d_ffs]))
    capacity = cold.copy() if options.window is None else np.minimum(cold, options.window * minimum)
    def slot_bytes(count: int) -> int:  # a slot: the rows kept of a neuron, as a store of `count` keeps them
        return rows * row_bytes(max(int(count), 1), held=False)

    buffer = max(MIN_READ_BUFFER, -(-2 * int(minimum.max()) * b.stride // ALIGN) * ALIGN)
    readers = 2 if options.lookahead else 1
    # per reader: its buffer, the rows it yields as the backend keeps them, and the copies the products gather
    working = readers * (buffer + max(2 * int(n) * slot_bytes(n) for n in minimum))
    if options.flock:  # the prompt's stream, and its coefficients a chunk of tokens at a time (gate, up, product)
        buffer, working = max(buffer, stream_buffer), max(working, stream + 3 * CHUNK * int(d_ffs.max()) * F32)
    return _fit(fixed, working, buffer, minimum, capacity, slot_bytes, options.ram_budget, mode, mappable)


def _fit(fixed: dict, working: int, buffer: int, minimum, capacity, slot_bytes, budget: int | None,
         mode: str, mappable: Mappable) -> MemoryPlan:
    """The plan with each layer's cache as large as the budget allows, or a refusal naming the smallest. A
    larger store never keeps a row in more bytes, so a slot at a layer's minimum bounds it at any capacity.
    Where the budget cannot hold every matrix it could map, the caches keep their minimum and the budget left
    holds as many layers' attention as it can (then the head); the rest stays in the image file, read every
    token through the page cache, the next layer's read ahead."""
    slot = np.array([slot_bytes(n) for n in minimum]) if slot_bytes else np.zeros(len(minimum), dtype=int)
    base = sum(fixed.values()) + working
    need = base + int((minimum * slot).sum())
    smallest = min(need, need - mappable.total + mappable.streaming) if mappable.total else need
    mapped, held_layers, head_mapped = 0, len(minimum), False
    if budget is not None:
        if budget < smallest:
            given = f"{budget / 2**20:.0f} MiB" if budget >= 2**20 else f"{budget} bytes"
            raise LsparseError(f"a RAM budget of {given} cannot hold this image in {mode} mode: "
                               f"the smallest that works is {-(-smallest // 2**20)} MiB")
        if budget < need:
            room = budget - smallest
            held_layers = min(mappable.layers, room // max(mappable.layer_attention, 1))
            head_mapped = room - held_layers * mappable.layer_attention < mappable.head
            mapped = mappable.total - held_layers * mappable.layer_attention - (0 if head_mapped else mappable.head)
            base, capacity = base - mapped + mappable.streaming, minimum
        elif base + int((capacity * slot).sum()) > budget:  # the caches shared in proportion to their minimum
            scale = (budget - base) / max(int((minimum * slot).sum()), 1)
            capacity = np.minimum(capacity, np.maximum(minimum, np.floor(scale * minimum).astype(int)))
    cache = sum(int(c) * slot_bytes(c) for c in capacity) if slot_bytes else 0
    return MemoryPlan(**fixed, working_set=working, neuron_cache=cache, mapped=mapped,
                      held_attention_layers=held_layers, head_mapped=head_mapped, total=base + cache,
                      smallest_budget=smallest, read_buffer_bytes=buffer, cache_slots=tuple(int(c) for c in capacity))
