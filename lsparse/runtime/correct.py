"""Correction (Sirius): the sparse model drafts tokens, the dense path checks them every k tokens, and the
dense token replaces a draft where they disagree.

The prompt goes through the dense path in one call (each layer's cold region read once for all of it), so
that its keys and values are the dense model's. A round starts from the last accepted token p (not yet in
the KV cache). The sparse path (predicted mode) drafts up to `every` greedy tokens, fewer where its top two
logits are closer than `margin` (it is unsure: check now). Then the cache is rolled back to p and the dense
path (every neuron and no CATS cut, as dense mode computes: the hot neurons, then each layer's cold region
streamed once for the whole round) computes p and the drafts in one call, rewriting their keys and values.
Drafts are accepted up to the first the dense path would not have chosen; the dense path's own token follows
them (the correction, or after a round without one, a token for free), and the cache keeps the accepted
tokens only. Every token emitted is the dense path's greedy choice, so the text is the dense model's (up to
arithmetic order); what correction buys is one dense pass per round instead of per token.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np

from lsparse.errors import LsparseError
from lsparse.runtime.generate import GenerationResponse, StreamingDetokenizer, log_probabilities, peak_memory_bytes


@dataclass
class Correction:
    """What correcting a generation took."""
    rounds: int = 0        # dense passes
    drafted: int = 0       # tokens the sparse path proposed
    accepted: int = 0      # drafts the dense path agreed with
    corrected: int = 0     # rounds ending at a draft the dense path replaced
    emitted: int = 0       # tokens generated

    def report(self) -> dict:
        return {**asdict(self), "tokens_per_round": self.emitted / max(self.rounds, 1),
                "corrected_share": self.corrected / max(self.emitted, 1),
                "draft_acceptance": self.accepted / max(self.drafted, 1)}


def _draft(model, p: int, cache, every: int, margin: float | None, stop_ids) -> list[int]:
    """The sparse path's greedy tokens after p, up to `every`, ending early at an end token or where the top two
    logits are within `margin`."""
    drafts, token = [], p
    for _ in range(every):
        logits = np.asarray(model([token], cache)[-1], dtype=np.float64)
        token = int(np.argmax(logits))
        drafts.append(token)
        top = np.partition(logits, -2)[-2:]
        if token in stop_ids or (margin is not None and top[1] - top[0] < margin):
            break
    return drafts


def stream_corrected(model, tokenizer, prompt: list[int], max_tokens: int, every: int, margin: float | None,
                     stop_ids: set[int] | None = None) -> Iterator[GenerationResponse]:
    """stream_generate's responses, greedy, each token checked by the dense path; `model.correction` holds the
    counts when it ends."""
    if not getattr(model, "verifiers", None):
        raise LsparseError("correction needs an image loaded with correct_every (lsparse run --correct-every K)")
    if not prompt:
        raise LsparseError("the prompt is empty")
    stop_ids = tokenizer.eos_ids if stop_ids is None else stop_ids
    limit = min(max_tokens, model.context_length - len(prompt) - every - 1)
    if limit < 1:
        raise LsparseError(f"the prompt is {len(prompt)} tokens; the context is {model.context_length} tokens")
    cache = model.make_cache(len(prompt) + limit + every + 1)
    detokenizer = StreamingDetokenizer(tokenizer)
    model.correction = stats = Correction()
    start = time.perf_counter()
    if len(prompt) > 1:  # the prompt by the dense path in one pass; its last token starts the first round
        np.asarray(model.verify(prompt[:-1], cache))
    prompt_tps, start = len(prompt) / (time.perf_counter() - start), time.perf_counter()
    p = prompt[-1]
    while True:
        base = cache[0].offset
        drafts = _draft(model, p, cache, every, margin, stop_ids)
        for layer in cache:
            layer.offset = base
        dense = np.asarray(model.verify([p, *drafts], cache))  # (len(drafts) + 1, vocab)
        choices = dense.argmax(-1)
        agree = next((i for i, d in enumerate(drafts) if choices[i] != d), len(drafts))
        for layer in cache:
            layer.offset = base + 1 + agree  # p and the accepted drafts
        stats.rounds, stats.drafted, stats.accepted = stats.rounds + 1, stats.drafted + len(drafts), \
            stats.accepted + agree
        stats.corrected += agree < len(drafts)
        for i in range(agree + 1):
            token = int(choices[i])
            stats.emitted += 1
            n = stats.emitted
            stop = token in stop_ids
            reason = "stop" if stop else "length" if n == limit else None
            text = "" if stop else detokenizer.add(token)
            if reason == "length":
                text += detokenizer.flush()
            yield GenerationResponse(text, token, log_probabilities(dense[i]), model.costs.now, len(prompt),
                                     prompt_tps, n, n / (time.perf_counter() - start), peak_memory_bytes(), reason)
            if reason is not None:
                return
        p = int(choices[agree])
