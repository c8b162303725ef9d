"""`lsparse stats`: how sparse a model's FFN activations are on real text, per layer and overall."""

from __future__ import annotations

import numpy as np

from lsparse.calibrate.activations import HOT_SHARES, average, layer_stats, record_activations, thresholded_ffns
from lsparse.errors import LsparseError
from lsparse.model import load_model
from lsparse.model.perplexity import perplexity
from lsparse.source import resolve
from lsparse.text import limit_tokens, read_documents, token_windows


def compute_stats(spec: str, text: str, tokens: int = 4096, window: int = 512,
                  sparsity_levels: tuple[float, ...] = (0.25, 0.5, 0.7), mask_sparsity: float = 0.5,
                  backend: str | None = None) -> dict:
    if not all(0 <= level < 1 for level in sparsity_levels):
        raise LsparseError(f"--levels are shares of activations to zero, each in [0, 1): got {sparsity_levels}")
    checkpoint = resolve(spec)
    if checkpoint.tokenizer is None:
        raise LsparseError(f"{checkpoint.location}: no tokenizer found")
    model = load_model(checkpoint, backend)
    windows = limit_tokens(token_windows(checkpoint.tokenizer, read_documents(text), window), tokens)
    if not windows:
        raise LsparseError(f"{text}: no text to measure on")
    acts = record_activations(model, windows)
    lengths = [len(w) for w in windows]
    exact_zero = float(np.mean([(a == 0).mean() for a in acts]))
    # A ReLU-family model is sparse by itself; a SwiGLU one only once small magnitudes are cut (CATS, TEAL).
    relu_family = exact_zero > 0.05
    if relu_family:
        masks, mask_rule = [a != 0 for a in acts], "activation is not exactly zero"
    else:
        cuts = [float(np.quantile(np.abs(a), mask_sparsity)) for a in acts]
        masks = [np.abs(a) >= c for a, c in zip(acts, cuts, strict=True)]
        mask_rule = f"|activation| at or above the layer's {mask_sparsity:.0%} quantile"
    layers = [layer_stats(m, lengths) for m in masks]
    dense_ppl = perplexity(model, windows)
    sweep = []
    for level in sparsity_levels:
        thresholds = [float(np.quantile(np.abs(a), level)) for a in acts]
        ppl = perplexity(model, windows, thresholded_ffns(model, thresholds))
        zeroed = float(np.mean([(np.abs(a) < t).mean() for a, t in zip(acts, thresholds, strict=True)]))
        sweep.append({"target_sparsity": level, "zeroed_fraction": zeroed, "perplexity": ppl,
                      "perplexity_ratio": ppl / dense_ppl, "thresholds": thresholds})
    return {"model": checkpoint.location, "text": str(text), "tokens": sum(lengths), "windows": len(windows),
            "d_ff": int(acts[0].shape[1]), "exact_zero_fraction": exact_zero, "mask_rule": mask_rule,
            "dense_perplexity": dense_ppl, "overall": average(layers), "layers": layers,
            "threshold_sweep": sweep}


def print_stats(stats: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 110)  # twelve columns of figures
    console.print(f"[bold]{stats['model']}[/bold] on {stats['text']}: {stats['tokens']} tokens, d_ff "
                  f"{stats['d_ff']}; exact zeros {stats['exact_zero_fraction']:.1%}; a neuron counts as active "
                  f"when its {stats['mask_rule']}")
    table = Table("layer", "active", *(f"U{k}" for k in (1, 2, 4, 8)), "new1", "new4",
                  *(f"hot{s:.0%}" for s in HOT_SHARES), title="activation statistics (% of d_ff)",
                  box=box.SIMPLE, padding=(0, 1),
                  caption="Uk: distinct neurons used by the last k tokens; newk: neurons a token needs that the k "
                          "tokens before it did not; hotN: share of all activations made by the most frequent N "
                          "of neurons")

    def row(name, s):
        table.add_row(name, f"{100 * s['active_fraction']:.1f}",
                      *(f"{100 * s['window_union_fraction'][k]:.1f}" for k in (1, 2, 4, 8)),
                      *(f"{100 * s['new_per_token_fraction'][k]:.1f}" for k in (1, 4)),
                      *(f"{100 * s['hot_coverage'][h]:.1f}" for h in HOT_SHARES))

    for i, s in enumerate(stats["layers"]):
        row(str(i), s)
    row("all", stats["overall"])
    console.print(table)
    sweep = Table("zeroed (target)", "zeroed (measured)", "perplexity", "vs dense",
                  title=f"magnitude thresholds per layer; dense perplexity {stats['dense_perplexity']:.3f}")
    for s in stats["threshold_sweep"]:
        sweep.add_row(f"{s['target_sparsity']:.0%}", f"{s['zeroed_fraction']:.1%}", f"{s['perplexity']:.3f}",
                      f"{s['perplexity_ratio']:.3f}x")
    console.print(sweep)


def plot_window_growth(stats: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    cmap = plt.get_cmap("viridis")
    n = len(stats["layers"])
    for i, s in enumerate(stats["layers"]):
        ks = sorted(int(k) for k in s["window_union_fraction"])
        ax.plot(ks, [100 * s["window_union_fraction"][k] for k in ks], color=cmap(i / max(n - 1, 1)),
                label=f"layer {i}" if n <= 12 or i % max(n // 8, 1) == 0 else None)
    ks = sorted(int(k) for k in stats["overall"]["window_union_fraction"])
    ax.plot(ks, [100 * stats["overall"]["window_union_fraction"][k] for k in ks], "k--", lw=2, label="mean")
    ax.set_xlabel("window k (tokens)")
    ax.set_ylabel("distinct neurons used by the last k tokens (% of d_ff)")
    ax.set_title(f"Window growth: {stats['model'].rsplit('/', 1)[-1]}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
