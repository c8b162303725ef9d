"""The paged FFN (exact and predicted modes): hot neurons resident, cold ones found by the layer's predictor,
looked up in its neuron cache and read from flash on a miss."""

from __future__ import annotations

import time

import numpy as np

from lsparse.image.manifest import Layer
from lsparse.runtime.cache import NeuronCache
from lsparse.runtime.costs import CostLog, timed
from lsparse.runtime.fetch import Fetched, Fetcher, RowCheck
from lsparse.runtime.ffn import HotNeurons, NeuronProducts

# A layer whose hot neurons hold this many weights or more computes them while its cold reads are in flight;
# below it handing the reads to a thread costs more than the overlap saves.
OVERLAP_MIN_WEIGHTS = 1 << 20


class PagedFFN:
    def __init__(self, layer: Layer, products: NeuronProducts, hot: HotNeurons, predictor, cache: NeuronCache,
                 fetcher: Fetcher, check: RowCheck, rows_read: tuple[str, ...], costs: CostLog,
                 flock_rule: str = "add"):
        self.layer, self.products, self.hot, self.predictor = layer, products, hot, predictor
        self.cache, self.fetcher, self.check, self.rows_read, self.costs = cache, fetcher, check, rows_read, costs
        self.position = np.full(layer.d_ff, -1, dtype=np.int64)  # (d_ff,) a cold neuron's place in its region
        self.position[layer.cold_order] = np.arange(len(layer.cold_order))
        self.is_cold = self.position >= 0
        self.prefix = len(rows_read) * fetcher.row_bytes  # the bytes of a bundle this mode reads
        self.overlap = len(layer.hot) * products.d_model >= OVERLAP_MIN_WEIGHTS
        self.next = None      # the next layer's PagedFFN, to read ahead for (the lookahead)
        self.pending = None   # a read started ahead for this layer
        self.flock_rule = flock_rule  # how a flock, once chosen, shapes the mask (runtime/flock.py)
        self.flock = None     # (n,) ascending: the sequence's flock, chosen from its prompt
        self.in_flock = np.zeros(layer.d_ff, dtype=bool)

    def __call__(self, args, w, x, xp):
        cost = self.costs.now
        with timed(cost, "compute_s"):
            active, pre = self._predict(x, cost)  # (n_active,) ascending; gate values or None
            needed = active[self.is_cold[active]]
        start = time.perf_counter()
        missing = self.cache.lookup(needed)
        cost.lookups, cost.hits = cost.lookups + len(needed), cost.hits + len(needed) - len(missing)
        extra = []  # (neurons, rows) the cache could not place: a token needing more than it holds
        missing, waited_ahead = self._use_read_ahead(missing, extra, cost)
        hot_out, waited, hot_s = self._read_missing(x, missing, pre, extra, cost)
        cost.io_s += waited_ahead + waited
        cost.mem_s += time.perf_counter() - start - waited_ahead - waited - hot_s
        cost.compute_s += hot_s
        with timed(cost, "compute_s"):
            if hot_out is None:
                hot_out = self.hot.partial(x, pre)
            cached, slots = self.cache.held(needed)
            out = hot_out + self.products.partial(x, cached, dict(zip(self.rows_read, self.cache.rows, strict=True)),
                                                  slots, pre)
            for neurons, rows in extra:
                held = {c: self.products.kernels.hold(rows[:, k]) for k, c in enumerate(self.rows_read)}
                out = out + self.products.partial(x, neurons, held, None, pre)
            return self.products.finish(out)

    def _predict(self, x, cost) -> tuple[np.ndarray, object]:
        """(the neurons x needs, ascending; the gate's values for every neuron or None), the flock's rule
        applied; the lookahead's reads for the next layer started."""
        if self.flock is not None and self.flock_rule == "core":
            return self.flock, None
        # A numpy predictor reads x on the host: with a lazy backend the layer's one evaluation
        x_predicted = x if self.predictor.takes_graph else self.products.kernels.host(x)[0]
        nxt, guess = self.next, None
        if nxt is not None and self.predictor.takes_graph and nxt.predictor.takes_graph:
            (active, pre), guess = self.predictor.predict_and_guess(x, nxt.predictor)  # one read for both
        else:
            # a cache-aware predictor (DIP) favours the cached neurons
            cached = self.cache.slot_of >= 0 if getattr(self.predictor, "cache_bias", 0) else None
            active, pre = self.predictor.predict(x_predicted, cached)
        cost.missed += getattr(self.predictor, "missed", 0)
        if nxt is not None:
            nxt.read_ahead(x if nxt.predictor.takes_graph else x_predicted, guess)
        if self.flock is not None and self.flock_rule == "within":
            active = active[self.in_flock[active]]
        return active, pre

    def follow(self, flock: np.ndarray, cold_bundles: np.ndarray) -> None:
        """A new sequence's flock (ascending), its cold neurons' rows pinned in the cache from `cold_bundles`
        (count, stride): the layer's cold region as streamed, in file order."""
        self.flock, self.in_flock[:] = flock, False
        self.in_flock[flock] = True
        cold = flock[self.is_cold[flock]]
        self.cache.pin(cold, self._block_of(cold_bundles[self.position[cold]]))

    def _read_missing(self, x, missing, pre, extra, cost) -> tuple[np.ndarray | None, float, float]:
        """Read the missing neurons into the cache: (the hot neurons' output if computed meanwhile, seconds
        waited for the reads, seconds computing the hot neurons)."""
        if not len(missing):
            return None, 0.0, 0.0
        missing = missing[np.argsort(self.position[missing])]
        positions = self.position[missing]
        hot_out, hot_s, started = None, 0.0, time.perf_counter()
        if self.overlap:  # the hot neurons' sum while the reads are in flight
            pending = self.fetcher.start(self.layer.region.offset, positions, self.prefix)
            hot_out = self.hot.partial(x, pre)
            hot_s = time.perf_counter() - started
            fetched = pending.result()
        else:
            fetched = self.fetcher.read(self.layer.region.offset, positions, self.prefix)
        waited = time.perf_counter() - started - hot_s
        self.check(positions, fetched.rows)
        self._count(fetched, len(missing), cost)
        self._place(missing, self._block(fetched), extra)
        return hot_out, waited, hot_s

    def _block(self, fetched: Fetched) -> np.ndarray:
        return self._block_of(fetched.rows)

    def _block_of(self, bundles: np.ndarray) -> np.ndarray:
        """Bundle bytes (neurons, at least the rows read) to (neurons, rows read, row) as the backend keeps them."""
        return self.products.kernels.prepare(bundles, len(self.rows_read))

    def _place(self, neurons: np.ndarray, block: np.ndarray, extra: list) -> None:
        placed = self.cache.insert(neurons, block)
        if not placed.all():
            extra.append((neurons[~placed], block[~placed]))

    def _count(self, fetched: Fetched, n_needed: int, cost) -> None:
        cost.bytes_needed += n_needed * self.prefix
        cost.bytes_read += fetched.transferred
        cost.requests += fetched.requests
        cost.read_s += fetched.seconds

    def read_ahead(self, x_before, guess: np.ndarray | None = None) -> None:
        """Lookahead: guess this layer's neurons from the previous layer's FFN input (the hidden state changes
        little from layer to layer: Deja Vu; `guess`: made already) and start reading the uncached ones through
        the lookahead reader."""
        guess = self.predictor.guess(x_before) if guess is None else guess
        want = guess[self.is_cold[guess]]
        want = want[self.cache.slot_of[want] < 0]
        if len(want):
            want = want[np.argsort(self.position[want])]
            positions = self.position[want]

            def checked(fetched):
                self.check(positions, fetched.rows)
                return want, fetched, self._block(fetched)
            self.pending = self.fetcher.start_ahead(self.layer.region.offset, positions, self.prefix, checked)

    def _use_read_ahead(self, missing: np.ndarray, extra: list, cost) -> tuple[np.ndarray, float]:
        """The rows a lookahead brought stand in for reads: (the neurons still missing after them, the seconds
        waited for them)."""
        if self.pending is None:
            return missing, 0.0
        start = time.perf_counter()
        try:
            neurons, fetched, block = self.pending.result()
        finally:
            self.pending = None
        waited = time.perf_counter() - start
        cost.bytes_read, cost.requests = cost.bytes_read + fetched.transferred, cost.requests + fetched.requests
        cost.read_s += fetched.seconds
        used = np.isin(neurons, missing)
        cost.lookahead_used += int(used.sum())
        cost.lookahead_wasted += int((~used).sum())
        cost.bytes_needed += int(used.sum()) * self.prefix
        self._place(neurons[used], block[used], extra)
        return missing[~np.isin(missing, neurons)], waited
