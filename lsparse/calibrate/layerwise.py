"""Calibration one layer at a time, as SparseGPT and Wanda calibrate: only one block's weights and the
calibration hidden states are in memory at once, so a model larger than RAM calibrates in a few GB.

Peak memory is about one layer's weights (twice, while the next loads) plus, for N calibration tokens,
N x (2 d_model + d_ff) float32 (hidden states, FFN inputs, activations) and a d_ff x d_ff co-activation matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from lsparse.model import architecture, load_globals, load_layer
from lsparse.model.layers import KVCache
from lsparse.source.checkpoint import Checkpoint


@dataclass
class LayerCalibration:
    index: int
    weights: dict            # this layer's weights, numpy float32
    inputs: np.ndarray       # (N, d_model) the FFN's inputs, after its norm
    activations: np.ndarray  # (N, d_ff) each neuron's coefficient on its down column

    @property
    def input_norms(self) -> np.ndarray:
        """L2 norm of each input channel over the calibration tokens (Wanda's ||X_j||)."""
        return np.sqrt((self.inputs.astype(np.float64) ** 2).sum(0))


def calibrate_layers(checkpoint: Checkpoint, windows: list[list[int]]) -> Iterator[LayerCalibration]:
    arch, args = architecture(checkpoint.config)
    g = load_globals(checkpoint, arch, args)
    hidden = [arch.embed(args, g, np.asarray(w), np.arange(len(w)), np) for w in windows]
    del g
    n_kv, head_dim = arch.kv_shape(args)
    for i in range(args.num_hidden_layers):
        w = load_layer(checkpoint, arch, args, i)
        inputs, acts = [], []

        def recording_ffn(args, w, x, xp, inputs=inputs, acts=acts):
            a = arch.ffn_activation(args, w, x, xp)
            inputs.append(x)
            acts.append(a)
            return arch.ffn_down(args, w, a, xp)

        hidden = [arch.block(args, w, h, KVCache(np, n_kv, len(h), head_dim), np.arange(len(h)), np, recording_ffn)
                  for h in hidden]
        yield LayerCalibration(i, w, np.concatenate(inputs), np.concatenate(acts))
