"""Tiny checkpoints in Hugging Face layout, written with safetensors alone (no torch needed)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from lsparse.bench.random_weights import llama_tensors as tiny_llama_tensors

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 512, "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "hidden_act": "relu",
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}


def write_tiny_llama(folder: Path, config: dict | None = None, shards: int = 1, tokenizer: Path | None = None) -> Path:
    """A tiny ReLU Llama; `shards` > 1 writes a sharded checkpoint with its index; `tokenizer` is a
    SentencePiece model copied in as tokenizer.model."""
    config = config or TINY_LLAMA
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    tensors = tiny_llama_tensors(config)
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        weight_map = {}
        for s in range(shards):
            file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[s::shards]}
            save_file(part, str(folder / file))
            weight_map.update({n: file for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if tokenizer is not None:
        (folder / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    return folder


TINY_OPT = {"architectures": ["OPTForCausalLM"], "model_type": "opt", "hidden_size": 64, "ffn_dim": 256,
            "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 128,
            "do_layer_norm_before": True, "word_embed_proj_dim": 64, "bos_token_id": 1, "eos_token_id": 2}


def write_tiny_opt(folder: Path, tokenizer: Path | None = None, seed: int = 0) -> Path:
    """A tiny random OPT in Hugging Face layout (biases, LayerNorms, learned positions)."""
    rng = np.random.default_rng(seed)
    c = TINY_OPT
    d, f = c["hidden_size"], c["ffn_dim"]
    p = "model.decoder."
    tensors = {p + "embed_tokens.weight": rng.standard_normal((c["vocab_size"], d)),
               p + "embed_positions.weight": rng.standard_normal((c["max_position_embeddings"] + 2, d)) * 0.1,
               p + "final_layer_norm.weight": np.ones(d), p + "final_layer_norm.bias": np.zeros(d)}
    for i in range(c["num_hidden_layers"]):
        q = f"{p}layers.{i}."
        for name, shape in (("self_attn.q_proj", (d, d)), ("self_attn.k_proj", (d, d)), ("self_attn.v_proj", (d, d)),
                            ("self_attn.out_proj", (d, d)), ("fc1", (f, d)), ("fc2", (d, f))):
            tensors[q + name + ".weight"] = rng.standard_normal(shape) / np.sqrt(shape[1])
            tensors[q + name + ".bias"] = rng.standard_normal(shape[0]) * 0.1
        for norm in ("self_attn_layer_norm", "final_layer_norm"):
            tensors[q + norm + ".weight"] = np.ones(d)
            tensors[q + norm + ".bias"] = np.zeros(d)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(c))
    save_file({k: v.astype(np.float32) for k, v in tensors.items()}, str(folder / "model.safetensors"))
    if tokenizer is not None:
        (folder / "tokenizer.model").write_bytes(tokenizer.read_bytes())
    return folder
