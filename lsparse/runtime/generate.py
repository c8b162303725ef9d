"""The generation loop and its statistics, in the manner of mlx-lm's generate."""

from __future__ import annotations

import resource
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

from lsparse.errors import LsparseError
from lsparse.model.backend import evaluate, to_numpy


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generation_seconds: float = 0.0
    peak_memory_bytes: int = 0

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def generation_tps(self) -> float:
        return self.generated_tokens / self.generation_seconds if self.generation_seconds else 0.0

    def as_dict(self) -> dict:
        return {**asdict(self), "prompt_tps": self.prompt_tps, "generation_tps": self.generation_tps}


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


def generate(model, prompt: list[int], max_tokens: int, sample: Callable, stop_ids: set[int],
             stats: GenerationStats) -> Iterator[int]:
    """Yield generated token ids; `stats` is filled in as they come. Stops at a stop token (not yielded),
    after max_tokens, or when the context is full."""
    context = model.context_length
    if not prompt:
        raise LsparseError("the prompt is empty")
    if len(prompt) >= context:
        raise LsparseError(f"the prompt is {len(prompt)} tokens; the model's context is {context} tokens")
    max_tokens = min(max_tokens, context - len(prompt))
    cache = model.make_cache(len(prompt) + max_tokens)
    stats.prompt_tokens = len(prompt)

    start = time.perf_counter()
    logits = model(prompt, cache)[-1]
    evaluate(model.xp, logits)
    stats.prompt_seconds = time.perf_counter() - start

    start = time.perf_counter()
    for _ in range(max_tokens):
        token = sample(to_numpy(logits))
        if token in stop_ids:
            break
        stats.generated_tokens += 1
        stats.generation_seconds = time.perf_counter() - start
        yield token
        if stats.generated_tokens == max_tokens:
            break
        logits = model([token], cache)[-1]
        evaluate(model.xp, logits)
    stats.generation_seconds = time.perf_counter() - start
    stats.peak_memory_bytes = peak_rss_bytes()


class StreamingDetokenizer:
    """Text for a growing list of tokens, released only once it cannot change (no split UTF-8 characters)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.emitted = tokenizer, [], 0

    def add(self, token: int) -> str:
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):
            return ""
        new, self.emitted = text[self.emitted:], len(text)
        return new

    def text(self) -> str:
        return self.tokenizer.decode(self.tokens)
