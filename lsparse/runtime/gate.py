"""Quality-gated thresholds (after ARM-Sparse): each layer's predictor threshold chosen so that predicted mode's
perplexity on the compile's held-out calibration text stays within a bound of the dense model's.

One knob moves every layer: the recall of its active neurons that a layer's threshold keeps on the training
tokens (compile records each layer's threshold for each recall of RECALL_GRID, in its figures). The gate decodes
the image written so far in predicted mode, as `lsparse run --mode predicted` does (the hot neurons always, the
predicted cold ones read), finds by bisection the lowest recall whose held-out perplexity is within the bound
(perplexity falls as recall rises), and writes those thresholds. Its figures, in each layer's figures as
"quality_gate", are labelled: deployable (predicted mode at the chosen thresholds: what run does) and oracle
(the true masks, exact mode at the compiled activation cut), both against dense mode (every neuron, no cut).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from lsparse.errors import LsparseError
from lsparse.image.manifest import Manifest
from lsparse.model.perplexity import perplexity
from lsparse.runtime.load import load_image
from lsparse.text import limit_tokens

GATE_TOKENS = 1024  # held-out tokens each trial decodes: about 7 trials, token by token in predicted mode


class _Counted:
    """A layer's predictor, recording the share of the layer's neurons each token computes (hot or predicted)."""
    takes_graph = False

    def __init__(self, predictor, hot: np.ndarray, d_ff: int):
        self.predictor, self.hot, self.d_ff = predictor, hot, d_ff
        self.predicted, self.used = [], []  # per token: predicted share; hot or predicted share

    def predict(self, x, cached=None):
        active, pre = self.predictor.predict(x, cached)
        self.predicted.append(len(active) / self.d_ff)
        self.used.append(len(np.union1d(active, self.hot)) / self.d_ff)
        return active, pre


def threshold_at(layer, recall: float) -> float:
    """The layer's predictor threshold that keeps `recall` of its active training neurons (compile's table)."""
    return dict(map(tuple, layer.figures["recall_thresholds"]))[recall]


def _predicted(model, counted: list, manifest: Manifest, windows, recall: float) -> dict:
    """Predicted mode (`model`, its predictors wrapped in `counted`) at each layer's threshold for `recall`:
    held-out perplexity and shares of neurons."""
    for c, layer in zip(counted, manifest.layers, strict=True):
        c.predictor.threshold = threshold_at(layer, recall)
        c.predicted, c.used = [], []
    ppl = perplexity(model, windows)
    return {"recall": recall, "perplexity": ppl, "used_fraction": float(np.mean([c.used for c in counted])),
            "max_predicted_fraction": [max(c.predicted) for c in counted]}


def _perplexity(root, windows, mode: str) -> float | None:
    try:
        model, _ = load_image(root, mode=mode)
    except LsparseError:  # exact mode on an image cut by |silu(gate) x up|: no oracle to run
        return None
    try:
        return perplexity(model, windows)
    finally:
        model.close()


def gate_thresholds(root, manifest: Manifest, windows: list[list[int]], bound: float) -> Manifest:
    """The manifest with each layer's predictor threshold at the lowest recall of the grid whose predicted-mode
    perplexity on `windows` (their first GATE_TOKENS) is within (1 + bound) of dense mode's; refused (one line)
    where none is."""
    windows = limit_tokens(windows, GATE_TOKENS)
    dense = _perplexity(root, windows, "dense")
    oracle = _perplexity(root, windows, "exact")
    recalls = sorted(r for r, _ in manifest.layers[0].figures["recall_thresholds"])
    model, _ = load_image(root, mode="predicted")
    try:
        for ffn, layer in zip(model.ffns, manifest.layers, strict=True):
            ffn.predictor = _Counted(ffn.predictor, layer.hot, layer.d_ff)
        best = _bisect(model, [ffn.predictor for ffn in model.ffns], manifest, windows, recalls, bound, dense,
                       oracle)
    finally:
        model.close()
    report = {"bound": bound, "recall": best["recall"], "perplexity": best["perplexity"], "dense_perplexity": dense,
              "oracle_perplexity": oracle, "used_fraction": best["used_fraction"],
              "tokens": sum(len(w) for w in windows)}
    layers = tuple(replace(layer, predictor_threshold=threshold_at(layer, best["recall"]),
                           max_predicted_fraction=best["max_predicted_fraction"][i],
                           figures={**layer.figures, "quality_gate": report})
                   for i, layer in enumerate(manifest.layers))
    return replace(manifest, layers=layers, recall_target=best["recall"])


def _bisect(model, counted, manifest: Manifest, windows, recalls: list, bound: float, dense: float,
            oracle: float | None) -> dict:
    """The trial at the lowest recall within the bound (perplexity falls as recall rises)."""
    best = _predicted(model, counted, manifest, windows, recalls[-1])
    if best["perplexity"] > (1 + bound) * dense:
        cut = "" if oracle is None else f"; the true masks at the compiled cut (oracle) lose {oracle / dense - 1:.1%}"
        raise LsparseError(f"no predictor threshold keeps perplexity within {bound:.1%} of dense's on the held-out "
                           f"calibration text: at recall {recalls[-1]} it is {best['perplexity'] / dense - 1:.1%} "
                           f"above{cut}")
    low, high = 0, len(recalls) - 1  # recalls[high] meets the bound; find the lowest that does
    while low < high:
        middle = (low + high) // 2
        trial = _predicted(model, counted, manifest, windows, recalls[middle])
        if trial["perplexity"] <= (1 + bound) * dense:
            high, best = middle, trial
        else:
            low = middle + 1
    return best
