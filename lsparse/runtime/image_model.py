"""Decoding from a flash image: resident tensors in RAM, cold neurons paged in per token through a
sliding-window neuron cache, with an exact count of what each token cost."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from lsparse.calibrate.predictors import predictor_scores
from lsparse.errors import LsparseError
from lsparse.image.format import NEURONS, check_for_run, load_manifest
from lsparse.kernels import backends
from lsparse.kernels.cpu import gate_passes
from lsparse.model import Model, architecture
from lsparse.model.layers import relu
from lsparse.model.llama import gate_activation
from lsparse.runtime.reader import DEFAULT_GAP_BYTES, DEFAULT_READERS, FlashReader, coalesce
from lsparse.source.safetensors_store import SafetensorsFile
from lsparse.source.tokenizer import from_folder

MODES = ("exact", "predicted", "dense", "hybrid")
# A layer whose hot neurons hold this many weights or more computes them while its cold reads are in flight;
# below it handing the reads to a thread costs more than the overlap saves.
OVERLAP_MIN_WEIGHTS = 1 << 20
HYBRID_READ_BYTES = 1 << 20  # hybrid streams each region in requests of this size, spread over the workers


@dataclass
class TokenCost:
    """What the FFNs cost, summed over layers, for one forward call."""
    bytes_needed: int = 0
    bytes_read: int = 0
    requests: int = 0
    lookups: int = 0
    hits: int = 0
    io_s: float = 0.0          # waiting for reads
    read_s: float = 0.0        # the reads themselves, some of it while the hot neurons were computed
    mem_s: float = 0.0
    compute_s: float = 0.0
    lookahead_used: int = 0    # needed neurons that a lookahead read had already brought
    lookahead_wasted: int = 0  # neurons read ahead that the layer did not need


@dataclass
class CostLog:
    steps: list = field(default_factory=list)

    def start(self) -> TokenCost:
        self.steps.append(TokenCost())
        return self.steps[-1]


def _float(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _read(reader: FlashReader, offsets, lengths) -> tuple[np.ndarray, np.ndarray, int, float]:
    """reader.read_into, with a failed read (a truncated or vanished image) as one line for the user."""
    try:
        return reader.read_into(offsets, lengths)
    except OSError as e:
        raise LsparseError(f"reading neuron bundles failed ({e}); run lsparse verify on the image") from None


class NeuronCache:
    """One layer's cold neurons in RAM: preallocated row stores (one per row of a bundle kept, made by the
    kernel backend) and a slot table. A neuron stays while one of the last `window` tokens used it (LLM in a
    Flash's sliding window); freed slots are reused in place."""

    def __init__(self, n_neurons: int, capacity: int, n_rows: int, window: int, kernels):
        self.kernels = kernels
        self.rows = [kernels.empty(capacity) for _ in range(n_rows)]
        self.slot_of = np.full(n_neurons, -1, dtype=np.int64)
        self.neuron_of = np.full(capacity, -1, dtype=np.int64)
        self.last_used = np.full(capacity, -(1 << 40), dtype=np.int64)
        self.window = window
        self.clock = 0

    def evict_stale(self) -> None:
        stale = (self.neuron_of >= 0) & (self.last_used <= self.clock - self.window)
        self.slot_of[self.neuron_of[stale]] = -1
        self.neuron_of[stale] = -1

    def insert(self, neurons: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Place neurons' rows in free slots, then in those of the least recently used, never in this token's.
        Returns which were placed: a token needing more than the cache holds keeps the rest for itself."""
        free = np.flatnonzero(self.neuron_of < 0)
        if len(free) < len(neurons):
            used = np.flatnonzero((self.neuron_of >= 0) & (self.last_used < self.clock))
            victims = used[np.argsort(self.last_used[used])][: len(neurons) - len(free)]
            self.slot_of[self.neuron_of[victims]] = -1
            self.neuron_of[victims] = -1
            free = np.flatnonzero(self.neuron_of < 0)
        n = min(len(free), len(neurons))
        slots = free[:n]
        for k, store in enumerate(self.rows):
            self.kernels.put(store, slots, rows[:n, k])
        self.slot_of[neurons[:n]] = slots
        self.neuron_of[slots] = neurons[:n]
        self.last_used[slots] = self.clock
        return np.arange(len(neurons)) < n


@dataclass
class Lookahead:
    """A reader with buffers of its own and one thread to drive it, so that reads ahead never share buffers
    with the reads a layer is waiting for."""
    reader: FlashReader
    pool: ThreadPoolExecutor

    def close(self):
        self.pool.shutdown()
        self.reader.close()


class SparseFFN:
    """One layer's FFN from the image: hot neurons resident, cold ones read on demand (dense mode: every neuron
    resident), computed by a kernel backend (lsparse/kernels/backends.py)."""

    def __init__(self, arch, args, meta: dict, layer: dict, resident: dict, reader: FlashReader | None,
                 mode: str, window: int, threshold_shift: float, costs: CostLog, gap_bytes: int, capacity: int,
                 bundled: bool = True, trace=None, kernels=None):
        self.arch, self.args, self.mode, self.reader, self.costs = arch, args, mode, reader, costs
        self.bundled, self.trace, self.index = bundled, trace, layer["index"]
        b = meta["bundle"]
        self.components, self.stride, self.row_bytes = tuple(b["components"]), b["stride"], b["row_bytes"]
        q = meta["quantization"]
        self.kernels = kernels or backends.select("cpu", b["d_model"], q["bits"], q["group_size"])
        self.hot = np.asarray(layer["hot"], dtype=np.int64)
        self.hot_rows = self._hold(np.asarray(resident["hot_bundles"]), self.components)
        if mode == "exact":  # only exact mode computes the whole gate; the others never hold it
            projection = arch.EXACT_PROJECTION
            self.exact_rows = self._hold(np.asarray(resident["exact_rows"]), (projection,))[projection]
        self.bias = {k: _float(resident[k]) for k in ("up_bias", "down_bias") if k in resident}
        self.threshold = layer["activation_threshold"]
        self.threshold_on = layer.get("threshold_on", "gate")
        # the gate's rule: |silu(pre)| > threshold for SwiGLU images (CATS), else pre > the model's ReLU cut
        self.cats = self.threshold > 0
        self.cut = self.threshold if self.cats else getattr(args, "relu_threshold", 0.0)
        if mode == "exact" and self.threshold > 0 and self.threshold_on != "gate":
            raise LsparseError("exact mode needs the mask from the resident gate alone; this SwiGLU image cuts "
                               "by |silu(gate) x up| (compile --threshold-on product): run it in predicted, "
                               "hybrid or dense mode")
        d_ff = layer["d_ff"]
        self.position = np.full(d_ff, -1, dtype=np.int64)  # a cold neuron's bundle index in its region
        self.position[np.asarray(layer["cold_order"], dtype=np.int64)] = np.arange(len(layer["cold_order"]))
        self.is_cold = self.position >= 0
        self.cold_in_file_order = np.asarray(layer["cold_order"], dtype=np.int64)
        self.region, self.region_size = layer["region"]["offset"], layer["region"]["size"]
        self.predictor = {k: _float(resident[k]) for k in ("A", "B", "bias", "W1", "W2", "b2") if k in resident}
        self.kind = meta["predictor"]["kind"]
        if mode == "predicted" and self.kind == "exact":
            raise LsparseError("this image was compiled with --predictor exact: run it in exact or dense mode")
        if layer["predictor"]["threshold"] is not None:
            self.predictor_threshold = layer["predictor"]["threshold"] + threshold_shift
        # exact mode reads the rows ahead of the resident projection; the others read whole bundles
        self.read_rows = self.components[: b["exact_prefix"]] if mode == "exact" else self.components
        self.cache = NeuronCache(d_ff, capacity, len(self.read_rows), window, self.kernels)
        self.gap_bytes = gap_bytes
        self.next = None       # the next layer's SparseFFN, to read ahead for
        self.lookahead = None  # a Lookahead when this layer's neurons may be read ahead
        self.pending = None    # the read ahead in flight for this layer
        self.background = None  # a thread that drives this layer's reads while it computes the hot neurons

    def _activation(self, pre, up):
        """Coefficient on the down column from the gate (or fc1) pre-activation and the up values; dense mode
        keeps every neuron (the model as compiled, without the image's cut)."""
        if "gate" not in self.components:  # OPT: relu(fc1 x + b)
            return relu(pre, np)
        a = gate_activation(self.args, pre, up, np)
        if self.cats and self.mode != "dense":
            return a * (gate_passes(pre, self.cut, True) if self.threshold_on == "gate"
                        else np.abs(a) > self.threshold)
        return a

    def __call__(self, args, w, x, xp):
        if self.mode == "hybrid":
            return self._stream_all(x)
        if self.mode == "dense":
            return self._dense(x)
        cost = self.costs.steps[-1]
        start = time.perf_counter()
        active, pre_all = self._predict(x)
        needed = active[self.is_cold[active]]
        if self.next is not None and self.next.lookahead is not None:
            self.next._read_ahead(x)
        compute = time.perf_counter() - start
        ahead = self._collect_read_ahead(cost)

        start = time.perf_counter()
        cache = self.cache
        cache.clock += 1
        cache.evict_stale()
        hit_slots = cache.slot_of[needed]
        cache.last_used[hit_slots[hit_slots >= 0]] = cache.clock  # this token's neurons are not evicted
        missing = needed[hit_slots < 0]
        cost.lookups += len(needed)
        cost.hits += len(needed) - len(missing)
        io, hot_s, hot_out = 0.0, 0.0, None
        overflow, overflow_rows = missing[:0], None
        if ahead is not None:  # the rows a lookahead brought stand in for reads
            neurons, block, wait = ahead
            io += wait
            used = np.isin(neurons, missing)
            cost.lookahead_used += int(used.sum())
            cost.bytes_needed += int(used.sum()) * len(self.read_rows) * self.row_bytes
            cost.lookahead_wasted += int((~used).sum())
            placed = cache.insert(neurons[used], block[used])
            overflow, overflow_rows = neurons[used][~placed], block[used][~placed]
            missing = missing[~np.isin(missing, neurons)]
        if len(missing):
            order = np.argsort(self.position[missing])
            positions, prefix = self.position[missing[order]], len(self.read_rows) * self.row_bytes
            if self.background is not None:  # the hot neurons' sum while the reads are in flight
                started = time.perf_counter()
                pending = self.background.submit(self._read, positions, prefix)
                hot_out = self._partial(x, self.hot, self.hot_rows, None, pre_all)
                hot_s = time.perf_counter() - started
                rows, read_s = pending.result()
                io += time.perf_counter() - started - hot_s
            else:
                rows, read_s = self._read(positions, prefix)
                io += read_s
            cost.read_s += read_s
            block = self._rows_block(rows)
            placed = cache.insert(missing[order], block)
            overflow = np.concatenate([overflow, missing[order][~placed]])
            overflow_rows = block[~placed] if overflow_rows is None else np.concatenate([overflow_rows,
                                                                                          block[~placed]])
        cached = needed[cache.slot_of[needed] >= 0]
        slots = cache.slot_of[cached]
        cache.last_used[slots] = cache.clock
        cost.io_s += io
        cost.mem_s += time.perf_counter() - start - io - hot_s

        start = time.perf_counter()
        stores = dict(zip(self.read_rows, cache.rows, strict=True))
        if hot_out is None:
            hot_out = self._partial(x, self.hot, self.hot_rows, None, pre_all)
        out = hot_out + self._partial(x, cached, stores, slots, pre_all)
        if len(overflow):
            extra = {c: self.kernels.hold(overflow_rows[:, k]) for k, c in enumerate(self.read_rows)}
            out = out + self._partial(x, overflow, extra, None, pre_all)
        if "down_bias" in self.bias:
            out = out + self.bias["down_bias"]
        cost.compute_s += time.perf_counter() - start + compute + hot_s
        return out

    def _predict(self, x):
        """(the neurons active for any row of x, ascending; the resident projection's values or None)."""
        if self.mode == "exact":  # the dense gate product, then the active neurons compacted
            pre_all, active = self.kernels.gate(self.exact_rows, x, self.bias.get("up_bias"), self.cut, self.cats)
            return active, pre_all
        if self.trace is not None:  # a synthetic image: the recorded masks, replayed
            return np.flatnonzero(self.trace.mask(self.index)), None
        return np.flatnonzero((predictor_scores(self.kind, self.predictor, x) > self.predictor_threshold).any(0)), None

    def _rows_block(self, rows: np.ndarray) -> np.ndarray:
        """Bundle bytes to (neurons, rows read, row) as the cache keeps them."""
        return self.kernels.prepare(rows, len(self.read_rows))

    def _hold(self, bundles: np.ndarray, components) -> dict:
        """{component: a held store of its rows} from bundle bytes."""
        block = self.kernels.prepare(bundles, len(components))
        return {c: self.kernels.hold(block[:, k]) for k, c in enumerate(components)}

    def _read_ahead(self, x_before: np.ndarray) -> None:
        """Lookahead: guess this layer's neurons from the previous layer's FFN input (the hidden state changes
        little from layer to layer: Deja Vu, ShadowLLM) and start reading the uncached ones in the background,
        with a reader of their own, while the previous layer reads and computes."""
        guess, _ = self._predict(x_before)
        want = guess[self.is_cold[guess]]
        want = want[self.cache.slot_of[want] < 0]
        if len(want):
            want = want[np.argsort(self.position[want])]
            self.pending = self.lookahead.pool.submit(self._fetch_ahead, want)

    def _fetch_ahead(self, neurons: np.ndarray):
        prefix = len(self.read_rows) * self.row_bytes
        rows, spans, transferred, read_s = self._read_spans(self.position[neurons], prefix, self.lookahead.reader)
        return neurons, self._rows_block(rows), transferred, spans, read_s

    def _collect_read_ahead(self, cost):
        """The lookahead read started for this layer, once it has arrived: (neurons, rows, seconds waited)."""
        if self.pending is None:
            return None
        start = time.perf_counter()
        try:
            neurons, block, transferred, spans, read_s = self.pending.result()
        finally:
            self.pending = None
        cost.bytes_read += transferred
        cost.requests += spans
        cost.read_s += read_s
        return neurons, block, time.perf_counter() - start

    def _read(self, positions: np.ndarray, prefix: int) -> tuple[np.ndarray, float]:
        """The first `prefix` bytes of the bundles at these sorted file positions, one row of bytes each, and
        the I/O seconds. Bundled: neighbours coalesced under the gap rule. Unbundled (the ablation): each row
        of each neuron is a request of its own, as when gate rows, up rows and down columns are stored apart."""
        cost = self.costs.steps[-1]
        rows, spans, transferred, io = self._read_spans(positions, prefix, self.reader)
        cost.bytes_needed += len(positions) * prefix
        cost.bytes_read += transferred
        cost.requests += spans
        return rows, io

    def _read_spans(self, positions: np.ndarray, prefix: int, reader) -> tuple[np.ndarray, int, int, float]:
        """(rows of bytes, requests, bytes transferred, seconds) for the bundles at these file positions."""
        if self.bundled:
            offsets, lengths, run = coalesce(positions, self.stride, self.region, self.gap_bytes)
        else:
            offsets = (self.region + positions[:, None] * self.stride
                       + np.arange(prefix // self.row_bytes) * self.row_bytes).ravel()
            lengths, run = np.full(len(offsets), self.row_bytes), None
        buffer, at, transferred, io = _read(reader, offsets, lengths)
        if not len(positions):
            return np.zeros((0, prefix), dtype=np.uint8), 0, transferred, io
        if self.bundled:  # each bundle's place in the buffer: its run's, and its own within the run
            where = at[run] + self.region + positions * self.stride - offsets[run]
            rows = np.lib.stride_tricks.sliding_window_view(buffer, prefix)[where]
        else:
            rows = np.lib.stride_tricks.sliding_window_view(buffer, self.row_bytes)[at].reshape(len(positions), prefix)
        return rows, len(offsets), transferred, io

    def _stream_all(self, x):
        """The hybrid baseline: every cold bundle of the layer read and decoded, used once, then dropped."""
        cost = self.costs.steps[-1]
        start = time.perf_counter()
        size = self.region_size
        starts = np.arange(0, size, HYBRID_READ_BYTES)
        lengths = np.minimum(HYBRID_READ_BYTES, size - starts)
        buffer, at, transferred, io = _read(self.reader, self.region + starts, lengths)
        data = np.concatenate([buffer[a:a + n] for a, n in zip(at.tolist(), lengths.tolist(), strict=True)])
        rows = self._hold(data.reshape(-1, self.stride), self.components)
        cost.bytes_needed += size
        cost.bytes_read += transferred
        cost.requests += len(starts)
        cost.io_s += io
        cost.read_s += io
        cost.mem_s += time.perf_counter() - start - io
        start = time.perf_counter()
        out = (self._partial(x, self.hot, self.hot_rows, None, None)
               + self._partial(x, self.cold_in_file_order, rows, None, None))
        if "down_bias" in self.bias:
            out = out + self.bias["down_bias"]
        cost.compute_s += time.perf_counter() - start
        return out

    def _dense(self, x):
        """Dense mode: every neuron is resident (load_image made them all hot)."""
        start = time.perf_counter()
        out = self._partial(x, self.hot, self.hot_rows, None, None)
        if "down_bias" in self.bias:
            out = out + self.bias["down_bias"]
        self.costs.steps[-1].compute_s += time.perf_counter() - start
        return out

    def _partial(self, x, neurons, stores, slots, pre_all):
        """The FFN output of these neurons, whose rows are in `stores` at `slots` (None: all of a held store)."""
        if len(neurons) == 0:
            return np.zeros((x.shape[0], self.args.hidden_size), dtype=np.float32)
        if pre_all is not None:
            pre = pre_all[:, neurons]
        else:
            pre = self.kernels.mv(stores[self.arch.EXACT_PROJECTION], slots, x)
            if "up_bias" in self.bias:
                pre = pre + self.bias["up_bias"][neurons]
        up = self.kernels.mv(stores["up"], slots, x) if "gate" in self.components else None
        return self.kernels.vm(stores["down"], slots, self._activation(pre, up))


class ImageModel:
    """A Model over an image's weights; generation calls it like the dense Model."""

    def __init__(self, model: Model, ffns: list, costs: CostLog, meta: dict, reader, kernels):
        self.model, self.ffns, self.costs, self.meta, self.reader = model, ffns, costs, meta, reader
        self.kernels = kernels
        self.trace = ffns[0].trace if ffns else None
        self.dense = not ffns or ffns[0].mode == "dense"
        self.xp, self.make_cache, self.context_length = model.xp, model.make_cache, model.context_length

    def __call__(self, tokens, cache, ffn_fns=None):
        if ffn_fns is not None:
            raise ValueError("an image model's FFNs are its own")
        self.costs.start()
        if self.dense or (len(tokens) == 1 and self.trace is None):
            return self.model(tokens, cache, self.ffns)
        # A prompt goes through token by token, as decoding does: a neuron cache sized for one token's
        # neurons need not hold the union of a whole prompt's.
        out = []
        for t in tokens:
            if self.trace is not None:
                self.trace.step()
            out.append(self.model([t], cache, self.ffns))
        return np.concatenate(out)

    def close(self) -> None:
        for reader in {id(r): r for r in [self.reader] + [f.lookahead for f in self.ffns] if r}.values():
            reader.close()
        for pool in {id(f.background): f.background for f in self.ffns if f.background}.values():
            pool.shutdown()

    def dense_ffn_bytes(self) -> int:
        """What a dense step reads of the FFN at the image's precision: every bundle of every layer."""
        return sum(layer["d_ff"] for layer in self.meta["layers"]) * self.meta["bundle"]["stride"]


def _resident(path: Path) -> dict:
    """A resident file's tensors: bundle bytes as uint8, the rest as float32."""
    f = SafetensorsFile(path)
    return {name: f.get(name, as_float=f.entries[name][0] != "U8") for name in f.entries}


def load_image(image, mode: str = "exact", window: int = 5, threshold_shift: float = 0.0,
               gap_bytes: int | None = None, direct: bool = True, workers: int = DEFAULT_READERS,
               ram_budget: int | None = None, tokens: int = 2048, bundled: bool = True, lookahead: bool = False,
               kernels: str = "auto"):
    """(ImageModel, tokenizer) for an image, in one of MODES; with `ram_budget`, the neuron caches are sized to
    fit it (for `tokens` of context) or the budget is refused. `bundled=False` reads each row of a neuron
    apart (an ablation: what bundling saves). `gap_bytes` None: the gap rule measured on the image's device.
    `lookahead`: each layer starts reading the next one's guessed neurons in the background. `kernels`: the
    backend that computes the FFNs (lsparse/kernels/backends.py): auto is Metal on a Mac, numpy elsewhere;
    mlx keeps 4/8-bit rows as stored and multiplies with MLX's quantized kernel."""
    if mode not in MODES:
        raise LsparseError(f"unknown mode {mode!r} (choose from {', '.join(MODES)})")
    image = Path(image)
    meta = load_manifest(image)
    check_for_run(image, meta)
    q = meta["quantization"]
    backend = backends.select(kernels, meta["bundle"]["d_model"], q["bits"], q["group_size"])
    from lsparse.runtime.budget import plan
    memory = plan(meta, mode, tokens, ram_budget, backend, window)
    arch, args = architecture(meta["config"])
    globals_ = {k: _float(v) for k, v in _resident(image / "resident" / "globals.safetensors").items()}
    trace = None
    if meta["predictor"]["kind"] == "trace":
        from lsparse.bench.synthetic import TRACE, Trace
        if mode not in ("predicted", "hybrid") or lookahead:
            raise LsparseError(f"{image} is synthetic (random weights, neuron masks replayed from a recorded "
                               "trace): run it in predicted or hybrid mode, without lookahead")
        trace = Trace(image / TRACE)
    costs = CostLog()
    reader = FlashReader(image / NEURONS, workers=workers, direct=direct) if mode != "dense" else None
    gap_rule = "given"
    if gap_bytes is None:
        from lsparse.runtime.device import gap_for
        gap_bytes, gap_rule = gap_for(image / NEURONS, workers) if reader and reader.direct \
            else (DEFAULT_GAP_BYTES, "default")
    layers, ffns = [], []
    for layer in meta["layers"]:
        resident = _resident(image / "resident" / f"layer-{layer['index']:03d}.safetensors")
        weights = {k: _float(v) for k, v in resident.items() if v.dtype != np.uint8 and k not in
                   ("A", "B", "bias", "W1", "W2", "b2")}
        if mode == "dense":
            layer, resident = _all_resident(image, meta, layer, resident)
        ffns.append(SparseFFN(arch, args, meta, layer, resident, reader, mode, window, threshold_shift, costs,
                              gap_bytes, memory["cache_slots"][layer["index"]], bundled, trace, backend))
        layers.append(weights)
    if mode in ("exact", "predicted"):
        background = ThreadPoolExecutor(1)
        for ffn in ffns:
            if len(ffn.hot) * meta["bundle"]["d_model"] >= OVERLAP_MIN_WEIGHTS:
                ffn.background = background
    if lookahead and ffns and mode in ("exact", "predicted"):
        ahead = Lookahead(FlashReader(image / NEURONS, workers=workers, direct=direct), ThreadPoolExecutor(1))
        for this, nxt in zip(ffns, ffns[1:], strict=False):
            this.next, nxt.lookahead = nxt, ahead
    model = Model(arch, args, globals_, layers, np)
    tokenizer = from_folder(image, meta["config"])
    image_model = ImageModel(model, ffns, costs, meta, reader, backend)
    image_model.memory_plan = memory
    image_model.gap = {"bytes": gap_bytes, "rule": gap_rule}
    return image_model, tokenizer


def _all_resident(image: Path, meta: dict, layer: dict, resident: dict) -> tuple[dict, dict]:
    """Dense mode (the all-in-RAM baseline): the layer with every neuron hot, its cold bundles read from the
    neuron file into the resident ones."""
    r = layer["region"]
    with open(image / NEURONS, "rb") as f:
        f.seek(r["offset"])
        cold = np.frombuffer(f.read(r["size"]), dtype=np.uint8).reshape(r["count"], meta["bundle"]["stride"])
    hot = list(layer["hot"]) + list(layer["cold_order"])
    return {**layer, "hot": hot}, {**resident, "hot_bundles": np.concatenate([resident["hot_bundles"], cold])}
