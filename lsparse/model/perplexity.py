"""Perplexity on held-out text, the quality figure every mode is reported with."""

from __future__ import annotations

import numpy as np

from lsparse.model.backend import to_numpy


def negative_log_likelihoods(model, tokens: list[int], ffn_fns: list | None = None) -> np.ndarray:
    """-log p(token[i+1] | tokens[:i+1]) for each position, in one prefill; `ffn_fns` as in Model.__call__."""
    logits = to_numpy(model(tokens, model.make_cache(len(tokens)), ffn_fns)).astype(np.float64)[:-1]
    logits -= logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(logits).sum(axis=-1))
    return log_z - logits[np.arange(len(tokens) - 1), tokens[1:]]


def perplexity(model, windows: list[list[int]], ffn_fns: list | None = None) -> float:
    nll = np.concatenate([negative_log_likelihoods(model, w, ffn_fns) for w in windows])
    return float(np.exp(nll.mean()))
