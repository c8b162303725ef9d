"""`lsparse run`, and the options it shares with `lsparse chat`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from lsparse.cli.app import app
from lsparse.errors import LsparseError
from lsparse.runtime.options import DEFAULT_READERS

# Options `run` and `chat` share: what to load and how to decode it, and how to sample.
MODEL = typer.Argument(..., help="A flash image, or (dense) any checkpoint: builtin:NAME, a Hugging Face folder "
                                 "or repo id, a GGUF or llama2.c file.")
DENSE = typer.Option(False, "--dense", help="Every weight in RAM (the baseline).")
MODE = typer.Option(None, "--mode", help="For an image: exact (the gate resident, lossless), predicted, dense, or "
                                         "hybrid (the whole FFN read every token: a baseline). Default: exact.")
WINDOW = typer.Option(None, "--window", min=1, help="Images: keep only the neurons of the last k tokens in RAM "
                                                    "[all, until the cache is full].")
THRESHOLD = typer.Option(None, "--threshold", help="Images: shift of the predictor's threshold (negative: load "
                                                   "more neurons) [0].")
TEMP = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy.")
TOP_P = typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the smallest set with this mass.")
SEED = typer.Option(None, "--seed", help="Random seed for sampling.")
ALLOW_SPECIAL = typer.Option(False, "--allow-special", help="Let special-token text the user writes "
                             "(<|im_start|>) become control tokens; by default it stays text.")
REVISION = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit).")
TOKENIZER = typer.Option(None, "--tokenizer", help="Tokenizer file for a llama2.c checkpoint.")
BACKEND = typer.Option(None, "--backend", help="Checkpoints: numpy or mlx (default: mlx with Metal, else numpy).")
BUFFERED = typer.Option(False, "--buffered", help="Read the image through the page cache.")
RAM_BUDGET = typer.Option(None, "--ram-budget", help="Images: plan RAM to fit, as bytes (512MB, 2GB) or a share of "
                                                     "the model as stored (50%), or refuse.")
LOOKAHEAD = typer.Option(False, "--lookahead", help="Images: start reading the next layer's guessed neurons while "
                                                    "this layer computes.")
KERNELS = typer.Option(None, "--kernels", help="Images: what computes the FFNs: auto (metal on a Mac, else cpu), "
                                               "cpu (C kernels on rows as stored), mlx (MLX's quantized kernel), "
                                               "metal [auto].")
PACKED = typer.Option(False, "--packed", help="Images: the same as --kernels mlx.")
READERS = typer.Option(None, "--readers", min=1, help=f"Images: reader threads, each with one read in flight "
                                                      f"[{DEFAULT_READERS}].")



RUN_HELP = (
    "Generate text from a flash image (exact, predicted or dense) or, with --dense, from any checkpoint.\n\n"
    "The text streams between ========== lines, as mlx-lm prints them; then prompt and generation tokens and "
    "speeds (an end token counts, as in mlx-lm), Peak memory and, for an image, what the FFNs read from flash "
    "per token. Peak memory is this process's peak resident memory (weights, caches, buffers and Python); "
    "mlx-lm reports MLX's allocator peak, which leaves out memory outside MLX.")


@app.command(help=RUN_HELP)
def run(
    model: str = MODEL,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text; - reads it from standard "
                                         "input [Once upon a time]."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from this file."),
    allow_special: bool = ALLOW_SPECIAL,
    max_tokens: int = typer.Option(100, "--max-tokens", "-m", min=1, help="Most tokens to generate."),
    dense: bool = DENSE,
    mode: Optional[str] = MODE,
    window: Optional[int] = WINDOW,
    threshold: Optional[float] = THRESHOLD,
    temp: float = TEMP,
    top_p: float = TOP_P,
    seed: Optional[int] = SEED,
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template",
                                              help="Use the prompt as is, even if the tokenizer has a template."),
    revision: Optional[str] = REVISION,
    tokenizer: Optional[str] = TOKENIZER,
    backend: Optional[str] = BACKEND,
    buffered: bool = BUFFERED,
    ram_budget: Optional[str] = RAM_BUDGET,
    lookahead: bool = LOOKAHEAD,
    kernels: Optional[str] = KERNELS,
    packed: bool = PACKED,
    readers: Optional[int] = READERS,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
):
    from lsparse.runtime.run import run as run_model
    from lsparse.runtime.sampling import make_sampler
    options = decode_choice(model, dense, mode, window, threshold, ram_budget, kernels, packed, readers, buffered,
                            lookahead, revision, tokenizer, backend)
    run_model(model, prompt_text(prompt, prompt_file, "Once upon a time"), max_tokens, options,
              make_sampler(temp, top_p, seed), chat=not ignore_chat_template, allow_special=allow_special,
              revision=revision, tokenizer=tokenizer, backend=backend, as_json=as_json)


def decode_choice(model, dense, mode, window, threshold, ram_budget, kernels, packed, readers, buffered, lookahead,
                  revision, tokenizer, backend):
    """DecodeOptions for an image, or None for a checkpoint decoded dense; options that do not apply refused."""
    from lsparse.image.image import is_image
    image_only = {"--mode": mode, "--window": window, "--threshold": threshold, "--ram-budget": ram_budget,
                  "--kernels": kernels, "--packed": packed or None, "--readers": readers,
                  "--buffered": buffered or None, "--lookahead": lookahead or None}
    checkpoint_only = {"--revision": revision, "--tokenizer": tokenizer, "--backend": backend}
    if is_image(model):
        _refuse(checkpoint_only, "apply to checkpoints, not to an image")
        if dense and mode is not None:
            raise LsparseError("--dense is --mode dense: give one of them")
        return _decode_options(model, mode or ("dense" if dense else "exact"), window, threshold, ram_budget,
                               kernels, packed, readers, buffered, lookahead)
    if dense:
        _refuse(image_only, "apply to images (lsparse compile makes one), not to --dense on a checkpoint")
        return None
    raise LsparseError(f"{model} is not a flash image (lsparse compile makes one); add --dense to decode a "
                       "checkpoint with every weight in RAM")


def _refuse(given: dict, why: str) -> None:
    named = [name for name, value in given.items() if value is not None]
    if named:
        raise LsparseError(f"{', '.join(named)} {why}")


def _decode_options(image, mode, window, threshold, ram_budget, kernels, packed, readers, buffered, lookahead):
    from lsparse.image.image import Image
    from lsparse.runtime.options import DecodeOptions, parse_budget
    budget = parse_budget(ram_budget, Image.open(image) if ram_budget and ram_budget.strip().endswith("%") else None)
    given = {"mode": mode, "window": window, "threshold_shift": threshold, "ram_budget": budget,
             "kernels": _kernels(kernels or "auto", packed), "readers": readers, "direct": not buffered,
             "lookahead": lookahead}
    return DecodeOptions(**{k: v for k, v in given.items() if v is not None})


def prompt_text(prompt: str | None, prompt_file: Path | None, default: str | None) -> str | None:
    """The prompt as --prompt (- : standard input) or --prompt-file gives it."""
    if prompt is not None and prompt_file is not None:
        raise LsparseError("give the prompt with --prompt or with --prompt-file, not both")
    try:
        if prompt_file is not None:
            return prompt_file.read_bytes().decode("utf-8")
        if prompt == "-":
            return sys.stdin.buffer.read().decode("utf-8")
    except UnicodeDecodeError:
        raise LsparseError("the prompt is not valid UTF-8 text") from None
    return default if prompt is None else utf8(prompt)


def utf8(text: str) -> str:
    """Text as the terminal gave it: bytes that are not UTF-8 arrive as lone surrogates, refused here."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise LsparseError("the text is not valid UTF-8") from None
    return text


def _kernels(kernels: str, packed: bool) -> str:
    if packed and kernels not in ("auto", "mlx"):
        raise LsparseError(f"--packed means --kernels mlx; it cannot go with --kernels {kernels}")
    return "mlx" if packed else kernels
