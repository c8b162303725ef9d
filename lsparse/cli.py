"""The lsparse command line: parses options and calls the stages. No work happens here."""

from __future__ import annotations

import json
import sys
from typing import Optional

import click
import typer

from lsparse.errors import LsparseError
from lsparse.runtime.reader import DEFAULT_READERS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Run language models larger than RAM by paging sparse FFN neurons from flash.")
state = {"debug": False}


def _version(value: bool):
    if value:
        from lsparse import __version__
        typer.echo(f"lsparse {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
):
    state["debug"] = debug


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
    window: int = typer.Option(5, "--window", min=1, help="Keep the neurons of the last k tokens in RAM."),
    threshold: float = typer.Option(0.0, "--threshold",
                                    help="Shift of the predictor's threshold (negative: load more neurons)."),
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
    ram_budget: Optional[str] = typer.Option(None, "--ram-budget",
                                             help="Images: plan RAM to fit, e.g. 512MB or 2GB, or refuse."),
    lookahead: bool = typer.Option(False, "--lookahead", help="Images: start reading the next layer's guessed "
                                                              "neurons while this layer computes."),
    kernels: str = typer.Option("auto", "--kernels", help="Images: what computes the FFNs: auto (metal on a Mac, "
                                                          "else cpu), cpu (C kernels on rows as stored), mlx "
                                                          "(MLX's quantized kernel), metal."),
    packed: bool = typer.Option(False, "--packed", help="Images: the same as --kernels mlx."),
    readers: int = typer.Option(DEFAULT_READERS, "--readers", min=1,
                                help="Images: reader threads, each with one read in flight."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
):
    """Generate text from a flash image (exact, predicted or dense) or, with --dense, from any checkpoint."""
    from lsparse.runtime.run import is_image
    from lsparse.runtime.run import run as run_model
    if is_image(model):
        mode = "dense" if dense and mode is None else (mode or "exact")
    elif dense:
        mode = None
    else:
        raise LsparseError(f"{model} is not a flash image (lsparse compile makes one); add --dense to decode a "
                           "checkpoint with every weight in RAM")
    run_model(model, prompt, max_tokens, mode=mode, window=window, threshold_shift=threshold, temp=temp,
              top_p=top_p, seed=seed, chat=not ignore_chat_template, revision=revision, tokenizer=tokenizer,
              backend=backend, as_json=as_json, direct=not buffered, ram_budget=ram_budget,
              lookahead=lookahead, kernels=_kernels(kernels, packed), readers=readers)


def _kernels(kernels: str, packed: bool) -> str:
    if packed and kernels not in ("auto", "mlx"):
        raise LsparseError(f"--packed means --kernels mlx; it cannot go with --kernels {kernels}")
    return "mlx" if packed else kernels


@app.command()
def inspect(
    model: str = typer.Argument(..., help="An image, or a checkpoint (builtin:NAME, folder, repo id, GGUF, "
                                          "llama2.c file)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Describe an image (components, sparsity, hot set, predictors, layout) or a checkpoint."""
    from pathlib import Path
    if (Path(model) / "manifest.json").exists():
        from lsparse.image.inspect import describe_image, print_image
        summary = describe_image(model)
        show = print_image
    else:
        from lsparse.model.summary import describe, print_summary
        from lsparse.source import resolve
        summary, show = describe(resolve(model, revision)), print_summary
    if as_json:
        typer.echo(json.dumps(summary, indent=2))
    else:
        show(summary)


@app.command()
def stats(
    model: str = typer.Argument(..., help="A checkpoint (builtin:NAME, folder, repo id, llama2.c file)."),
    text: str = typer.Option(..., "--text", help="Real text to measure on (TinyStories-style files: stories "
                                                 "separated by <|endoftext|>)."),
    tokens: int = typer.Option(4096, "--tokens", min=16, help="Tokens of the text to use."),
    window: int = typer.Option(512, "--window", min=2, help="Longest sequence run at once."),
    levels: str = typer.Option("0.25,0.5,0.7", "--levels",
                               help="Shares of activations to zero by magnitude, for the perplexity sweep."),
    mask_sparsity: float = typer.Option(0.5, "--mask-sparsity",
                                        help="For SwiGLU models: the magnitude quantile below which a neuron "
                                             "counts as inactive in the window and hot/cold figures."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG of window growth per layer here."),
    backend: Optional[str] = typer.Option(None, "--backend", help="numpy or mlx."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Activation statistics on real text: sparsity, window growth, hot-neuron coverage, threshold cost."""
    from lsparse.calibrate.stats import compute_stats, plot_window_growth, print_stats
    try:
        level_values = tuple(float(v) for v in levels.split(","))
    except ValueError:
        raise LsparseError(f"--levels must be comma-separated numbers, got {levels!r}") from None
    result = compute_stats(model, text, tokens, window, level_values, mask_sparsity, backend)
    if plot:
        plot_window_growth(result, plot)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_stats(result)


@app.command(name="compile")
def compile_(
    source: str = typer.Argument(..., help="A checkpoint: builtin:NAME, a Hugging Face folder or repo id, a GGUF "
                                           "or llama2.c file."),
    output: str = typer.Option(..., "--output", "-o", help="The image directory to write."),
    calib: Optional[str] = typer.Option(None, "--calib", help="Calibration text (default: lsparse's stories)."),
    config: Optional[str] = typer.Option(None, "--config", help="A preset: opt, reglu-llama, drelu, "
                                                                "swiglu-threshold, or a TOML file."),
    calib_tokens: Optional[int] = typer.Option(None, "--calib-tokens", min=1, help="Calibration tokens [8192]."),
    bits: Optional[int] = typer.Option(None, "--bits", help="Bundle precision: 4, 8 or 16 [4]."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Quantization group: 32, 64, 128 [64]."),
    hot_fraction: Optional[float] = typer.Option(None, "--hot-fraction", min=0.0, max=1.0,
                                                 help="Share of each layer's neurons pinned in RAM [0.1]."),
    predictor: Optional[str] = typer.Option(None, "--predictor", help="exact, svd or lowrank [lowrank]."),
    rank: Optional[int] = typer.Option(None, "--rank", min=1, help="Predictor rank, first layer; 2x at the last [32]."),
    recall: Optional[float] = typer.Option(None, "--recall", min=0.5, max=1.0,
                                           help="Recall the predictor threshold aims at [0.99]."),
    threshold_sparsity: Optional[float] = typer.Option(None, "--threshold-sparsity", min=0.0, max=0.99,
                                                       help="SwiGLU models: share of activations cut [0.5]."),
    threshold_on: Optional[str] = typer.Option(None, "--threshold-on",
                                               help="SwiGLU: cut by |silu(gate)| (CATS; exact mode runs it) or by "
                                                    "|silu(gate) x up| (less quality lost; no exact mode) [gate]."),
    layout: Optional[str] = typer.Option(None, "--layout", help="Cold-neuron order on flash: coactivation or "
                                                                "natural [coactivation]."),
    force: bool = typer.Option(False, "--force", help="Replace an existing image."),
):
    """Calibrate a checkpoint layer by layer and write its flash image."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from lsparse.image.compile import CompileOptions, compile_image, load_preset
    settings = load_preset(config) if config else {}
    given = {"calib_tokens": calib_tokens, "bits": bits, "group_size": group_size, "hot_fraction": hot_fraction,
             "predictor": predictor, "rank": rank, "recall": recall, "threshold_sparsity": threshold_sparsity,
             "layout": layout, "threshold_on": threshold_on}
    settings.update({k: v for k, v in given.items() if v is not None})  # the command line wins over a preset
    options = CompileOptions(force=force, **settings)
    if calib:
        options.calib = calib
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=Console(stderr=True), transient=True) as bar:
        task = bar.add_task("calibrating and writing layers", total=None)
        training = bar.add_task("training predictors", total=None, visible=False)

        def on_epoch(layer, done, total):
            bar.update(training, description=f"training the predictor of layer {layer}", completed=done,
                       total=total, visible=done < total)

        manifest = compile_image(source, output, options,
                                 progress=lambda done, total: bar.update(task, completed=done, total=total),
                                 training_progress=on_epoch)
    from lsparse.image.inspect import describe_image, print_image
    print_image(describe_image(output, manifest))


@app.command()
def verify(image: str = typer.Argument(..., help="An image directory.")):
    """Check every file and neuron region of an image against its manifest's checksums."""
    from lsparse.image.format import verify as verify_image
    problems = verify_image(image)
    if problems:
        raise LsparseError(f"{image} is damaged: " + "; ".join(problems))
    typer.echo(f"{image}: every file and neuron region matches its checksum")


@app.command()
def pack(
    image: str = typer.Argument(..., help="An image directory."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="The file to write [IMAGE.lsimg.zst]."),
    level: int = typer.Option(3, "--level", min=1, max=22, help="zstandard level."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Pack an image into one zstandard-compressed file, to ship it."""
    from lsparse.image.pack import SUFFIX
    from lsparse.image.pack import pack as pack_image
    result = pack_image(image, output or image.rstrip("/") + SUFFIX, level)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(f"{result['packed']}: {result['packed_bytes'] / 1e6:.2f} MB "
                   f"({result['packed_bytes'] / result['image_bytes']:.1%} of {result['image_bytes'] / 1e6:.2f} MB)")


@app.command()
def unpack(
    packed: str = typer.Argument(..., help="A file made by lsparse pack."),
    output: str = typer.Option(..., "--output", "-o", help="The image directory to write."),
    force: bool = typer.Option(False, "--force", help="Replace an existing image."),
):
    """Unpack and verify an image packed by lsparse pack."""
    from lsparse.image.pack import unpack as unpack_image
    unpack_image(packed, output, force)
    typer.echo(f"{output}: unpacked, every checksum matches")


@app.command()
def bench(
    image: str = typer.Argument(..., help="A flash image (its ablation variants are compiled from its source), "
                                          "or `kernels`."),
    text: Optional[list[str]] = typer.Option(None, "--text", help="Held-out text (repeatable): prompts come from "
                                                                  "the first, perplexity is measured on each."),
    prompts: int = typer.Option(2, "--prompts", min=1, help="Prompts, each from its own document."),
    prompt_tokens: int = typer.Option(128, "--prompt-tokens", min=1, help="Tokens of each prompt."),
    gen_tokens: int = typer.Option(256, "--gen-tokens", min=1, help="Greedy tokens generated per prompt."),
    quality_tokens: int = typer.Option(4096, "--quality-tokens", min=2, help="Tokens of each text for perplexity."),
    rungs: Optional[str] = typer.Option(None, "--rungs", help="Comma-separated rungs to run (default: all)."),
    budgets: str = typer.Option("0.25,0.5,0.75", "--budgets",
                                help="Shares of the dense model's RAM for the full system's sweep ('' for none)."),
    variants: Optional[str] = typer.Option(None, "--variants", help="Where variant images go [IMAGE.variants]."),
    readers: int = typer.Option(DEFAULT_READERS, "--readers", min=1,
                                help="Reader threads, each with one read in flight."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
    csv: Optional[str] = typer.Option(None, "--csv", help="Also write the rows as CSV here."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Also write a PNG of latency against RAM here."),
):
    """LLM in a Flash's ladder: naive, hybrid, +predictor, +window, +bundles, +hot, +4-bit, exact, dense.
    `lsparse bench kernels`: the sparse FFN step against dense, from 5% to 100% active."""
    from pathlib import Path

    from rich.console import Console
    if image == "kernels":
        from lsparse.bench.kernels import bench_kernels, print_kernels
        err = Console(stderr=True)
        with err.status("timing FFN steps") as status:
            result = bench_kernels(progress=lambda m: status.update(m))
        if as_json:
            typer.echo(json.dumps(result, indent=2))
        else:
            print_kernels(result)
        return

    from lsparse.bench.ladder import BenchOptions, plot_ladder, print_ladder, write_csv
    from lsparse.bench.ladder import bench as run_ladder
    try:
        shares = tuple(float(v) for v in budgets.split(",") if v.strip())
    except ValueError:
        raise LsparseError(f"--budgets must be comma-separated shares, got {budgets!r}") from None
    options = BenchOptions(texts=[Path(t) for t in text or []], prompts=prompts, prompt_tokens=prompt_tokens,
                           gen_tokens=gen_tokens, quality_tokens=quality_tokens, budgets=shares,
                           variants_dir=Path(variants) if variants else None,
                           rungs=[r.strip() for r in rungs.split(",")] if rungs else None, workers=readers)
    err = Console(stderr=True)
    with err.status("benchmarking") as status:
        result = run_ladder(image, options, progress=lambda m: status.update(m))
    if csv:
        write_csv(result, csv)
    if plot:
        plot_ladder(result, plot)
    if as_json:
        typer.echo(json.dumps(result, indent=2))
    else:
        print_ladder(result)


INTERRUPTED = 130


def main():
    try:
        # typer answers Ctrl-C inside a command by returning 130 rather than raising, when not standalone
        status = app(standalone_mode=False)
        if status == INTERRUPTED:
            raise KeyboardInterrupt
    except LsparseError as e:
        if state["debug"]:
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (KeyboardInterrupt, click.exceptions.Abort):
        if state["debug"]:
            raise
        print("interrupted", file=sys.stderr)
        sys.exit(INTERRUPTED)
    except BrokenPipeError:
        sys.exit(1)


if __name__ == "__main__":
    main()
