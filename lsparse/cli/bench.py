"""`lsparse bench`."""

from __future__ import annotations

from typing import Optional

import typer

from lsparse.cli.app import app, numbers, show
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
    err = Console(stderr=True)
    if image == "kernels":
        from lsparse.bench.kernels import bench_kernels, print_kernels
        with err.status("timing FFN steps") as status:
            result = bench_kernels(progress=lambda m: status.update(m))
        return show(result, as_json, print_kernels)

    from lsparse.bench.ladder import BenchOptions
    from lsparse.bench.ladder import bench as run_ladder
    from lsparse.bench.report import plot_ladder, print_ladder, write_csv
    options = BenchOptions(texts=[Path(t) for t in text or []], prompts=prompts, prompt_tokens=prompt_tokens,
                           gen_tokens=gen_tokens, quality_tokens=quality_tokens, budgets=numbers(budgets, "--budgets"),
                           variants_dir=Path(variants) if variants else None,
                           rungs=[r.strip() for r in rungs.split(",")] if rungs else None, workers=readers)
    with err.status("benchmarking") as status:
        result = run_ladder(image, options, progress=lambda m: status.update(m))
    if csv:
        write_csv(result, csv)
    if plot:
        plot_ladder(result, plot)
    show(result, as_json, print_ladder)
