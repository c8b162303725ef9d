"""`lsparse bench`."""

from __future__ import annotations

from typing import Optional

import typer

from lsparse.cli.app import app, numbers, show
from lsparse.errors import LsparseError
from lsparse.runtime.options import DEFAULT_READERS


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
    budgets: str = typer.Option("0.25,0.5,0.75", "--budgets", help="Shares of the model as stored: the RAM budgets "
                                "(hard caps where root can set them) of the full system's sweep ('' for none)."),
    against: Optional[str] = typer.Option(None, "--against", help="llama.cpp: compare with it under the same "
                                          "caps, on a synthetic image's geometry (synthetic:NAME)."),
    tokens: int = typer.Option(16, "--tokens", min=2, help="--against: tokens each run generates."),
    rounds: int = typer.Option(2, "--rounds", min=1, help="--against: rounds of interleaved runs."),
    llama_python: Optional[str] = typer.Option(None, "--llama-python", help="--against: a Python with "
                                               "llama-cpp-python \\[this one]."),
    layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Synthetic images: fewer layers (tests)."),
    variants: Optional[str] = typer.Option(None, "--variants", help="Where variant images go [IMAGE.variants]."),
    readers: int = typer.Option(DEFAULT_READERS, "--readers", min=1,
                                help="Reader threads, each with one read in flight."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of the table."),
    csv: Optional[str] = typer.Option(None, "--csv", help="Also write the rows as CSV here."),
    plot: Optional[str] = typer.Option(None, "--plot", help="Also write a PNG of latency against RAM here."),
    cache_bias: str = typer.Option("", "--cache-bias", help="Add a +cache-aware rung (DIP: predicted mode, "
                                   "masks favouring cached neurons) for each of these biases, e.g. 0.5,1,2."),
    flock: str = typer.Option("", "--flock", help="Add a +flock core rung (GRIFFIN) per flock share, e.g. 0.7,0.9."),
    max_quality_loss: str = typer.Option("", "--max-quality-loss", help="Add a +gated rung per bound (0.01: 1%): "
                                         "an image compiled with --max-quality-loss."),
    kv_top_k: str = typer.Option("", "--kv-top-k", help="Add a +sparq rung (SparQ) per keys read a step."),
    kv_ram_tokens: str = typer.Option("", "--kv-ram-tokens", help="Add a +sparq flash rung per KV tokens in RAM."),
    quality_window: int = typer.Option(512, "--quality-window", min=16, help="Tokens of each perplexity window."),
    model: bool = typer.Option(False, "--model", help="kernels: the Metal kernels' PREDICTED cost on Apple chips "
                               "(bytes, threadgroups, time floors at each chip's bandwidth), nothing timed."),
):
    """LLM in a Flash's ladder (naive, hybrid, +predictor, ... exact, dense) and the methods' rungs. `lsparse bench
    kernels`: the sparse FFN step against dense, 5% to 100% active; --model: Metal's predicted cost on Apple chips."""
    from pathlib import Path

    from rich.console import Console
    err = Console(stderr=True)
    if against is not None:
        return _against(image, against, numbers(budgets, "--budgets"), tokens, rounds, llama_python, layers,
                        variants, as_json, csv, plot, err)
    if model and image != "kernels":
        raise LsparseError("--model goes with `lsparse bench kernels`")
    if image == "kernels":
        return _kernels(model, llama_python, Path(variants or "out/bench"), as_json, err)

    from lsparse.bench.ladder import BenchOptions
    options = BenchOptions(texts=[Path(t) for t in text or []], prompts=prompts, prompt_tokens=prompt_tokens,
                           gen_tokens=gen_tokens, quality_tokens=quality_tokens, budgets=numbers(budgets, "--budgets"),
                           variants_dir=Path(variants) if variants else None,
                           rungs=[r.strip() for r in rungs.split(",")] if rungs else None, workers=readers,
                           cache_biases=numbers(cache_bias, "--cache-bias"), flock_shares=numbers(flock, "--flock"),
                           quality_bounds=numbers(max_quality_loss, "--max-quality-loss"),
                           kv_top_ks=numbers(kv_top_k, "--kv-top-k"), quality_window=quality_window,
                           kv_ram_tokens=numbers(kv_ram_tokens, "--kv-ram-tokens"))
    _ladder(image, options, as_json, csv, plot, err)


def _ladder(image: str, options, as_json: bool, csv, plot, err):
    """The ladder's rungs on an image, shown and written where asked."""
    from lsparse.bench.ladder import bench as run_ladder
    from lsparse.bench.report import plot_ladder, print_ladder, write_csv
    with err.status("benchmarking") as status:
        result = run_ladder(image, options, progress=lambda m: status.update(m))
    if csv:
        write_csv(result, csv)
    if plot:
        plot_ladder(result, plot)
    show(result, as_json, print_ladder)


def _kernels(model: bool, llama_python, folder, as_json: bool, err):
    """`lsparse bench kernels`: timed here, or (--model) the Metal kernels' predicted cost."""
    if model:
        from lsparse.bench.metal_model import predict, print_model
        return show(predict(), as_json, print_model)
    from lsparse.bench.kernels import bench_kernels, print_kernels
    from lsparse.bench.memory import memory_section
    with err.status("timing FFN steps") as status:
        result = bench_kernels(progress=lambda m: status.update(m))
        result["memory"] = memory_section(llama_python, folder, progress=lambda m: status.update(m))
    return show(result, as_json, print_kernels)


def _against(image, peer, budgets, tokens, rounds, llama_python, layers, variants, as_json, csv, plot, err):
    import sys
    from pathlib import Path

    from lsparse.bench.against import Against, compare, print_summary
    from lsparse.bench.against import plot as plot_against
    from lsparse.bench.against import write_csv as write_against_csv
    from lsparse.bench.rungs import synthetic_base
    from lsparse.errors import LsparseError
    if peer != "llama.cpp":
        raise LsparseError(f"--against {peer}: the peer lsparse compares with is llama.cpp")
    if not image.startswith("synthetic:"):
        raise LsparseError("--against runs on a synthetic image's geometry: synthetic:NAME (llama-2-7b)")
    name = image.split(":", 1)[1]
    folder = Path(variants) if variants else Path("out") / "synthetic" / (name + (f"-{layers}" if layers else ""))
    with err.status("benchmarking against llama.cpp") as status:
        base = synthetic_base(name, folder, lambda m: status.update(m), layers)
        result = compare(Against(base, folder / f"{name}-q4_0.gguf", budgets, tokens, rounds,
                                 llama_python or sys.executable), progress=lambda m: status.update(m))
    if csv:
        write_against_csv(result, csv)
    if plot:
        plot_against(result, plot)
    show(result, as_json, print_summary)
