"""What every FFN of an image shares (dense, streamed and paged): the activation rule it was compiled with, and
the FFN output of a set of neurons whose rows a kernel backend holds."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lsparse.image.manifest import Layer
from lsparse.kernels.cpu import gate_passes
from lsparse.model.backend import array_module
from lsparse.model.layers import relu
from lsparse.model.llama import ACTIVATIONS, gate_activation


@dataclass(frozen=True)
class Activation:
    """Each neuron's coefficient on its down column, from the gate (OPT: fc1) pre-activation and the up values."""
    args: object
    gated: bool         # Llama family (gate and up); OPT: relu(fc1) alone
    cut: float          # the gate's rule: pre > cut (ReLU family, FATReLU), or |silu(pre)| > cut (CATS)
    cats: bool          # a SwiGLU image cut by magnitude
    threshold_on: str   # "gate" (CATS) or "product" (|silu(gate) x up|)
    apply_cut: bool     # False in dense mode: the model as compiled, every neuron kept
    # a gated ReLU-family activation is 0 wherever the gate is at most this (ReLU: 0, FATReLU: its threshold),
    # whatever up is, so a kernel may skip those up rows; None for SiLU gates and OPT
    zero_at_or_below: float | None

    @classmethod
    def of(cls, layer: Layer, arch, args, mode: str) -> "Activation":
        cats, gated = layer.threshold > 0, "gate" in arch.BUNDLE
        relu_gate = gated and ACTIVATIONS[args.hidden_act][0] != "silu"
        return cls(args, gated, layer.threshold if cats else getattr(args, "relu_threshold", 0.0),
                   cats, layer.threshold_on, mode != "dense", float(args.relu_threshold) if relu_gate else None)

    def __call__(self, pre, up):
        """pre and up (t, n), numpy or MLX arrays (computed in the same library)."""
        xp = np if isinstance(pre, np.ndarray) else array_module("mlx")
        if not self.gated:  # OPT: relu(fc1 x + b)
            return relu(pre, xp)
        a = gate_activation(self.args, pre, up, xp)
        if self.cats and self.apply_cut:
            return a * (gate_passes(pre, self.cut, True, xp) if self.threshold_on == "gate" else xp.abs(a) > self.cut)
        return a


class NeuronProducts:
    """One layer's FFN output over any set of its neurons, computed by a kernel backend."""

    def __init__(self, kernels, arch, d_model: int, activation: Activation, resident: dict):
        self.kernels, self.projection, self.d_model, self.activation = kernels, arch.EXACT_PROJECTION, d_model, \
            activation
        self.gated = "gate" in arch.BUNDLE
        self.up_bias = _float(resident.get("up_bias"))      # (d_ff,) OPT's fc1 bias
        self.down_bias = _float(resident.get("down_bias"))  # (d_model,) OPT's fc2 bias

    def hold(self, bundles: np.ndarray, components) -> dict:
        """{component: a held store of its rows} from bundle bytes (n, stride)."""
        block = self.kernels.prepare(bundles, len(components))  # (n, len(components), row) as the backend keeps
        return {c: self.kernels.hold(block[:, k]) for k, c in enumerate(components)}

    def partial(self, x, neurons: np.ndarray, stores: dict, slots, pre_all=None):
        """x (t, d_model) -> (t, d_model): the output of these neurons, whose rows are in `stores` at `slots`
        (None: all of a held store); `pre_all` (t, d_ff): the gate already computed for every neuron. Arrays
        as the backend computes them: numpy, or MLX graphs for a lazy backend."""
        if len(neurons) == 0:
            return self.kernels.zeros((x.shape[0], self.d_model))
        return self.down(stores, slots, self.coefficients(x, neurons, stores, slots, pre_all))

    def down(self, stores: dict, slots, coefficients):
        """(t, n) coefficients of neurons held at `slots` -> (t, d_model) through their down rows."""
        return self.kernels.vm(stores["down"], slots, coefficients)

    def coefficients(self, x, neurons: np.ndarray, stores: dict, slots, pre_all=None):
        """x (t, d_model) -> (t, n): each neuron's coefficient on its down row (partial's arguments)."""
        up = None
        if pre_all is not None:
            pre = pre_all[:, self.kernels.index(neurons)]
            up = self.kernels.mv(stores["up"], slots, x) if self.gated else None
        elif self.gated:
            pre, up = self.kernels.gate_up(stores["gate"], stores["up"], slots, x, self.activation.zero_at_or_below)
        else:
            pre = self.kernels.mv(stores[self.projection], slots, x)
            if self.up_bias is not None:
                pre = pre + self.up_bias[neurons]
        return self.activation(pre, up)

    def finish(self, out: np.ndarray) -> np.ndarray:
        return out if self.down_bias is None else out + self.down_bias


@dataclass(frozen=True)
class HotNeurons:
    """A layer's hot neurons, resident at the image's hot tier (Manifest.hot_bundle): held and computed by a
    backend for that precision, or by the cold neurons' where the image has one precision."""
    neurons: np.ndarray       # (n_hot,) ascending
    products: NeuronProducts
    rows: dict                # {component: held store}
    own_tier: bool            # their own precision: their gate rows give their coefficients (not the cold tier's)

    def partial(self, x, pre_all=None):
        """x (t, d_model) -> (t, d_model), before the down bias; `pre_all` as NeuronProducts.partial takes it."""
        return self.products.partial(x, self.neurons, self.rows, None, None if self.own_tier else pre_all)


def _float(a) -> np.ndarray | None:
    return None if a is None else np.ascontiguousarray(a, dtype=np.float32)
