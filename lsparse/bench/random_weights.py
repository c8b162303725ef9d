"""Random Llama checkpoints in Hugging Face layout: what speed benchmarks need at a real geometry, where the
values do not matter (and what the tests write tiny models with)."""

from __future__ import annotations

import numpy as np


def llama_tensors(config: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of a Llama checkpoint with this config, by its Hugging Face name, float32, weights of about
    1/sqrt(fan-in) and unit norms."""
    rng = np.random.default_rng(seed)
    d, f = config["hidden_size"], config["intermediate_size"]
    kv = d // config["num_attention_heads"] * config["num_key_value_heads"]
    tensors = {"model.embed_tokens.weight": rng.standard_normal((config["vocab_size"], d)),
               "model.norm.weight": np.ones(d)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (kv, d), "self_attn.v_proj": (kv, d),
                  "self_attn.o_proj": (d, d), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d),
                  "mlp.down_proj": (d, f)}
        tensors.update({p + k + ".weight": rng.standard_normal(s) / np.sqrt(s[1]) for k, s in shapes.items()})
        tensors[p + "input_layernorm.weight"] = np.ones(d)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(d)
    return {k: v.astype(np.float32) for k, v in tensors.items()}
