"""The two baselines' FFNs: dense (every neuron resident) and streamed (hybrid: every cold bundle read each
token, used once and dropped)."""

from __future__ import annotations

import time

import numpy as np

from lsparse.image.manifest import Layer
from lsparse.runtime.costs import CostLog, timed
from lsparse.runtime.fetch import Fetcher, RowCheck
from lsparse.runtime.ffn import HotNeurons, NeuronProducts

HYBRID_READ_BYTES = 1 << 20  # hybrid streams each region in requests of this size, spread over the readers


class DenseFFN:
    """Every neuron resident: the hot ones at their tier, the cold ones (in file order) held beside them."""

    def __init__(self, hot: HotNeurons, cold: np.ndarray, products: NeuronProducts, rows: dict, costs: CostLog):
        self.hot, self.cold, self.products, self.rows, self.costs = hot, cold, products, rows, costs

    def __call__(self, args, w, x, xp):
        with timed(self.costs.now, "compute_s"):
            return self.products.finish(self.hot.partial(x) + self.products.partial(x, self.cold, self.rows, None))


class StreamedFFN:
    def __init__(self, layer: Layer, products: NeuronProducts, hot: HotNeurons, fetcher: Fetcher, check: RowCheck,
                 components: tuple[str, ...], costs: CostLog):
        self.layer, self.products, self.hot, self.fetcher, self.check = layer, products, hot, fetcher, check
        self.components, self.costs = components, costs
        self.stride = fetcher.stride

    def __call__(self, args, w, x, xp):
        cost = self.costs.now
        bundles = self.stream(cost)
        with timed(cost, "mem_s"):
            rows = self.products.hold(bundles, self.components)
        with timed(cost, "compute_s"):
            out = self.hot.partial(x) + self.products.partial(x, self.layer.cold_order, rows, None)
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
