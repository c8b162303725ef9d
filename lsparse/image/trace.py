"""The replayed trace of a synthetic image: which neurons fire is not computed from its random weights but
replayed from activation masks recorded on a trained model (lsparse/bench/synthetic.py writes it)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TRACE = "trace.npz"


class Trace:
    """The replayed masks of a synthetic image, one token after another (cycling through the trace)."""

    def __init__(self, path: Path):
        data = np.load(path)
        self.masks = np.unpackbits(data["masks"], axis=-1, count=int(data["d_ff"])).astype(bool)
        self.perms, self.offsets, self.source_layer = data["perms"], data["offsets"], data["source_layer"]
        self.position = -1

    def step(self) -> None:
        self.position += 1

    def mask(self, layer: int) -> np.ndarray:
        rows = (self.position + self.offsets) % len(self.masks)        # one trace token per tile
        tiles = self.masks[rows, self.source_layer[layer]]             # (tiles, d_ff of the traced model)
        return np.take_along_axis(tiles, self.perms[layer], axis=1).ravel()

    def all_masks(self, layer: int, tokens: int) -> np.ndarray:
        keep = self.position
        out = []
        for t in range(tokens):
            self.position = t
            out.append(self.mask(layer))
        self.position = keep
        return np.array(out)
