"""Row-column bundles: each neuron's rows stored contiguously, so that one read fetches all it needs."""

from __future__ import annotations

import numpy as np

from lsparse.image.quantize import dequantize_rows, quantize_rows, row_bytes

ALIGN_BUNDLE = 64
ALIGN_REGION = 4096


def stride(d_model: int, n_components: int, bits: int, group_size: int) -> int:
    size = n_components * row_bytes(d_model, bits, group_size)
    return -(-size // ALIGN_BUNDLE) * ALIGN_BUNDLE


def component_rows(weights: dict, component: str) -> np.ndarray:
    """(d_ff, d_model): a neuron's down column is a row of the transposed down projection."""
    return weights["down"].T if component == "down" else weights[component]


def encode_bundles(weights: dict, components: tuple, neurons: np.ndarray, bits: int, group_size: int) -> np.ndarray:
    """(len(neurons), stride) uint8."""
    d = weights["down"].shape[0]
    out = np.zeros((len(neurons), stride(d, len(components), bits, group_size)), dtype=np.uint8)
    rb = row_bytes(d, bits, group_size)
    for k, c in enumerate(components):
        out[:, k * rb:(k + 1) * rb] = quantize_rows(component_rows(weights, c)[neurons], bits, group_size)
    return out


def decode_bundles(data: np.ndarray, components: tuple, d_model: int, bits: int, group_size: int) -> dict:
    """{component: (n, d_model) float32} from (n, >= len(components) rows) bundle bytes."""
    rb = row_bytes(d_model, bits, group_size)
    return {c: dequantize_rows(data[:, k * rb:(k + 1) * rb], d_model, bits, group_size)
            for k, c in enumerate(components)}
