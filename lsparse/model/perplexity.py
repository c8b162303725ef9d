"""Perplexity on held-out text, the quality figure every mode is reported with."""

from __future__ import annotations

import numpy as np

from lsparse.model.backend import to_numpy


def negative_log_likelihoods(model, tokens: list[int], ffn_fns: list | None = None,
                             prompt: int | None = None) -> np.ndarray:
    """-log p(token[i+1] | tokens[:i+1]) for each position, in one prefill; `ffn_fns` as in Model.__call__.
    `prompt`: the first this many tokens in a call of their own, the rest in a second (the same figures for a
    model whose calls do not depend on how the tokens are split; a flock is chosen from the first call)."""
    cache = model.make_cache(len(tokens))
    calls = [tokens] if prompt is None else [tokens[:prompt], tokens[prompt:]]
    logits = np.concatenate([to_numpy(model(part, cache, ffn_fns)) for part in calls]).astype(np.float64)[:-1]
    logits -= logits.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(logits).sum(axis=-1))
    return log_z - logits[np.arange(len(tokens) - 1), tokens[1:]]


def perplexity(model, windows: list[list[int]], ffn_fns: list | None = None) -> float:
    nll = np.concatenate([negative_log_likelihoods(model, w, ffn_fns) for w in windows])
    return float(np.exp(nll.mean()))


def perplexities(model, windows: list[list[int]]) -> tuple[float, float | None]:
    """(the windows' perplexity, that of their second halves: the tokens the second call predicted, None where
    no window has any), each window's first half given as a prompt."""
    nll = [negative_log_likelihoods(model, w, prompt=len(w) // 2) for w in windows]
    second = np.concatenate([n[len(w) // 2:] for n, w in zip(nll, windows, strict=True)])
    return float(np.exp(np.concatenate(nll).mean())), float(np.exp(second.mean())) if len(second) else None
