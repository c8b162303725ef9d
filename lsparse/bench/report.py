"""The ladder's results as a table, CSV and a plot, one row per rung (and per budget of the sweep)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from lsparse.bench.rungs import Rung


def second_half(text: str) -> str:
    """The key of a text's second-half perplexity (its first half a prompt) beside its own in a rung's figures."""
    return f"{text} (2nd half)"


def summary(rung: Rung, result: dict, reference: dict | None) -> dict:
    """One table row: means over prompts."""
    row = {"rung": rung.name, "mode": rung.mode, "window": rung.window, "bundled": rung.bundled,
           "budget_bytes": rung.budget, "note": rung.note,
           "tokens_per_second": float(np.mean(result["generation_tps"])),
           "peak_memory_bytes": result["peak_memory_bytes"], "planned_ram_bytes": result["memory_plan"]["total"],
           # what the plan holds of the model itself: without the process and the KV cache
           "model_ram_bytes": 0 if rung.mode == "naive" else result["memory_plan"]["total"]
           - result["memory_plan"]["process"] - result["memory_plan"]["kv_cache"],
           "perplexity": result["perplexity"]}
    if result["flash"]:
        f = {k: float(np.mean([r[k] for r in result["flash"]])) for k in result["flash"][0]
             if k not in ("direct_io", "gap_rule")}
        row.update({"prompt_bytes": f.get("prompt_bytes_read"), "bytes_per_token": f["bytes_read_per_token"],
                    "bytes_needed_per_token": f["bytes_needed_per_token"],
                    "reads_per_token": f["reads_per_token"], "mean_read_bytes": f["mean_read_bytes"],
                    "effective_gbps": f["bytes_read_per_token"] / (f["read_ms_per_token"] * 1e6)
                    if f["read_ms_per_token"] else None,
                    "io_ms": f["io_ms_per_token"], "read_ms": f["read_ms_per_token"], "mem_ms": f["mem_ms_per_token"],
                    "compute_ms": f["compute_ms_per_token"], "cache_hit_rate": f["cache_hit_rate"],
                    "attention_bytes_per_token": f.get("attention_bytes_per_token"),
                    "attention_full_bytes_per_token": f.get("attention_full_bytes_per_token"),
                    "kv_flash_bytes_per_token": f.get("kv_flash_bytes_per_token"),
                    "kv_flash_reads_per_token": f.get("kv_flash_reads_per_token"),
                    "direct_io": all(r["direct_io"] for r in result["flash"]),
                    "gap_bytes": f["gap_bytes"], "gap_rule": result["flash"][0]["gap_rule"]})
    else:
        row.update({k: None for k in ("prompt_bytes", "bytes_per_token", "bytes_needed_per_token", "reads_per_token",
                                      "mean_read_bytes", "effective_gbps", "io_ms", "read_ms", "mem_ms", "compute_ms",
                                      "cache_hit_rate", "direct_io", "gap_bytes", "gap_rule")})
        row["bytes_per_token"] = 0.0
    if result.get("correction"):  # the share of tokens the dense path corrected, the tokens a dense pass gave
        row["corrected_share"] = float(np.mean([c["corrected_share"] for c in result["correction"]]))
        row["tokens_per_dense_pass"] = float(np.mean([c["tokens_per_round"] for c in result["correction"]]))
    if reference is not None:
        same = [np.mean(np.equal(a, b)) for a, b in zip(result["tokens"], reference["tokens"], strict=True)]
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
                  for a, b in zip(result["tokens"], reference["tokens"], strict=True)]
        row["greedy_agreement"] = float(np.mean(same))
        row["identical_prefix_tokens"] = int(min(prefix))
    return row


def print_ladder(result: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    console = console or Console(width=None if sys.stdout.isatty() else 170)
    texts = result["texts"]
    table = Table(title=f"lsparse bench {result['image']}: {result['prompts']} prompts of "
                        f"{result['prompt_tokens']} tokens, {result['gen_tokens']} generated")
    for col in ("rung", "KB/token", "reads/token", "KB/read", "GB/s", "io ms", "mem ms", "compute ms", "tok/s",
                "peak MB", *[f"ppl {Path(t).stem}" for t in texts], *[f"2nd half {Path(t).stem}" for t in texts],
                "greedy =", "same prefix"):
        table.add_column(col, justify="left" if col == "rung" else "right")

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for row in result["rows"] + [r for r in result["sweep"] if "refused" not in r]:
        table.add_row(row["rung"], fmt(row["bytes_per_token"] / 1e3, ".1f"), fmt(row["reads_per_token"], ".1f"),
                      fmt(row["mean_read_bytes"] and row["mean_read_bytes"] / 1e3, ".1f"),
                      fmt(row["effective_gbps"], ".2f"), fmt(row["io_ms"], ".2f"), fmt(row["mem_ms"], ".2f"),
                      fmt(row["compute_ms"], ".2f"), fmt(row["tokens_per_second"], ".1f"),
                      fmt(row["peak_memory_bytes"] / 1e6, ".0f"),
                      *[fmt(row["perplexity"].get(t), ".3f") for t in texts],
                      *[fmt(row["perplexity"].get(second_half(t)), ".3f") for t in texts],
                      fmt(row.get("greedy_agreement"), ".1%"), fmt(row.get("identical_prefix_tokens"), "d"))
    console.print(table)
    for r in result["sweep"]:
        if "refused" in r:
            console.print(f"{r['rung']}: refused ({r['refused']})")
        elif r.get("cgroup"):
            c = r["cgroup"]
            hit = "yes" if c["cap_hit"] else "no"
            console.print(f"{r['rung']}: under a hard cgroup cap of {c['cap_bytes'] / 1e6:.0f} MB, peak "
                          f"{c['peak_bytes'] / 1e6:.0f} MB (page cache included), cap hit: {hit}")
    if result.get("synthetic"):
        console.print(f"Synthetic image: {result['synthetic']['note']}")
    q = result["predictor_quality"]
    if q:
        console.print("Predictor, held out at compile time (mean over layers): "
                      + ", ".join(f"{k} {v:.3f}" for k, v in q.items()))


CSV_COLUMNS = ("rung", "mode", "window", "bundled", "budget_bytes", "prompt_bytes", "bytes_per_token",
               "bytes_needed_per_token",
               "reads_per_token", "mean_read_bytes", "effective_gbps", "io_ms", "read_ms", "mem_ms", "compute_ms",
               "tokens_per_second", "peak_memory_bytes", "planned_ram_bytes", "model_ram_bytes", "cache_hit_rate",
               "gap_bytes",
               "greedy_agreement", "identical_prefix_tokens", "corrected_share", "tokens_per_dense_pass",
               "attention_bytes_per_token", "attention_full_bytes_per_token", "kv_flash_bytes_per_token",
               "kv_flash_reads_per_token")


def write_csv(result: dict, path) -> None:
    import csv
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        texts = [*result["texts"], *[second_half(t) for t in result["texts"]]]
        w.writerow([*CSV_COLUMNS, *[f"perplexity:{t}" for t in texts]])
        for row in result["rows"] + [r for r in result["sweep"] if "refused" not in r]:
            w.writerow([row.get(c) for c in CSV_COLUMNS] + [row["perplexity"].get(t) for t in texts])


def plot_ladder(result: dict, path) -> None:
    """Latency per token against each configuration's measured peak memory, as a share of the model as stored
    (LLM in a Flash, Figure 7). Naive computes from RAM copies: its point overstates its memory."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] + result["sweep"] if "refused" not in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        x = r["peak_memory_bytes"] / result["model_bytes"]
        ax.scatter(x, 1e3 / r["tokens_per_second"], label=r["rung"])
    save_plot(fig, ax, "peak memory, share of the model as stored", "ms per token",
              f"{Path(result['image']).name}: latency against RAM", path)


def save_plot(fig, ax, xlabel: str, ylabel: str, title: str, path) -> None:
    """A bench plot's axes (the y one logarithmic), legend and file."""
    import matplotlib.pyplot as plt
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


