"""The transformer: an architecture module (llama.py, opt.py) applied to weights held in memory."""

from __future__ import annotations

import numpy as np

from lsparse.errors import LsparseError
from lsparse.model import llama, opt
from lsparse.model.backend import array_module, default_backend
from lsparse.model.layers import KVCache
from lsparse.source.checkpoint import Checkpoint

ARCHITECTURES = {
    "LlamaForCausalLM": llama, "MistralForCausalLM": llama, "OPTForCausalLM": opt,
}
MODEL_TYPES = {"llama": llama, "mistral": llama, "opt": opt}


def architecture(config: dict):
    """The architecture module for a config, and its ModelArgs."""
    names = config.get("architectures") or []
    arch = next((ARCHITECTURES[n] for n in names if n in ARCHITECTURES), None)
    arch = arch or MODEL_TYPES.get(config.get("model_type"))
    if arch is None:
        what = ", ".join(names) or config.get("model_type") or "unnamed"
        raise LsparseError(f"unsupported architecture {what} (supported: {', '.join(ARCHITECTURES)})")
    return arch, arch.ModelArgs.from_config(config)


class Model:
    """Dense decoder: every weight resident. The baseline each sparse mode is measured against."""

    def __init__(self, arch, args, globals_: dict, layers: list[dict], xp, sparq=None, kv_pages=None):
        self.arch, self.args, self.globals, self.layers, self.xp = arch, args, globals_, layers, xp
        self.sparq = sparq  # a SparQ (model/sparq.py): decoding steps attend SparQ's way; None: in full
        self.kv_pages = kv_pages  # with SparQ, the caches' pages on flash (runtime/kv_flash.py KVSpill); None: RAM

    @property
    def context_length(self) -> int:
        return self.args.max_position_embeddings

    def make_cache(self, max_len: int | None = None) -> list[KVCache]:
        n_kv, head_dim = self.arch.kv_shape(self.args)
        length = max_len or self.context_length
        if self.kv_pages is not None:
            return self.kv_pages.make_cache(self.xp, len(self.layers), n_kv, length, head_dim)
        if self.sparq is not None:
            from lsparse.model.sparq import SparQCache
            return [SparQCache(self.xp, n_kv, length, head_dim, self.sparq) for _ in self.layers]
        return [KVCache(self.xp, n_kv, length, head_dim) for _ in self.layers]

    def __call__(self, tokens, cache: list[KVCache], ffn_fns: list | None = None, last_only: bool = False):
        """Logits (T, vocab) for `tokens` placed after what the cache already holds; `last_only`: (1, vocab),
        the last token's (a prompt: the head run once, not T rows of the vocabulary kept). `ffn_fns`, one per
        layer, replace the dense FFN (to record or alter activations)."""
        positions = np.arange(cache[0].offset, cache[0].offset + len(tokens))
        h = self.arch.embed(self.args, self.globals, np.asarray(tokens), positions, self.xp)
        for i, (w, c) in enumerate(zip(self.layers, cache, strict=True)):
            ffn_fn = self.arch.ffn if ffn_fns is None else ffn_fns[i]
            h = self.arch.block(self.args, w, h, c, positions, self.xp, ffn_fn)
        return self.arch.head(self.args, self.globals, h[-1:] if last_only else h, self.xp)


def _load(checkpoint: Checkpoint, names: dict[str, str], xp) -> dict:
    available = set(checkpoint.tensors.names())
    missing = sorted(n for n in names.values() if n not in available)
    if missing:
        raise LsparseError(f"{checkpoint.location}: tensor {missing[0]} is missing from the checkpoint")
    return {short: xp.array(np.ascontiguousarray(checkpoint.tensors.get(name))) for short, name in names.items()}


# Tensors a checkpoint may hold that follow from others: RoPE's inverse frequencies (older Llama checkpoints)
DERIVED = (".rotary_emb.inv_freq", ".attn.masked_bias", ".attn.bias")


def check_tensors(checkpoint: Checkpoint, arch, args) -> None:
    """Every tensor of the checkpoint is one the architecture computes with, or the checkpoint is refused:
    weights dropped silently would decode wrong (a bias lsparse does not add, say)."""
    available = set(checkpoint.tensors.names())
    used = set(arch.global_tensor_names(args, available).values())
    for i in range(args.num_hidden_layers):
        used |= set(arch.layer_tensor_names(args, i, available).values())
    if getattr(args, "tie_word_embeddings", False):
        used.add("lm_head.weight")  # tied: the head is the embedding, as transformers computes it
    unused = sorted(n for n in available - used if not n.endswith(DERIVED))
    if unused:
        raise LsparseError(f"{checkpoint.location}: {len(unused)} tensor(s) lsparse would not use, such as "
                           f"{unused[0]}: this model's variant is not supported (decoding without them would be "
                           "wrong)")


def load_layer(checkpoint: Checkpoint, arch, args, i: int, xp=np) -> dict:
    """One block's weights: calibration holds one layer at a time, never the whole model."""
    return _load(checkpoint, arch.layer_tensor_names(args, i, set(checkpoint.tensors.names())), xp)


def load_globals(checkpoint: Checkpoint, arch, args, xp=np) -> dict:
    """Embedding, final norm and head."""
    return _load(checkpoint, arch.global_tensor_names(args, set(checkpoint.tensors.names())), xp)


def load_model(checkpoint: Checkpoint, backend: str | None = None) -> Model:
    xp = array_module(backend or default_backend())
    arch, args = architecture(checkpoint.config)
    check_tensors(checkpoint, arch, args)
    layers = [load_layer(checkpoint, arch, args, i, xp) for i in range(args.num_hidden_layers)]
    return Model(arch, args, load_globals(checkpoint, arch, args, xp), layers, xp)
