"""lsparse from Python, in the manner of mlx-lm (`from lsparse import load, generate, stream_generate`); the page
docs/API.md shows it at work. Options are the objects the command line builds: DecodeOptions (run, chat),
CompileOptions (compile), BenchOptions (bench)."""

from __future__ import annotations

import sys
from typing import Iterator

from lsparse.bench.ladder import BenchOptions
from lsparse.bench.ladder import bench as bench_ladder
from lsparse.errors import LsparseError
from lsparse.image.compile import CompileOptions, compile_image
from lsparse.image.image import Image, is_image
from lsparse.runtime import run as running
from lsparse.runtime.chat import Chat
from lsparse.runtime.generate import GenerationResponse
from lsparse.runtime.generate import stream_generate as stream_tokens
from lsparse.runtime.options import DecodeOptions, parse_budget
from lsparse.runtime.sampling import make_sampler

__all__ = ["BenchOptions", "Chat", "CompileOptions", "DecodeOptions", "GenerationResponse", "bench", "compile",
           "generate", "load", "make_sampler", "stream_generate"]


def load(model: str, options: DecodeOptions | None = None, *, context: int | None = None, revision: str | None = None,
         tokenizer: str | None = None, backend: str | None = None, **fields) -> tuple[object, object]:
    """(model, tokenizer). A flash image decodes as `options` say (or DecodeOptions(**fields); ram_budget may
    be written as `lsparse run --ram-budget` takes it: "50%", "2GB"), its KV cache planned for `context`
    tokens [DecodeOptions.context]; any other model (builtin:NAME, a folder, repo id, GGUF or llama2.c file)
    loads as a checkpoint with every weight in RAM (revision, tokenizer and backend as `run --dense` takes
    them). An image model holds reader threads and files: call model.close() when done."""
    if not is_image(model):
        if options is not None or fields or context is not None:
            raise LsparseError(f"{model} is a checkpoint, decoded dense: decode options apply to images")
        loaded, tok, _, _ = running.load(model, None, revision=revision, tokenizer=tokenizer, backend=backend)
        return loaded, tok
    if options is not None and fields:
        raise LsparseError("give DecodeOptions or its fields, not both")
    if isinstance(fields.get("ram_budget"), str):
        fields["ram_budget"] = parse_budget(fields["ram_budget"], Image.open(model))
    loaded, tok, _, _ = running.load(model, options or DecodeOptions(**fields), context)
    return loaded, tok


def stream_generate(model, tokenizer, prompt: str | list[int], max_tokens: int = 256, *, temp: float = 0.0,
                    top_p: float = 1.0, seed: int | None = None) -> Iterator[GenerationResponse]:
    """One GenerationResponse per token: text, token, logprobs, cost (an image's TokenCost: bytes_read, io_s,
    mem_s, compute_s), counts, speeds, peak memory, finish_reason. A prompt string is encoded as written,
    special-token text included (tokenizer.apply_chat_template makes one from messages); a list is token ids."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    yield from stream_tokens(model, tokenizer, ids, max_tokens, make_sampler(temp, top_p, seed))


def generate(model, tokenizer, prompt: str | list[int], max_tokens: int = 256, *, verbose: bool = False,
             **sampling) -> str:
    """The generated text. `verbose`: streamed to standard output with `lsparse run`'s summary."""
    text, last = [], None
    if verbose:
        print("=" * 10)
    for last in stream_generate(model, tokenizer, prompt, max_tokens, **sampling):
        text.append(last.text)
        if verbose:
            print(last.text, end="", flush=True)
    if verbose and last is not None:
        report = {"prompt_tokens": last.prompt_tokens, "prompt_tps": last.prompt_tps,
                  "generated_tokens": last.generation_tokens, "generation_tps": last.generation_tps,
                  "peak_memory_bytes": last.peak_memory}
        if getattr(model, "fetcher", None) is not None:
            report["flash"] = model.flash_report()
        running.print_report(report, sys.stdout)
    return "".join(text)


def compile(source: str, output: str, options: CompileOptions | None = None, **fields):  # noqa: A001
    """`lsparse compile SOURCE -o OUTPUT`: the image's Manifest. Options as CompileOptions or its fields."""
    from lsparse.runtime.gate import gate_thresholds
    return compile_image(source, output, options or CompileOptions(**fields), gate=gate_thresholds)


def bench(image: str, options: BenchOptions | None = None, progress=None, **fields) -> dict:
    """`lsparse bench IMAGE --json`: the ladder's rows and the budget sweep. Options as BenchOptions or its
    fields; progress(message) hears each step (None: silent)."""
    return bench_ladder(image, options or BenchOptions(**fields), progress or (lambda message: None))
