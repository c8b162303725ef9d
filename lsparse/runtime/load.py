"""Loading an image for decoding: the plan made, the kernel backend, reader and each layer's FFN chosen once,
here; then generation calls the ImageModel like the dense Model."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from lsparse.errors import LsparseError
from lsparse.image.image import Image
from lsparse.kernels import backends
from lsparse.model import Model, architecture
from lsparse.model.backend import array_module
from lsparse.model.sparq import SparQ, rank_for
from lsparse.runtime import predictors
from lsparse.runtime.cache import NeuronCache
from lsparse.runtime.costs import CostLog, flash_report
from lsparse.runtime.fetch import Fetcher, RowCheck
from lsparse.runtime.ffn import Activation, HotNeurons, NeuronProducts
from lsparse.runtime.ffn_paged import PagedFFN
from lsparse.runtime.ffn_streamed import DenseFFN, StreamedFFN
from lsparse.runtime.flock import FlockPrefill
from lsparse.runtime.kv_flash import KVSpill
from lsparse.runtime.options import DecodeOptions
from lsparse.runtime.plan import MemoryPlan, plan
from lsparse.runtime.reader import DEFAULT_GAP_BYTES
from lsparse.runtime.resident import read_ahead_in_turn
from lsparse.runtime.resident import weights as resident_weights


class ImageModel:
    """A Model over an image's weights, with what each forward call cost in `costs`."""

    def __init__(self, image: Image, model: Model, ffns: list, costs: CostLog, memory: MemoryPlan,
                 fetcher: Fetcher | None, kernels, gap: dict, trace, verifiers: list | None = None,
                 flock: list | None = None):
        self.image, self.model, self.ffns, self.costs, self.memory_plan = image, model, ffns, costs, memory
        self.verifiers = verifiers  # with correction: each layer's dense path (runtime/correct.py)
        self.flock = flock  # with --flock: each layer's FlockPrefill, for a sequence's first call
        self.fetcher, self.kernels, self.gap, self.trace = fetcher, kernels, gap, trace
        self.xp, self.make_cache, self.context_length = model.xp, model.make_cache, model.context_length
        # SparQ attends its way one query at a time: its model takes every call token by token
        self.token_by_token = (isinstance(ffns[0], PagedFFN) if ffns else False) or model.sparq is not None

    def __call__(self, tokens, cache, ffn_fns=None, last_only: bool = False):
        if ffn_fns is not None:
            raise ValueError("an image model's FFNs are its own")
        self.costs.start()
        if self.flock and cache[0].offset == 0:  # a sequence's prompt: each layer's flock chosen from it
            return self.model(tokens, cache, self.flock, last_only)
        if not self.token_by_token and self.trace is None:
            return self.model(tokens, cache, self.ffns, last_only)
        # A prompt goes through token by token, as decoding does: a neuron cache sized for one token's
        # neurons need not hold the union of a whole prompt's (and a replayed trace moves one token a step).
        out, before = [], _attention_reads(cache) if self.model.sparq is not None else None
        for t in tokens:
            if self.trace is not None:
                self.trace.step()
            out.append(self.model([t], cache, self.ffns))
            if last_only:  # a prompt's earlier tokens' logits are not wanted
                del out[:-1]
        if before is not None:  # what SparQ read of the KV cache in this call
            for name, was, now in zip(ATTENTION_READS, before, _attention_reads(cache), strict=True):
                setattr(self.costs.now, name, now - was)
        return self.xp.concatenate(out)

    def verify(self, tokens, cache):
        """Logits (T, vocab) of the dense path for `tokens` in one call: every neuron, each layer's cold region
        streamed once for all of them."""
        self.costs.start()
        return self.model(tokens, cache, self.verifiers)

    def dense_ffn_bytes(self) -> int:
        return self.image.manifest.dense_ffn_bytes()

    def flash_report(self, since: int = 0, tokens: int | None = None) -> dict:
        """Per decoded token of the calls from the `since`-th on (the first: a prompt): what the FFNs read and
        where the time went (costs.flash_report), and how; `tokens`: how many those calls decoded, where it
        is not one a call."""
        return {**flash_report(self.costs.steps[since:], self.dense_ffn_bytes(), tokens),
                "direct_io": self.fetcher.reader.direct,
                "gap_bytes": self.gap["bytes"], "gap_rule": self.gap["rule"]}

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
        if self.model.kv_pages is not None:
            self.model.kv_pages.close()


# TokenCost's fields for what SparQ attention read, and the caches' counters they sum (runtime/kv_flash.py's
# caches count their pages' reads too)
ATTENTION_READS = {"attention_bytes": "bytes_read", "attention_full_bytes": "bytes_full",
                   "kv_flash_bytes": "flash_bytes", "kv_flash_reads": "flash_reads", "kv_flash_s": "flash_s"}


def _attention_reads(cache) -> list:
    return [sum(getattr(c, counter, 0) for c in cache) for counter in ATTENTION_READS.values()]


def load_image(image, options: DecodeOptions | None = None, **fields) -> tuple[ImageModel, object]:
    """(ImageModel, tokenizer) for an image (a path or an Image), decoding as `options` says (or a
    DecodeOptions built from `fields`). With a RAM budget the plan fits in it or the image is refused."""
    options = options or DecodeOptions(**fields)
    image = image if isinstance(image, Image) else Image.open(image)
    image.check_for_run()
    m = image.manifest
    backend, memory = plan_image(image, options)
    tier = hot_backend(image, options, backend)
    if getattr(backend, "quantized", False):  # the C kernels' threads share the cores: OpenBLAS gets one
        from lsparse.kernels.native import limit_blas_threads
        limit_blas_threads(1)
    if backend.lazy and options.ram_budget is not None:
        # MLX keeps freed buffers for reuse unless told: within the budget, no more than one layer's reads
        array_module("mlx").set_cache_limit(memory.working_set)
    trace = _trace(image, options)
    if options.flock and trace is not None:
        raise LsparseError("--flock chooses neurons from a prompt's real activations: a synthetic image replays "
                           "recorded masks")
    if options.correct_every and (trace is not None or options.ram_budget is not None):
        raise LsparseError("--correct-every needs a real model's image and no --ram-budget (the dense pass's "
                           "reads of whole layers are not in the memory plan)")
    fetcher, gap = _fetcher(image, options, memory)
    arch, args = architecture(m.config)
    costs = CostLog()
    layers, ffns, verifiers, flock = [], [], [], []

    # A lazy backend's products are MLX graphs: the model around them runs in MLX too, its weights MLX arrays
    xp = array_module("mlx") if backend.lazy else np

    def held(tensors: dict, leave_out=()) -> dict:  # resident tensors as the model code multiplies them
        weights = resident_weights(tensors, arch.MATRICES, m.resident_bits, m.resident_group_size, backend.name,
                                   leave_out)
        return {k: xp.array(v) if isinstance(v, np.ndarray) else v for k, v in weights.items()}
    for layer in m.layers:  # matrices the plan leaves in the image file are mapped from it
        mapped = arch.MATRICES if memory.mapped and layer.index >= memory.held_attention_layers else ()
        resident = image.layer_tensors(layer.index, mapped)
        layers.append(held(resident, leave_out=predictors.PREDICTOR_TENSORS))
        ffn = _layer_ffn(image, layer, resident, options, arch, args, (backend, tier), memory, fetcher, trace, costs)
        ffns.append(ffn)
        if options.correct_every:  # the dense model's FFN: every neuron, no CATS cut (the dense mode's rule)
            activation = Activation.of(layer, arch, args, "dense")
            dense, hot = (NeuronProducts(k, arch, m.bundle.d_model, activation, resident) for k in (backend, tier))
            verifiers.append(StreamedFFN(layer, dense, replace(ffn.hot, products=hot), fetcher, ffn.check,
                                         ffn.rows_read, costs))
        if options.flock:
            flock.append(FlockPrefill(ffn, fetcher, m.bundle.components, options.flock))
    if options.lookahead:
        for this, nxt in zip(ffns, ffns[1:], strict=False):
            this.next = nxt
    globals_ = held(image.resident("globals", ("embed",) * bool(memory.mapped) + ("lm_head",) * memory.head_mapped))
    sparq = None if options.kv_top_k is None else SparQ(rank_for(options.kv_rank, args.head_dim),
                                                        options.kv_top_k)
    kv_pages = None if options.kv_ram_tokens is None else KVSpill(image.path, options.kv_ram_tokens, sparq,
                                                                     options.direct)
    model = Model(arch, args, globals_, layers, xp, sparq, kv_pages)
    read_ahead_in_turn([[w[k] for k in arch.MATRICES if k in w] for w in layers] +
                       [[globals_.get("lm_head", globals_["embed"])]])
    return ImageModel(image, model, ffns, costs, memory, fetcher, backend, gap, trace, verifiers or None,
                      flock or None), image.tokenizer()


def plan_image(image: Image, options: DecodeOptions) -> tuple[object, MemoryPlan]:
    """The kernel backend `options` choose for this image, and the memory plan for rows held as it (and the hot
    tier's backend) holds them (a refusal, naming the smallest budget, where `options.ram_budget` cannot hold
    the image)."""
    b = image.manifest.bundle
    backend = backends.select(options.kernels, b.d_model, b.bits, b.group_size)
    return backend, plan(image.manifest, backend, options, hot_backend(image, options, backend))


def hot_backend(image: Image, options: DecodeOptions, backend):
    """The backend of the hot neurons' precision tier: `backend` where the image has one precision. (Both are
    lazy or neither: metal, reference and emulated are lazy at every precision, cpu and mlx at none.)"""
    m = image.manifest
    if m.hot_bits is None:
        return backend
    return backends.select(options.kernels, m.bundle.d_model, m.hot_bits, m.bundle.group_size)


def _trace(image: Image, options: DecodeOptions):
    """A synthetic image's replayed masks, in the modes that can use them."""
    if image.manifest.predictor != "trace":
        return None
    from lsparse.image.trace import TRACE, Trace
    trace = Trace(image.file(TRACE))
    if options.mode not in ("predicted", "hybrid") or (options.lookahead and trace.ahead is None):
        raise LsparseError(f"{image.path} is synthetic (random weights, neuron masks replayed from a recorded "
                           "trace): run it in predicted or hybrid mode (with lookahead only where the trace "
                           "recorded the lookahead's guesses)")
    return trace


def _fetcher(image: Image, options: DecodeOptions, memory: MemoryPlan) -> tuple[Fetcher | None, dict]:
    """The neuron file's fetcher, its buffers sized by the plan, and the gap rule (measured on the device
    through that reader, once per device)."""
    if options.mode == "dense":
        return None, {"bytes": 0, "rule": "no reads"}
    b = image.manifest.bundle
    fetcher = Fetcher(image.neurons, b.stride, b.row_bytes, options.gap_bytes or 0, options.bundled,
                      options.readers, options.direct, memory.read_buffer_bytes,
                      options.lookahead and options.mode in ("exact", "predicted"))
    if options.gap_bytes is not None:
        return fetcher, {"bytes": options.gap_bytes, "rule": "given"}
    from lsparse.runtime.device import gap_for
    fetcher.gap_bytes, rule = gap_for(fetcher.reader) if fetcher.reader.direct else (DEFAULT_GAP_BYTES, "default")
    return fetcher, {"bytes": fetcher.gap_bytes, "rule": rule}


def _layer_ffn(image, layer, resident, options, arch, args, kernels, memory, fetcher, trace, costs):
    """One layer's FFN, of the kind its mode needs; `kernels`: the backends of the cold and the hot tier."""
    b = image.manifest.bundle
    (backend, tier), activation = kernels, Activation.of(layer, arch, args, options.mode)
    products = NeuronProducts(backend, arch, b.d_model, activation, resident)
    hot_products = products if tier is backend else NeuronProducts(tier, arch, b.d_model, activation, resident)
    hot = HotNeurons(layer.hot, hot_products, hot_products.hold(resident["hot_bundles"], b.components),
                     tier is not backend)
    rows_read = b.components[: b.exact_prefix] if options.mode == "exact" else b.components
    check = RowCheck(resident["cold_row_sums"], len(rows_read), b.row_bytes, layer.index)
    if options.mode == "dense":
        r = layer.region
        with open(image.neurons, "rb") as f:
            f.seek(r.offset)
            cold = np.frombuffer(f.read(r.size), dtype=np.uint8).reshape(r.count, b.stride)
        check(np.arange(r.count), cold)
        return DenseFFN(hot, layer.cold_order, products, products.hold(cold, b.components), costs)
    if options.mode == "hybrid":
        return StreamedFFN(layer, products, hot, fetcher, check, b.components, costs)
    exact_rows = None
    if options.mode == "exact":  # only exact mode holds the whole gate
        exact_rows = products.hold(resident["exact_rows"], (arch.EXACT_PROJECTION,))[arch.EXACT_PROJECTION]
    predictor = predictors.choose(image.manifest, layer, options.mode, resident, exact_rows, backend, activation,
                                  trace, options.threshold_shift, options.cache_bias)
    # Under a budget the caches' RAM is planned and held anyway: map it now, not while the first tokens run
    cache = NeuronCache(layer.d_ff, memory.cache_slots[layer.index], len(rows_read), options.window, backend,
                        prefault=options.ram_budget is not None)
    return PagedFFN(layer, products, hot, predictor, cache, fetcher, check, rows_read, costs, options.flock_rule)
