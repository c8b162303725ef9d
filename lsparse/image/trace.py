"""The replayed trace of a synthetic image: which neurons fire is not computed from its random weights but
replayed from masks recorded on a trained model (lsparse/bench/synthetic.py writes it): the true masks, and
where the image simulates a predictor, the masks that model's trained predictor gave on the same tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TRACE = "trace.npz"


class Trace:
    """The replayed masks of a synthetic image, one token after another (cycling through the trace). Synthetic
    layer l replays traced layer source_layer[l]; its neurons are tiles of the traced layer's, each tile with
    its own permutation and its own offset in the trace."""

    def __init__(self, path: Path):
        data = np.load(path)
        d_ff = int(data["d_ff"])
        self.masks = np.unpackbits(data["masks"], axis=-1, count=d_ff).astype(bool)  # (tokens, layers, d_ff)
        self.predicted = np.unpackbits(data["predicted"], axis=-1, count=d_ff).astype(bool) \
            if "predicted" in data else None                                          # the same, or None
        self.ahead = np.unpackbits(data["ahead"], axis=-1, count=d_ff).astype(bool) \
            if "ahead" in data else None  # the predictor on the previous layer's input: the lookahead's guess
        self.perms, self.offsets, self.source_layer = data["perms"], data["offsets"], data["source_layer"]
        self.position = -1

    def step(self) -> None:
        self.position += 1

    def mask(self, layer: int, predicted: bool = False, ahead: bool = False) -> np.ndarray:
        """(d_ff,) bool: the synthetic layer's neurons active at this token (or predicted active, or guessed a
        layer ahead)."""
        masks = self.ahead if ahead else self.predicted if predicted else self.masks
        rows = (self.position + self.offsets) % len(masks)             # one trace token per tile
        tiles = masks[rows, self.source_layer[layer]]                  # (tiles, d_ff of the traced model)
        return np.take_along_axis(tiles, self.perms[layer], axis=1).ravel()

    def all_masks(self, layer: int, tokens: int, predicted: bool = False) -> np.ndarray:
        keep = self.position
        out = []
        for t in range(tokens):
            self.position = t
            out.append(self.mask(layer, predicted))
        self.position = keep
        return np.array(out)
