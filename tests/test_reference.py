"""Logits of lsparse's dense decoder against transformers, in fp32, for tiny random models built here."""

from __future__ import annotations

import numpy as np
import pytest

from lsparse.model import load_model
from lsparse.source import resolve
from tests.conftest import require_reference

pytestmark = pytest.mark.ref

LLAMA = dict(vocab_size=101, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             max_position_embeddings=64, tie_word_embeddings=False)
CASES = {
    "opt": ("OPT", dict(vocab_size=101, hidden_size=64, ffn_dim=256, num_hidden_layers=2, num_attention_heads=4,
                        max_position_embeddings=64, do_layer_norm_before=True)),
    "opt-post-ln-projected": ("OPT", dict(vocab_size=101, hidden_size=64, ffn_dim=256, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=64,
                                          do_layer_norm_before=False, word_embed_proj_dim=32)),
    "llama-relu": ("Llama", dict(LLAMA, hidden_act="relu", num_key_value_heads=4)),
    "llama-silu-gqa": ("Llama", dict(LLAMA, hidden_act="silu", num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-drelu": ("Llama", dict(LLAMA, hidden_act="relu", num_key_value_heads=2)),
    "llama-fatrelu": ("Llama", dict(LLAMA, hidden_act="relu", num_key_value_heads=2)),
    "llama3-rope-scaling": ("Llama", dict(LLAMA, hidden_act="silu", num_key_value_heads=2, rope_theta=500000.0,
                                          rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                                            high_freq_factor=4.0,
                                                            original_max_position_embeddings=16))),
    "mistral-sliding-window": ("Mistral", dict(LLAMA, hidden_act="silu", num_key_value_heads=2,
                                               sliding_window=5)),
}


def _drelu_forward(mlp):
    """TurboSparse's dReLU: ReLU on both the gate and the up projection."""
    import torch

    def forward(x):
        return mlp.down_proj(torch.relu(mlp.gate_proj(x)) * torch.relu(mlp.up_proj(x)))
    return forward


def _fatrelu_forward(mlp, threshold):
    """ProSparse's shifted ReLU on the gate: x if x > threshold else 0."""

    def forward(x):
        g = mlp.gate_proj(x)
        return mlp.down_proj(g * (g > threshold) * mlp.up_proj(x))
    return forward


FATRELU_THRESHOLD = 0.05


def build(case: str, folder):
    torch, transformers = require_reference()
    family, kwargs = CASES[case]
    torch.manual_seed(0)
    config = getattr(transformers, f"{family}Config")(**kwargs)
    if family == "Mistral":
        config._attn_implementation = "eager"  # the sdpa path does not apply the sliding window to a short prompt
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    with torch.no_grad():  # random init is near zero; spread the weights so that every path matters
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    for layer in (model.model.layers if family != "OPT" else []):
        if case == "llama-drelu":
            layer.mlp.forward = _drelu_forward(layer.mlp)
        elif case == "llama-fatrelu":
            layer.mlp.forward = _fatrelu_forward(layer.mlp, FATRELU_THRESHOLD)
    model.save_pretrained(folder)
    act = {"llama-drelu": {"hidden_act": "drelu"},
           "llama-fatrelu": {"hidden_act": "fatrelu", "hidden_act_param": FATRELU_THRESHOLD}}.get(case)
    if act:
        import json
        cfg = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**cfg, **act}))
    return model


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, backend, tmp_path):
    torch, _ = require_reference()
    reference = build(case, tmp_path)
    tokens = np.random.default_rng(1).integers(0, 101, size=20)
    with torch.no_grad():
        expected = reference(torch.tensor(tokens)[None]).logits[0].numpy()

    model = load_model(resolve(str(tmp_path)), backend)
    cache = model.make_cache(32)
    prefill = np.array(model(tokens[:12], cache))  # a prompt, then one token at a time through the KV cache
    steps = [np.array(model(tokens[i:i + 1], cache)) for i in range(12, 20)]
    got = np.concatenate([prefill, *steps])

    tolerance = 1e-4 * np.abs(expected).max()
    assert np.abs(got - expected).max() <= tolerance
