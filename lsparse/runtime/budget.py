"""Planning RAM for decoding from an image under a budget: what stays resident, what the neuron cache may
hold, the KV cache, and the process itself. Refuses a budget that cannot fit, naming the smallest that can."""

from __future__ import annotations

import re

import numpy as np

from lsparse.errors import LsparseError
from lsparse.model import architecture

# Python, numpy, MLX and lsparse's own code: `lsparse run` peaks at 57 MB (VmHWM) on a tiny image on Linux
# x86-64 with the mlx[cpu] wheel, weights included; with MLX's quantized kernel at work (--packed), about
# 45 MB more at 7B geometry.
PROCESS_BYTES = 112 * 2**20
UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_bytes(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise LsparseError(f"cannot read the size {text!r} (examples: 512MB, 2GB, 1.5G)")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def plan(meta: dict, mode: str, tokens: int, budget: int | None, kernels=None, window: int | None = None) -> dict:
    """Bytes per component, and the neuron-cache capacity (slots) of each layer, for rows held as the kernel
    backend `kernels` holds them (lsparse/kernels/backends.py; None: cpu's, decoded to fp32). Without a budget a
    cache holds `window` tokens' worth of neurons (None: every cold neuron)."""
    arch, args = architecture(meta["config"])
    d, b = meta["bundle"]["d_model"], meta["bundle"]
    n_kv, head_dim = arch.kv_shape(args)
    f32 = 4
    attention = sum(int(np.prod(s)) for s in _attention_shapes(args, arch)) * f32 * len(meta["layers"])
    globals_ = (args.vocab_size * args.hidden_size * (1 if meta["config"].get("tie_word_embeddings") else 2)
                + 2 * args.hidden_size) * f32
    kv = len(meta["layers"]) * 2 * n_kv * tokens * head_dim * f32

    def row_bytes(count: int, held: bool = True) -> int:  # one row in a store of `count` rows
        return kernels.store_row_bytes(int(count), held) if kernels else d * f32

    hot = sum(len(layer["hot"]) * row_bytes(len(layer["hot"])) for layer in meta["layers"]) * len(b["components"])
    d_ffs = np.array([layer["d_ff"] for layer in meta["layers"]])
    exact = sum(int(n) * row_bytes(n) for n in d_ffs) if mode == "exact" else 0  # the resident gate, held
    rows = b["exact_prefix"] if mode == "exact" else len(b["components"])
    cold = np.array([layer["region"]["count"] for layer in meta["layers"]])
    active = np.array([_most_loaded_per_token(layer, mode) for layer in meta["layers"]])
    ranks = [layer["predictor"]["rank"] or 0 for layer in meta["layers"]]
    predictors = int(sum((d + n + 1) * r + n for r, n in zip(ranks, d_ffs, strict=True))) * f32 \
        if mode == "predicted" else 0
    fixed = PROCESS_BYTES + attention + globals_ + kv + hot + exact + predictors
    if mode == "dense":  # every neuron held, as hot ones are
        fixed += sum(int(n) * row_bytes(n) for n in d_ffs) * len(b["components"]) - hot
        capacity, minimum = np.zeros_like(cold), np.zeros_like(cold)
    elif mode == "hybrid":  # one layer's cold bundles at a time, read, held and dropped
        fixed += int(cold.max()) * (b["stride"] + len(b["components"]) * row_bytes(cold.max()))
        capacity, minimum = np.zeros_like(cold), np.zeros_like(cold)
    else:
        # A token's own neurons should fit: a quarter more than the most calibration saw one token load. A
        # token that loads more still runs, through a buffer of its own (SparseFFN), at the cost of rereads.
        minimum = np.minimum(cold, np.ceil(1.25 * active * d_ffs).astype(int))
        # a window's neurons at most; stores allocated whole (MLX's, on Metal) would otherwise hold every neuron
        capacity = cold.copy() if window is None else np.minimum(cold, window * minimum)
    # A slot's bytes: the rows kept of a neuron, as a store of that many slots keeps them. Stores differ by
    # layer (the CPU path decodes small ones to fp32), and a larger store never keeps a row in more, so a
    # layer's slot at its minimum bounds it at any capacity.
    def slot_bytes(count: int) -> int:
        return rows * row_bytes(max(int(count), 1), held=False)

    slot = np.array([slot_bytes(n) for n in minimum])
    # While a layer runs: its missing bundles as read (reader buffers) and as rows, and the copies the
    # products gather; one layer at a time, so the largest counts.
    working = int((minimum * 2 * (b["stride"] + slot)).max()) if mode in ("exact", "predicted") else 0
    fixed += working
    need = fixed + int((minimum * slot).sum())
    if budget is not None:
        if budget < need:
            raise LsparseError(f"a RAM budget of {budget / 2**20:.0f} MiB cannot hold this image in {mode} mode: "
                               f"the smallest that works is {-(-need // 2**20)} MiB")
        if mode not in ("dense", "hybrid") and fixed + int((capacity * slot).sum()) > budget:
            # share the cache in proportion to what layers need
            scale = (budget - fixed) / max(int((minimum * slot).sum()), 1)
            capacity = np.minimum(capacity, np.maximum(minimum, np.floor(scale * minimum).astype(int)))
    cache = sum(int(c) * slot_bytes(c) for c in capacity)
    return {"process": PROCESS_BYTES, "attention": attention, "embedding_head": globals_, "kv_cache": kv,
            "hot_neurons": hot, "exact_gate": exact, "predictors": predictors, "working_set": working,
            "neuron_cache": cache, "total": fixed + cache, "smallest_budget": need,
            "cache_slots": capacity.tolist()}


def _most_loaded_per_token(layer: dict, mode: str) -> float:
    """The largest share of a layer's neurons one held-out calibration token loaded in this mode. Images
    from before these figures were recorded: 1.5 times the mean share of active neurons."""
    if mode == "predicted" and "max_predicted_fraction" in layer["predictor"]["quality"]:
        return layer["predictor"]["quality"]["max_predicted_fraction"]
    if "max_active_fraction" in layer["calibration"]:
        return layer["calibration"]["max_active_fraction"]
    return 1.5 * layer["calibration"]["active_fraction"]


def _attention_shapes(args, arch):
    d, h = args.hidden_size, args.head_dim
    n_kv, _ = arch.kv_shape(args)
    return [(args.num_attention_heads * h, d), (n_kv * h, d), (n_kv * h, d), (d, args.num_attention_heads * h)]
