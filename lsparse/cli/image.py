"""`lsparse compile`, `inspect`, `verify`, `pack`, `unpack` and `stats`: making and reading images."""

from __future__ import annotations

import json
from typing import Optional

import typer

from lsparse.cli.app import app, numbers
from lsparse.cli.app import show as show_result
from lsparse.errors import LsparseError


@app.command()
def inspect(
    model: str = typer.Argument(..., help="An image, or a checkpoint (builtin:NAME, folder, repo id, GGUF, "
                                          "llama2.c file)."),
    revision: Optional[str] = typer.Option(None, "--revision", help="Hub revision."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Describe an image (components, sparsity, hot set, predictors, layout) or a checkpoint."""
    from lsparse.image.image import is_image
    if is_image(model):
        from lsparse.image.inspect import describe_image, print_image
        summary = describe_image(model)
        show = print_image
    else:
        from lsparse.model.summary import describe, print_summary
        from lsparse.source import resolve
        summary, show = describe(resolve(model, revision)), print_summary
    show_result(summary, as_json, show)


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
    result = compute_stats(model, text, tokens, window, numbers(levels, "--levels"), mask_sparsity, backend)
    if plot:
        plot_window_growth(result, plot)
    show_result(result, as_json, print_stats)


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
    hot_bits: Optional[int] = typer.Option(None, "--hot-bits", help="A precision tier: hot neurons at 8 or 16 bits."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="Quantization group: 32, 64, 128 [64]."),
    hot_fraction: Optional[float] = typer.Option(None, "--hot-fraction", min=0.0, max=1.0,
                                                 help="Share of each layer's neurons pinned in RAM [0.1]."),
    predictor: Optional[str] = typer.Option(None, "--predictor", help="exact, svd or lowrank \\[lowrank]."),
    rank: Optional[int] = typer.Option(None, "--rank", min=1, help="Predictor rank, first layer; 2x at the last [32]."),
    recall: Optional[float] = typer.Option(None, "--recall", min=0.5, max=1.0,
                                           help="Recall the predictor threshold aims at [0.99]."),
    threshold_sparsity: Optional[float] = typer.Option(None, "--threshold-sparsity", min=0.0, max=0.99,
                                                       help="SwiGLU models: share of activations cut [0.5]."),
    threshold_on: Optional[str] = typer.Option(None, "--threshold-on",
                                               help="SwiGLU: cut by |silu(gate)| (CATS; exact mode runs it) or by "
                                                    "|silu(gate) x up| (less quality lost; no exact mode) \\[gate]."),
    layout: Optional[str] = typer.Option(None, "--layout", help="Cold-neuron order on flash: coactivation or "
                                                                "natural \\[coactivation]."),
    resident_bits: Optional[int] = typer.Option(None, "--resident-bits", help="Attention and embedding matrices: "
                                                "16 (fp16), 8 or 4 (rows in groups, like the bundles) [16]."),
    residency: Optional[str] = typer.Option(None, "--residency", help="Hot neurons by activation frequency or by "
                                            "Wanda's score |W| ||x|| (wanda) \\[frequency]."),
    max_quality_loss: Optional[str] = typer.Option(None, "--max-quality-loss", help="Choose the predictor's "
                                                   "thresholds to keep predicted mode's perplexity on held-out "
                                                   "calibration text within this of dense's (1%, 0.01)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing lsparse image (never any other folder)."),
):
    """Calibrate a checkpoint layer by layer and write its flash image."""
    from lsparse.image.compile import CompileOptions, load_preset
    from lsparse.sizes import parse_share
    settings = load_preset(config) if config else {}
    given = {"calib_tokens": calib_tokens, "bits": bits, "hot_bits": hot_bits, "group_size": group_size,
             "hot_fraction": hot_fraction,
             "predictor": predictor, "rank": rank, "recall": recall, "threshold_sparsity": threshold_sparsity,
             "layout": layout, "threshold_on": threshold_on, "resident_bits": resident_bits, "residency": residency,
             "max_quality_loss": None if max_quality_loss is None else parse_share(max_quality_loss,
                                                                                   "--max-quality-loss")}
    settings.update({k: v for k, v in given.items() if v is not None})  # the command line wins over a preset
    options = CompileOptions(force=force, **settings)
    if calib:
        options.calib = calib
    manifest = _compile_with_progress(source, output, options)
    from lsparse.image.inspect import describe_image, print_image
    print_image(describe_image(output, manifest))


def _compile_with_progress(source: str, output: str, options):
    """compile_image with a progress bar on the terminal (layers written; each predictor's epochs)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from lsparse.image.compile import compile_image
    from lsparse.runtime.gate import gate_thresholds
    err = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TimeElapsedColumn(), console=err, transient=True, disable=not err.is_terminal) as bar:
        task = bar.add_task("calibrating and writing layers", total=None)
        training = bar.add_task("training predictors", total=None, visible=False)

        def on_epoch(layer, done, total):
            bar.update(training, description=f"training the predictor of layer {layer}", completed=done,
                       total=total, visible=done < total)

        def gate(*args):
            bar.update(task, description="choosing thresholds for the quality bound (decoding held-out text)")
            return gate_thresholds(*args)

        return compile_image(source, output, options,
                             progress=lambda done, total: bar.update(task, completed=done, total=total),
                             training_progress=on_epoch, gate=gate)


@app.command()
def verify(image: str = typer.Argument(..., help="An image directory.")):
    """Check every file and neuron region of an image against its manifest's checksums."""
    from lsparse.image.image import Image
    problems = Image.open(image).verify()
    if problems:
        raise LsparseError(f"{image} is damaged: " + "; ".join(problems))
    typer.echo(f"{image}: every file and neuron region matches its checksum")


@app.command()
def pack(
    image: str = typer.Argument(..., help="An image directory."),
    output: Optional[str] = typer.Option(None, "--output", "-o", help="The file to write [IMAGE.lsimg.zst]."),
    level: int = typer.Option(3, "--level", min=1, max=22, help="zstandard level."),
    force: bool = typer.Option(False, "--force", help="Replace an existing pack (never any other file)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
):
    """Pack an image into one zstandard-compressed file, to ship it."""
    from lsparse.image.pack import SUFFIX
    from lsparse.image.pack import pack as pack_image
    result = pack_image(image, output or image.rstrip("/") + SUFFIX, level, force)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(f"{result['packed']}: {result['packed_bytes'] / 1e6:.2f} MB "
                   f"({result['packed_bytes'] / result['image_bytes']:.1%} of {result['image_bytes'] / 1e6:.2f} MB)")


@app.command()
def unpack(
    packed: str = typer.Argument(..., help="A file made by lsparse pack."),
    output: str = typer.Option(..., "--output", "-o", help="The image directory to write."),
    force: bool = typer.Option(False, "--force", help="Replace an existing lsparse image (never any other folder)."),
):
    """Unpack and verify an image packed by lsparse pack."""
    from lsparse.image.pack import unpack as unpack_image
    unpack_image(packed, output, force)
    typer.echo(f"{output}: unpacked, every checksum matches")
