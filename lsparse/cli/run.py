"""`lsparse run`."""

from __future__ import annotations

from typing import Optional

import typer

from lsparse.cli.app import app
from lsparse.errors import LsparseError
from lsparse.runtime.options import DEFAULT_READERS


@app.command()
def run(
    model: str = typer.Argument(..., help="A flash image, or (dense) any checkpoint: builtin:NAME, a Hugging Face "
                                          "folder or repo id, a GGUF or llama2.c file."),
    prompt: str = typer.Option("Once upon a time", "--prompt", "-p", help="Prompt text."),
    max_tokens: int = typer.Option(100, "--max-tokens", "-m", min=1, help="Most tokens to generate."),
    dense: bool = typer.Option(False, "--dense", help="Every weight in RAM (the baseline)."),
    mode: Optional[str] = typer.Option(None, "--mode", help="For an image: exact (the gate resident, lossless), "
                                                            "predicted, dense, or hybrid (the whole FFN read "
                                                            "every token: a baseline). Default: exact."),
    window: Optional[int] = typer.Option(None, "--window", min=1, help="Images: keep only the neurons of the last k "
                                         "tokens in RAM [all, until the cache is full]."),
    threshold: Optional[float] = typer.Option(None, "--threshold", help="Images: shift of the predictor's "
                                              "threshold (negative: load more neurons) [0]."),
    temp: float = typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy."),
    top_p: float = typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the smallest set with this mass."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Random seed for sampling."),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template",
                                              help="Use the prompt as is, even if the tokenizer has a template."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision (branch, tag or commit)."),
    tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer file for a llama2.c checkpoint."),
    backend: Optional[str] = typer.Option(None, "--backend",
                                          help="Checkpoints: numpy or mlx (default: mlx with Metal, else numpy)."),
    buffered: bool = typer.Option(False, "--buffered", help="Read the image through the page cache."),
    ram_budget: Optional[str] = typer.Option(None, "--ram-budget", help="Images: plan RAM to fit, as bytes (512MB, "
                                             "2GB) or a share of the model as stored (50%), or refuse."),
    lookahead: bool = typer.Option(False, "--lookahead", help="Images: start reading the next layer's guessed "
                                                              "neurons while this layer computes."),
    kernels: Optional[str] = typer.Option(None, "--kernels", help="Images: what computes the FFNs: auto (metal on "
                                          "a Mac, else cpu), cpu (C kernels on rows as stored), mlx (MLX's quantized "
                                          "kernel), metal [auto]."),
    packed: bool = typer.Option(False, "--packed", help="Images: the same as --kernels mlx."),
    readers: Optional[int] = typer.Option(None, "--readers", min=1, help="Images: reader threads, each with one "
                                          f"read in flight [{DEFAULT_READERS}]."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
):
    """Generate text from a flash image (exact, predicted or dense) or, with --dense, from any checkpoint."""
    from lsparse.image.image import is_image
    from lsparse.runtime.run import run as run_model
    from lsparse.runtime.sampling import make_sampler
    image_only = {"--mode": mode, "--window": window, "--threshold": threshold, "--ram-budget": ram_budget,
                  "--kernels": kernels, "--packed": packed or None, "--readers": readers,
                  "--buffered": buffered or None, "--lookahead": lookahead or None}
    checkpoint_only = {"--revision": revision, "--tokenizer": tokenizer, "--backend": backend}
    if is_image(model):
        _refuse(checkpoint_only, "apply to checkpoints, not to an image")
        if dense and mode is not None:
            raise LsparseError("--dense is --mode dense: give one of them")
        options = _decode_options(model, mode or ("dense" if dense else "exact"), window, threshold, ram_budget,
                                  kernels, packed, readers, buffered, lookahead)
    elif dense:
        _refuse(image_only, "apply to images (lsparse compile makes one), not to --dense on a checkpoint")
        options = None
    else:
        raise LsparseError(f"{model} is not a flash image (lsparse compile makes one); add --dense to decode a "
                           "checkpoint with every weight in RAM")
    run_model(model, _text(prompt), max_tokens, options, make_sampler(temp, top_p, seed),
              chat=not ignore_chat_template, revision=revision, tokenizer=tokenizer, backend=backend, as_json=as_json)


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


def _text(prompt: str) -> str:
    """The prompt as the terminal gave it; bytes that are not UTF-8 arrive as lone surrogates."""
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:
        raise LsparseError("the prompt is not valid UTF-8 text") from None
    return prompt


def _kernels(kernels: str, packed: bool) -> str:
    if packed and kernels not in ("auto", "mlx"):
        raise LsparseError(f"--packed means --kernels mlx; it cannot go with --kernels {kernels}")
    return "mlx" if packed else kernels
