"""llama2.c checkpoints ("legacy" format, version 0): a header of 7 int32
(dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; vocab_size < 0 means an unshared
classifier), then float32 tensors in a fixed order. Presented under Hugging Face Llama tensor names."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lsparse.errors import LsparseError
from lsparse.source.checkpoint import Checkpoint, interleaved_to_half_rope

HEADER_BYTES = 7 * 4


def _layout(dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len, shared):
    """(name, shape) in file order; `None` names are skipped regions (the precomputed RoPE tables)."""
    head = dim // n_heads
    kv_dim = n_kv_heads * head
    per_layer = [
        ("input_layernorm.weight", (dim,)),
        ("self_attn.q_proj.weight", (dim, dim)),
        ("self_attn.k_proj.weight", (kv_dim, dim)),
        ("self_attn.v_proj.weight", (kv_dim, dim)),
        ("self_attn.o_proj.weight", (dim, dim)),
        ("post_attention_layernorm.weight", (dim,)),
        ("mlp.gate_proj.weight", (hidden, dim)),
        ("mlp.down_proj.weight", (dim, hidden)),
        ("mlp.up_proj.weight", (hidden, dim)),
    ]
    layout = [("model.embed_tokens.weight", (vocab, dim))]
    for suffix, shape in per_layer:  # each tensor kind is stored for all layers before the next kind
        layout += [(f"model.layers.{i}.{suffix}", shape) for i in range(n_layers)]
    layout += [("model.norm.weight", (dim,)), (None, (seq_len, head // 2)), (None, (seq_len, head // 2))]
    if not shared:
        layout.append(("lm_head.weight", (vocab, dim)))
    return layout


class Llama2cStore:
    def __init__(self, path: Path, layout, n_heads: int, n_kv_heads: int):
        self._map = np.memmap(path, dtype=np.float32, mode="r")
        self._entries = {}
        offset = HEADER_BYTES // 4
        for name, shape in layout:
            if name is not None:
                self._entries[name] = (offset, shape)
            offset += int(np.prod(shape))
        self._heads = {"q_proj": n_heads, "k_proj": n_kv_heads}

    def names(self) -> list[str]:
        return list(self._entries)

    def _entry(self, name: str) -> tuple[int, tuple[int, ...]]:
        if name not in self._entries:
            raise LsparseError(f"tensor {name!r} is not in the checkpoint")
        return self._entries[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def get(self, name: str) -> np.ndarray:
        offset, shape = self._entry(name)
        w = np.array(self._map[offset: offset + int(np.prod(shape))]).reshape(shape)
        for proj, heads in self._heads.items():
            if f".{proj}." in name:
                w = interleaved_to_half_rope(w, heads)
        return w


def read_header(path: Path) -> tuple[int, ...] | None:
    """The header when the file's size is exactly what it declares, else None (not a llama2.c file)."""
    size = path.stat().st_size
    if size < HEADER_BYTES:
        return None
    header = tuple(int(v) for v in np.fromfile(path, dtype=np.int32, count=7))
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = header
    if min(dim, hidden, n_layers, n_heads, n_kv_heads, abs(vocab), seq_len) <= 0 or dim % n_heads:
        return None
    if n_heads % n_kv_heads or (dim // n_heads) % 2:
        return None
    return header if size == HEADER_BYTES + 4 * _floats(*header) else None


def _floats(dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len) -> int:
    """The floats a header declares, counted before anything is built from it (a header may claim 2^31
    layers: its file size, not memory, refuses it). Equals the sum over _layout's shapes."""
    kv_dim = n_kv_heads * (dim // n_heads)
    per_layer = 2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * hidden * dim
    classifier = 0 if vocab > 0 else abs(vocab) * dim
    return abs(vocab) * dim + n_layers * per_layer + dim + 2 * seq_len * (dim // n_heads // 2) + classifier


def open_llama2c(path: Path, tokenizer_path: Path | None = None) -> Checkpoint:
    header = read_header(path)
    if header is None:
        raise LsparseError(f"{path}: not a llama2.c checkpoint (its size does not match the header)")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = header
    shared = vocab > 0
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": dim, "intermediate_size": hidden, "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads, "num_key_value_heads": n_kv_heads, "vocab_size": abs(vocab),
        "max_position_embeddings": seq_len, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": shared, "bos_token_id": 1, "eos_token_id": 2,
    }
    store = Llama2cStore(path, _layout(dim, hidden, n_layers, n_heads, n_kv_heads, abs(vocab), seq_len, shared),
                         n_heads, n_kv_heads)
    tokenizer = None
    if tokenizer_path is None:
        candidates = sorted(path.parent.glob("*.model"))
        tokenizer_path = candidates[0] if len(candidates) == 1 else None
    if tokenizer_path is not None:
        from lsparse.source.tokenizer import sentencepiece
        tokenizer = sentencepiece(tokenizer_path)
    return Checkpoint(config, store, tokenizer, str(path))
