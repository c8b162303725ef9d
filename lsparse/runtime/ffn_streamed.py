"""The two baselines' FFNs: dense (every neuron resident) and streamed (hybrid: every cold bundle read each
token, used once and dropped)."""

from __future__ import annotations

import time

import numpy as np

from lsparse.image.manifest import Layer
from lsparse.runtime.costs import CostLog, timed
from lsparse.runtime.fetch import Fetcher, RowCheck
from lsparse.runtime.ffn import NeuronProducts

HYBRID_READ_BYTES = 1 << 20  # hybrid streams each region in requests of this size, spread over the readers


class DenseFFN:
    """Every neuron resident (load_image holds the cold ones with the hot)."""

    def __init__(self, neurons: np.ndarray, products: NeuronProducts, rows: dict, costs: CostLog):
        self.neurons, self.products, self.rows, self.costs = neurons, products, rows, costs

    def __call__(self, args, w, x, xp):
        with timed(self.costs.now, "compute_s"):
            return self.products.finish(self.products.partial(x, self.neurons, self.rows, None))


class StreamedFFN:
    def __init__(self, layer: Layer, products: NeuronProducts, hot_rows: dict, fetcher: Fetcher, check: RowCheck,
                 components: tuple[str, ...], costs: CostLog):
        self.layer, self.products, self.hot_rows, self.fetcher, self.check = layer, products, hot_rows, fetcher, check
        self.components, self.costs = components, costs
        self.stride = fetcher.stride

    def __call__(self, args, w, x, xp):
        cost = self.costs.now
        bundles = self.stream(cost)
        with timed(cost, "mem_s"):
            rows = self.products.hold(bundles, self.components)
        with timed(cost, "compute_s"):
            out = (self.products.partial(x, self.layer.hot, self.hot_rows, None)
                   + self.products.partial(x, self.layer.cold_order, rows, None))
            return self.products.finish(out)

    def stream(self, cost) -> np.ndarray:
        """The layer's cold bundles (count, stride) in file order, read whole and checked; counted in `cost`."""
        start = time.perf_counter()
        region = self.layer.region
        starts = np.arange(0, region.size, HYBRID_READ_BYTES)
        lengths = np.minimum(HYBRID_READ_BYTES, region.size - starts)
        fetched = self.fetcher.read_spans(region.offset + starts, lengths)  # (region bytes,) in file order
        bundles = fetched.rows.reshape(region.count, self.stride)
        self.check(np.arange(region.count), bundles)
        cost.bytes_needed += region.size
        cost.bytes_read += fetched.transferred
        cost.requests += fetched.requests
        cost.io_s += fetched.seconds
        cost.read_s += fetched.seconds
        cost.mem_s += time.perf_counter() - start - fetched.seconds
        return bundles
