"""`lsparse run`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lsparse.cli.app import app
from lsparse.cli.model_options import ModelChoice, model_options, prompt_text
from lsparse.errors import LsparseError

RUN_HELP = (
    "Generate text from a flash image (exact, predicted or dense) or, with --dense, from any checkpoint.\n\n"
    "The text streams between ========== lines, as mlx-lm prints them; then prompt and generation tokens and "
    "speeds (an end token counts, as in mlx-lm), Peak memory and, for an image, what the FFNs read from flash "
    "per token. Peak memory is this process's peak resident memory (weights, caches, buffers and Python), and "
    "on a Mac MLX's peak of Metal buffers beside it; mlx-lm reports MLX's allocator peak alone, which leaves out "
    "memory outside MLX.")


@app.command(help=RUN_HELP)
@model_options
def run(
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="Prompt text; - reads it from standard "
                                         "input [Once upon a time]."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from this file."),
    max_tokens: int = typer.Option(100, "--max-tokens", "-m", min=1, help="Most tokens to generate."),
    ignore_chat_template: bool = typer.Option(False, "--ignore-chat-template",
                                              help="Use the prompt as is, even if the tokenizer has a template."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
    correct_every: Optional[int] = typer.Option(None, "--correct-every", min=1, help="Predicted mode, greedy: "
                                                "the dense path checks the sparse tokens every K tokens and "
                                                "replaces the first it disagrees with (Sirius)."),
    correct_margin: Optional[float] = typer.Option(None, "--correct-margin", min=0.0, help="With "
                                                   "--correct-every: check sooner, where the sparse path's top two "
                                                   "logits are closer than this."),
    *,
    choice: ModelChoice,
):
    from lsparse.runtime.run import run as run_model
    options = choice.decode_options()
    if correct_every is not None or correct_margin is not None:
        if options is None or choice.temp != 0:
            raise LsparseError("--correct-every checks greedy decoding from an image (no --temp)")
        options = options.but(correct_every=correct_every, correct_margin=correct_margin)
    run_model(choice.model, prompt_text(prompt, prompt_file, "Once upon a time"), max_tokens,
              options, choice.sampler(), chat=not ignore_chat_template,
              allow_special=choice.allow_special, revision=choice.revision, tokenizer=choice.tokenizer,
              backend=choice.backend, as_json=as_json)
