"""Which neurons a token needs, known before their rows are read; chosen once per layer at load.

- ExactGate: the gate projection (OPT: fc1) resident and computed in full, then compacted: lossless;
- Scored: a low-rank (LLM in a Flash) or SVD predictor's scores against the layer's threshold;
- Replayed: a synthetic image's recorded masks (lsparse/image/trace.py), for what only shows at scale.
Each answers predict(x) -> (the neurons active for any row of x, ascending; the gate's values or None).
"""

from __future__ import annotations

import numpy as np

from lsparse.calibrate.predictors import predictor_scores
from lsparse.errors import LsparseError
from lsparse.image.manifest import Layer, Manifest

PREDICTOR_TENSORS = ("A", "B", "bias", "W1", "W2", "b2")


class ExactGate:
    takes_graph = True  # x as the backend computes it (the gate is a product of the backend's)

    def __init__(self, kernels, rows, up_bias, activation):
        self.kernels, self.rows, self.up_bias = kernels, rows, up_bias  # rows: the gate, held, (d_ff, row)
        self.cut, self.cats = activation.cut, activation.cats

    def predict(self, x: np.ndarray, cached=None) -> tuple[np.ndarray, np.ndarray]:
        pre, active = self.kernels.gate(self.rows, x, self.up_bias, self.cut, self.cats)
        return active, pre

    def guess(self, x_before: np.ndarray) -> np.ndarray:
        return self.predict(x_before)[0]

    def predict_and_guess(self, x, following: "ExactGate") -> tuple[tuple, np.ndarray]:
        """(predict(x), following.guess(x)) in one read of the host: the lookahead's guess of the next layer
        comes from the same x."""
        (pre, active), (_, guess) = self.kernels.gates([(self.rows, x, self.up_bias, self.cut, self.cats),
                                                         (following.rows, x, following.up_bias, following.cut,
                                                          following.cats)])
        return (active, pre), guess


class Scored:
    """With `cache_bias` (DIP's cache-aware masking), a neuron whose rows are cached passes at `cache_bias`
    below the threshold and one that would be read must clear it by as much: near the threshold, what is
    in RAM is used and what is on flash is left."""
    takes_graph = False  # numpy: x read by the host

    def __init__(self, kind: str, tensors: dict, threshold: float, cache_bias: float = 0.0):
        self.kind, self.tensors, self.threshold, self.cache_bias = kind, tensors, threshold, cache_bias

    def predict(self, x: np.ndarray, cached: np.ndarray | None = None) -> tuple[np.ndarray, None]:
        """cached: (d_ff,) whether each neuron's rows are in the cache (used with a cache bias)."""
        scores = predictor_scores(self.kind, self.tensors, x)  # (t, d_ff)
        if self.cache_bias and cached is not None:
            scores = scores + np.where(cached, self.cache_bias, -self.cache_bias)
        return np.flatnonzero((scores > self.threshold).any(0)), None

    def guess(self, x_before: np.ndarray) -> np.ndarray:
        return self.predict(x_before)[0]


class Replayed:
    """A synthetic image's masks: the true ones (an oracle), or, where the image simulates a predictor, the
    trained predictor's recorded ones, after a predictor of the real shape has run (its cost is real, its
    output not used). `missed`: the true active neurons the last prediction left out."""
    takes_graph = False

    def __init__(self, trace, index: int, tensors: dict | None):
        self.trace, self.index, self.tensors = trace, index, tensors
        self.missed = 0

    def predict(self, x: np.ndarray, cached=None) -> tuple[np.ndarray, None]:
        if self.tensors is None:
            return np.flatnonzero(self.trace.mask(self.index)), None
        predictor_scores("lowrank", self.tensors, x)
        predicted = self.trace.mask(self.index, predicted=True)
        self.missed = int((self.trace.mask(self.index) & ~predicted).sum())
        return np.flatnonzero(predicted), None

    def guess(self, x_before: np.ndarray) -> np.ndarray:
        """The lookahead's guess from the previous layer's input: the recorded one (the predictor's own
        prediction on an oracle trace, where none was recorded)."""
        if self.tensors is None or self.trace.ahead is None:
            return self.predict(x_before)[0]
        predictor_scores("lowrank", self.tensors, x_before)
        return np.flatnonzero(self.trace.mask(self.index, ahead=True))


def choose(manifest: Manifest, layer: Layer, mode: str, resident: dict, exact_rows, kernels, activation,
           trace, threshold_shift: float, cache_bias: float = 0.0):
    """The predictor of one layer in this mode (exact: the resident gate; predicted: what the image carries)."""
    if mode == "exact":
        if activation.cats and layer.threshold_on != "gate":
            raise LsparseError("exact mode needs the mask from the resident gate alone; this SwiGLU image cuts by "
                               "|silu(gate) x up| (compile --threshold-on product): run it in predicted, hybrid or "
                               "dense mode")
        up_bias = resident.get("up_bias")
        return ExactGate(kernels, exact_rows, None if up_bias is None else up_bias.astype(np.float32), activation)
    if manifest.predictor == "exact":
        raise LsparseError("this image was compiled with --predictor exact: run it in exact or dense mode")
    tensors = {k: np.ascontiguousarray(resident[k], dtype=np.float32) for k in PREDICTOR_TENSORS if k in resident}
    if manifest.predictor == "trace":
        return Replayed(trace, layer.index, tensors if layer.predictor_rank and trace.predicted is not None else None)
    return Scored(manifest.predictor, tensors, layer.predictor_threshold + threshold_shift, cache_bias)
