"""GGUF checkpoints (llama.cpp's format), read with the `gguf` package: tensors dequantized to float32 one
at a time, the config from the metadata, and the embedded tokenizer. Presented under Hugging Face names."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from lsparse.errors import LsparseError
from lsparse.source.checkpoint import Checkpoint, interleaved_to_half_rope

ARCHITECTURES = ("llama",)  # llama.cpp writes Llama, Mistral and SmolLM2 alike as "llama"
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
LAYER_NAMES = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
LAYER_PATTERN = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
TOKEN_TYPE_CONTROL = 3


def hf_name(gguf_name: str) -> str | None:
    if gguf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[gguf_name]
    m = LAYER_PATTERN.match(gguf_name)
    if m and m.group(2) in LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    return None


class GGUFStore:
    def __init__(self, reader, n_heads: int, n_kv_heads: int):
        self._tensors = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is not None:
                self._tensors[name] = t
        self._heads = {"q_proj": n_heads, "k_proj": n_kv_heads}

    def names(self) -> list[str]:
        return list(self._tensors)

    def _tensor(self, name: str):
        if name not in self._tensors:
            raise LsparseError(f"tensor {name!r} is not in the checkpoint")
        return self._tensors[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._tensor(name).shape))  # GGUF lists the innermost first

    def get(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize
        t = self._tensor(name)
        try:
            w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False).reshape(self.shape(name))
        except (NotImplementedError, ValueError) as e:
            raise LsparseError(f"cannot dequantize {t.name} ({t.tensor_type.name}: {e})") from None
        for proj, heads in self._heads.items():  # llama.cpp's converter permuted q/k rows for its RoPE
            if f".{proj}." in name:
                w = interleaved_to_half_rope(w, heads)
        return w


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def open_gguf(path: Path) -> Checkpoint:
    try:
        from gguf import GGUFReader
    except ImportError:
        raise LsparseError("reading GGUF files needs the `gguf` package: pip install gguf") from None
    try:
        reader = GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise LsparseError(f"{path}: not a readable GGUF file ({e})") from None
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise LsparseError(f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})")

    def meta(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    n_heads = int(meta("attention.head_count"))
    n_kv_heads = int(meta("attention.head_count_kv", n_heads))
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": int(meta("embedding_length")), "num_hidden_layers": int(meta("block_count")),
        "intermediate_size": int(meta("feed_forward_length")), "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads, "vocab_size": int(meta("vocab_size", len(tokens))),
        "max_position_embeddings": int(meta("context_length", 4096)),
        "rms_norm_eps": float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)), "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
    }
    scaling = meta("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(meta("rope.scaling.factor", 1.0))}
    store = GGUFStore(reader, n_heads, n_kv_heads)
    config["tie_word_embeddings"] = "lm_head.weight" not in store.names()
    return Checkpoint(config, store, _tokenizer(reader, config), str(path))


def _tokenizer(reader, config: dict):
    from lsparse.source.tokenizer import byte_level_bpe, wrap_hf
    kind = _field(reader, "tokenizer.ggml.model")
    if kind is None:
        return None
    if kind != "gpt2":
        raise LsparseError(f"GGUF tokenizer model {kind!r} is not supported yet (supported: gpt2)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    specials = [t for t, kind in zip(tokens, types, strict=True) if kind == TOKEN_TYPE_CONTROL]
    hf = byte_level_bpe({t: i for i, t in enumerate(tokens)}, merges, specials,
                        digits_apart=_field(reader, "tokenizer.ggml.pre") == "smollm")
    special = {k: tokens[config[f"{k[:3]}_token_id"]] for k in ("bos_token", "eos_token")
               if config.get(f"{k[:3]}_token_id") is not None}
    return wrap_hf(hf, config, special, _field(reader, "tokenizer.chat_template"),
                   add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))
