"""The options `run` and `chat` share: what to load, how to decode it and how to sample. A command decorated
with `model_options` takes them all and receives them as one ModelChoice, whose DecodeOptions refuse the
options that do not apply."""

from __future__ import annotations

import functools
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, get_type_hints

import typer

from lsparse.errors import LsparseError
from lsparse.runtime.options import DEFAULT_READERS

MODEL = typer.Argument(..., help="A flash image, or (dense) any checkpoint: builtin:NAME, a Hugging Face folder "
                                 "or repo id, a GGUF or llama2.c file.")
# name: (type, option), in the order --help lists them after the command's own
SHARED = {
    "allow_special": (bool, typer.Option(False, "--allow-special", help="Let special-token text the user writes "
                                         "(<|im_start|>) become control tokens; by default it stays text.")),
    "dense": (bool, typer.Option(False, "--dense", help="Every weight in RAM (the baseline).")),
    "mode": (Optional[str], typer.Option(None, "--mode", help="For an image: exact (the gate resident, lossless), "
                                         "predicted, dense, or hybrid (the whole FFN read every token: a "
                                         "baseline). Default: exact.")),
    "window": (Optional[int], typer.Option(None, "--window", min=1, help="Images: keep only the neurons of the "
                                           "last k tokens in RAM \\[all, until the cache is full].")),
    "threshold": (Optional[float], typer.Option(None, "--threshold", help="Images: shift of the predictor's "
                                                "threshold (negative: load more neurons) [0].")),
    "cache_bias": (Optional[float], typer.Option(None, "--cache-bias", min=0.0, help="Images, predicted mode: "
                                                 "cache-aware masks (DIP): a cached neuron passes this far below the "
                                                 "predictor's threshold, one on flash must clear it by as much [0].")),
    "flock": (Optional[float], typer.Option(None, "--flock", help="Images, exact or predicted mode: flocking "
                                            "(GRIFFIN): the prompt streams each layer once and this share of its "
                                            "neurons, those the prompt used most, stays in RAM for the sequence.")),
    "flock_rule": (Optional[str], typer.Option(None, "--flock-rule", help="With --flock: add (the mode's mask, "
                                               "the flock cached), within (the mask kept to the flock: no reads "
                                               "after the prompt) or core (every flock neuron, no predictor; "
                                               "predicted mode) \\[add].")),
    "kv_top_k": (Optional[int], typer.Option(None, "--kv-top-k", help="Images: SparQ attention: each decoding "
                                             "step reads the K keys and values its approximate scores rank "
                                             "highest (and the values' mean), not all of them.")),
    "kv_rank": (Optional[int], typer.Option(None, "--kv-rank", help="With --kv-top-k: the query components the "
                                            "approximate scores use \\[a quarter of the head's].")),
    "kv_ram_tokens": (Optional[int], typer.Option(None, "--kv-ram-tokens", help="With --kv-top-k: the KV cache "
                                                  "paged to flash: each layer holds its newest R to 2R tokens in "
                                                  "RAM and reads only what SparQ uses of the older ones.")),
    "temp": (float, typer.Option(0.0, "--temp", help="Sampling temperature; 0 is greedy.")),
    "top_p": (float, typer.Option(1.0, "--top-p", help="Nucleus sampling: keep the smallest set with this mass.")),
    "seed": (Optional[int], typer.Option(None, "--seed", help="Random seed for sampling.")),
    "revision": (Optional[str], typer.Option(None, "--revision", help="Hub revision (branch, tag or commit).")),
    "tokenizer": (Optional[str], typer.Option(None, "--tokenizer", help="Tokenizer file for a llama2.c "
                                              "checkpoint.")),
    "backend": (Optional[str], typer.Option(None, "--backend", help="Checkpoints: numpy or mlx (default: mlx with "
                                            "Metal, else numpy).")),
    "buffered": (bool, typer.Option(False, "--buffered", help="Read the image through the page cache.")),
    "ram_budget": (Optional[str], typer.Option(None, "--ram-budget", help="Images: plan RAM to fit, as bytes "
                                               "(512MB, 2GB) or a share of the model as stored (50%), or refuse.")),
    "lookahead": (bool, typer.Option(False, "--lookahead", help="Images: start reading the next layer's guessed "
                                     "neurons while this layer computes.")),
    "kernels": (Optional[str], typer.Option(None, "--kernels", help="Images: what computes the FFNs: auto (metal "
                                            "on a Mac, else cpu), cpu (C kernels on rows as stored), mlx (MLX's "
                                            "quantized kernel), metal \\[auto].")),
    "packed": (bool, typer.Option(False, "--packed", help="Images: the same as --kernels mlx.")),
    "readers": (Optional[int], typer.Option(None, "--readers", min=1, help=f"Images: reader threads, each with "
                                            f"one read in flight [{DEFAULT_READERS}].")),
}


@dataclass(frozen=True)
class ModelChoice:
    model: str
    allow_special: bool
    dense: bool
    mode: str | None
    window: int | None
    threshold: float | None
    cache_bias: float | None
    flock: float | None
    flock_rule: str | None
    kv_top_k: int | None
    kv_rank: int | None
    kv_ram_tokens: int | None
    temp: float
    top_p: float
    seed: int | None
    revision: str | None
    tokenizer: str | None
    backend: str | None
    buffered: bool
    ram_budget: str | None
    lookahead: bool
    kernels: str | None
    packed: bool
    readers: int | None

    def decode_options(self):
        """DecodeOptions for an image, or None for a checkpoint decoded dense; options that do not apply
        refused."""
        from lsparse.image.image import is_image
        image_only = {"--mode": self.mode, "--window": self.window, "--threshold": self.threshold,
                      "--cache-bias": self.cache_bias, "--flock": self.flock, "--flock-rule": self.flock_rule,
                      "--kv-top-k": self.kv_top_k, "--kv-rank": self.kv_rank, "--kv-ram-tokens": self.kv_ram_tokens,
                      "--ram-budget": self.ram_budget, "--kernels": self.kernels, "--packed": self.packed or None,
                      "--readers": self.readers, "--buffered": self.buffered or None,
                      "--lookahead": self.lookahead or None}
        checkpoint_only = {"--revision": self.revision, "--tokenizer": self.tokenizer, "--backend": self.backend}
        if is_image(self.model):
            _refuse(checkpoint_only, "apply to checkpoints, not to an image")
            if self.dense and self.mode is not None:
                raise LsparseError("--dense is --mode dense: give one of them")
            return self._image_options()
        if self.dense:
            _refuse(image_only, "apply to images (lsparse compile makes one), not to --dense on a checkpoint")
            return None
        raise LsparseError(f"{self.model} is not a flash image (lsparse compile makes one); add --dense to decode "
                           "a checkpoint with every weight in RAM")

    def _image_options(self):
        from lsparse.image.image import Image
        from lsparse.runtime.options import DecodeOptions, parse_budget
        share = self.ram_budget and self.ram_budget.strip().endswith("%")
        budget = parse_budget(self.ram_budget, Image.open(self.model) if share else None)
        if self.packed and (self.kernels or "auto") not in ("auto", "mlx"):
            raise LsparseError(f"--packed means --kernels mlx; it cannot go with --kernels {self.kernels}")
        given = {"mode": self.mode or ("dense" if self.dense else "exact"), "window": self.window,
                 "threshold_shift": self.threshold, "cache_bias": self.cache_bias, "flock": self.flock,
                 "flock_rule": self.flock_rule, "kv_top_k": self.kv_top_k, "kv_rank": self.kv_rank,
                 "kv_ram_tokens": self.kv_ram_tokens, "ram_budget": budget,
                 "kernels": "mlx" if self.packed else self.kernels or "auto", "readers": self.readers,
                 "direct": not self.buffered, "lookahead": self.lookahead}
        return DecodeOptions(**{k: v for k, v in given.items() if v is not None})

    def sampler(self):
        from lsparse.runtime.sampling import make_sampler
        return make_sampler(self.temp, self.top_p, self.seed)


def model_options(command):
    """The command with MODEL and every SHARED option added to its own; it is called with `choice`, a
    ModelChoice, in their place."""
    own = [p for p in inspect.signature(command).parameters.values() if p.name != "choice"]
    shared = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=kind)
              for name, (kind, option) in SHARED.items()]
    model = inspect.Parameter("model", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=MODEL, annotation=str)

    @functools.wraps(command)
    def with_choice(**given):
        choice = ModelChoice(**{name: given.pop(name) for name in ("model", *SHARED)})
        return command(choice=choice, **given)

    with_choice.__signature__ = inspect.Signature([model, *own, *shared])
    hints = get_type_hints(command)
    with_choice.__annotations__ = {**{p.name: hints[p.name] for p in own}, "model": str,
                                   **{name: kind for name, (kind, _) in SHARED.items()}}
    return with_choice


def _refuse(given: dict, why: str) -> None:
    named = [name for name, value in given.items() if value is not None]
    if named:
        raise LsparseError(f"{', '.join(named)} {why}")


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
