"""The generation loop, in the manner of mlx-lm's stream_generate: one response per token, with its text, its
log-probabilities and what it cost."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from lsparse.errors import LsparseError
from lsparse.model.backend import evaluate, to_numpy


@dataclass
class GenerationResponse:
    text: str                  # the new text this token completes (may be empty: a split character)
    token: int
    logprobs: np.ndarray       # (vocab,) log-probabilities the token was drawn from
    cost: object | None        # the token's TokenCost (images); None for a dense checkpoint
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory: int           # bytes: this process's peak resident memory so far (peak_memory_bytes)
    finish_reason: str | None  # "stop" (an end token), "length" (max_tokens), "context" (the context is full)


def peak_rss_bytes() -> int:
    """Peak resident memory of this process. On Linux, VmHWM: ru_maxrss survives exec, so a child would
    report its parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # macOS reports bytes, Linux KiB


def peak_memory_bytes() -> int:
    """The process's peak resident memory, and on a Mac MLX's peak of Metal buffers beside it: GPU buffers
    that the CPU never touches need not show in the process's resident pages."""
    import mlx.core as mx
    return peak_rss_bytes() + (mx.get_peak_memory() if mx.metal.is_available() else 0)


def storage_read_bytes() -> int | None:
    """Bytes this process has had read from storage so far, as the kernel counts them (/proc/self/io): direct
    reads and the page faults of mapped files alike. None where the count is not kept (macOS)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def log_probabilities(logits) -> np.ndarray:
    z = to_numpy(logits).astype(np.float64)
    z = z - z.max()
    return z - np.log(np.exp(z).sum())


def stream_generate(model, tokenizer, prompt: list[int], max_tokens: int, sample: Callable,
                    stop_ids: set[int] | None = None, cache: list | None = None) -> Iterator[GenerationResponse]:
    """Yield one response per generated token. Ends at an end token (yielded, with empty text, its
    finish_reason "stop"), after max_tokens, or when the context is full. `tokenizer` None (a checkpoint
    without one, timed only): no text, and `stop_ids` must be given. `cache`: a KV cache (model.make_cache)
    whose tokens the prompt continues (a conversation); every generated token but the last is added to it."""
    held = cache[0].offset if cache else 0
    context = cache[0].keys.shape[1] if cache else model.context_length
    if not prompt:
        raise LsparseError("the prompt is empty")
    if held + len(prompt) >= context:
        raise LsparseError(f"the prompt is {held + len(prompt)} tokens; the context is {context} tokens")
    stop_ids = tokenizer.eos_ids if stop_ids is None else stop_ids
    detokenizer = StreamingDetokenizer(tokenizer) if tokenizer is not None else None
    limit = min(max_tokens, context - held - len(prompt))
    cache = cache or model.make_cache(len(prompt) + limit)
    costs = getattr(model, "costs", None)
    start = time.perf_counter()
    logits = model(prompt, cache, last_only=True)[-1]
    evaluate(model.xp, logits)
    prompt_tps = len(prompt) / (time.perf_counter() - start)
    start = time.perf_counter()
    for n in range(1, limit + 1):
        logprobs = log_probabilities(logits)
        token = sample(logprobs)
        stop = token in stop_ids
        reason = "stop" if stop else "length" if n == max_tokens else "context" if n == limit else None
        text = "" if stop or detokenizer is None else detokenizer.add(token)
        if reason is not None and not stop and detokenizer is not None:
            text += detokenizer.flush()
        yield GenerationResponse(text, token, logprobs, costs.now if costs else None, len(prompt), prompt_tps, n,
                                 n / (time.perf_counter() - start), peak_memory_bytes(), reason)
        if reason is not None:
            return
        logits = model([token], cache)[-1]
        evaluate(model.xp, logits)


def generate(model, tokenizer, prompt: list[int], max_tokens: int, sample: Callable,
             stop_ids: set[int] | None = None) -> list[int]:
    """The generated tokens, the end token left out."""
    return [r.token for r in stream_generate(model, tokenizer, prompt, max_tokens, sample, stop_ids)
            if r.finish_reason != "stop"]


class StreamingDetokenizer:
    """Text for a growing list of tokens in constant time per token: each step decodes only the tokens since
    the last text released and one before them (whose text is already out), so that a tokenizer that drops a
    leading space at the start of a decode still gives the space here. Text ending in a split UTF-8 character
    waits for the next token."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens = tokenizer, []
        self.prefix = 0  # tokens[prefix:released] decode to text already released
        self.released = 0

    def add(self, token: int) -> str:
        self.tokens.append(token)
        return self._release(final=False)

    def flush(self) -> str:
        """What is left, split characters included (the end of a generation)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        before = self.tokenizer.decode(self.tokens[self.prefix:self.released])
        text = self.tokenizer.decode(self.tokens[self.prefix:])
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self.prefix, self.released = self.released, len(self.tokens)
        return text[len(before):]
