"""`lsparse bench IMAGE`: LLM in a Flash's ladder of configurations, run side by side on the same prompts,
each with its cost per token and its quality against dense.

Each rung adds one idea to the one before: naive (every byte of the model read each token), hybrid (all but
the FFN resident, the whole FFN read each token), + predictor, + window, + bundles and co-activation layout,
+ hot neurons, + 4-bit, + packed cache, + lookahead; exact mode and dense with everything in RAM close the
table. Rungs that need another image (fp16, natural order, no hot neurons) get it by compiling the image's
source again with its recorded options and one change, once, into a variants folder. Each rung runs in a
process of its own, so that its peak memory is its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from lsparse.errors import LsparseError
from lsparse.runtime.reader import DEFAULT_READERS

# Image variants as changes to the compile options recorded in the image; None: the image itself.
VARIANTS = {
    "fp16-natural": {"bits": 16, "hot_fraction": 0.0, "layout": "natural"},
    "fp16-layout": {"bits": 16, "hot_fraction": 0.0, "layout": "coactivation"},
    "fp16-hot": {"bits": 16, "layout": "coactivation"},
    "4bit-hot": {"bits": 4, "layout": "coactivation"},
}


@dataclass
class Rung:
    name: str
    variant: str
    mode: str               # naive, hybrid, predicted, exact, dense
    window: int = 5
    bundled: bool = True
    gap_bytes: int | None = None  # None: the reader's default gap rule
    budget: int | None = None     # bytes; None: unlimited
    lookahead: bool = False
    kernels: str = "auto"         # the FFN backend (lsparse/kernels/backends.py); mlx: cache kept 4-bit
    note: str = ""


LADDER = [
    Rung("naive", "fp16-natural", "naive", note="every byte of the image read each token; computed from RAM"),
    Rung("hybrid", "fp16-natural", "hybrid", note="all but the FFN resident; the whole FFN read each token"),
    Rung("+predictor", "fp16-natural", "predicted", window=1, bundled=False, gap_bytes=0,
         note="only predicted neurons read; rows read apart, no reuse"),
    Rung("+window", "fp16-natural", "predicted", window=5, bundled=False, gap_bytes=0,
         note="neurons of the last 5 tokens kept"),
    Rung("+bundles+layout", "fp16-layout", "predicted", note="row-column bundles, co-activation order, gap rule"),
    Rung("+hot", "fp16-hot", "predicted", note="hot neurons pinned in RAM"),
    Rung("+4-bit", "4bit-hot", "predicted", note="4-bit bundles: the full system"),
    Rung("+packed cache", "4bit-hot", "predicted", kernels="mlx",
         note="cached neurons kept 4-bit, multiplied by MLX's quantized kernel"),
    Rung("+lookahead", "4bit-hot", "predicted", lookahead=True, note="the next layer read while this one runs"),
    Rung("exact 4-bit", "4bit-hot", "exact", note="gate resident: lossless against dense 4-bit"),
    Rung("dense 4-bit", "4bit-hot", "dense", note="every weight in RAM"),
    Rung("dense fp16", "fp16-natural", "dense", note="every weight in RAM: the reference"),
]


@dataclass
class BenchOptions:
    texts: list = field(default_factory=list)   # held-out text files: prompts come from the first
    prompts: int = 2
    prompt_tokens: int = 128
    gen_tokens: int = 256
    quality_tokens: int = 4096
    variants_dir: Path | None = None
    rungs: list | None = None                    # names; None: all
    budgets: tuple = (0.25, 0.5, 0.75)           # shares of the dense model for the latency-memory sweep
    workers: int = DEFAULT_READERS
    synthetic: bool = False                      # set by bench() for synthetic images


def variant_images(image: Path, needed: set[str], folder: Path, progress=print) -> dict[str, Path]:
    """The image for each variant, compiled from the image's source when its options differ."""
    from lsparse.image.compile import CompileOptions, compile_image
    from lsparse.image.format import load_manifest
    meta = load_manifest(image)
    recorded = meta.get("options")
    if recorded is None:
        raise LsparseError(f"{image} does not record its compile options (compiled by an older lsparse): "
                           "compile it again to bench it")
    synthetic = meta["source"].startswith("synthetic:")
    base = {**recorded} if synthetic else {**recorded, "calib": Path(meta["calibration"]["text"])}
    if base.get("predictor") == "exact":
        base["predictor"] = "lowrank"  # the predicted rungs need a predictor
    images = {}
    for name in sorted(needed):
        options = {**base, **VARIANTS[name]}
        if all(recorded.get(k) == v for k, v in options.items() if k != "calib"):
            images[name] = image
            continue
        out = folder / name
        if (out / "manifest.json").exists() and load_manifest(out).get("source") == meta["source"] \
                and load_manifest(out).get("options") == {k: options[k] for k in recorded}:
            images[name] = out
            continue
        if synthetic:
            from lsparse.bench.synthetic import write_synthetic
            progress(f"writing the {name} variant of {meta['source']} into {out}")
            write_synthetic(meta["synthetic"]["name"], out, shared=folder / ".neurons",
                            progress=progress, **{k: options[k] for k in recorded})
        else:
            progress(f"compiling the {name} variant of {meta['source']} into {out}")
            compile_image(meta["source"], str(out), CompileOptions(force=True, **options))
        images[name] = out
    return images


def prompt_and_quality_windows(tokenizer, options: BenchOptions) -> tuple[list[list[int]], dict]:
    """Prompts of `prompt_tokens` from the first text's documents, and per text the windows perplexity
    is measured on."""
    from lsparse.bench.quality import limit_tokens, read_documents, token_windows
    if not options.texts:
        raise LsparseError("bench needs held-out text: pass --text FILE (for example TinyStories validation)")
    docs = read_documents(options.texts[0])
    if options.synthetic:  # prompts only steer the trace's clock: no quality is measured
        return [tokenizer.encode(docs[0])[: options.prompt_tokens]] * options.prompts, {}
    prompts = [ids[: options.prompt_tokens] for ids in (tokenizer.encode(d) for d in docs)
               if len(ids) >= options.prompt_tokens][: options.prompts]
    if len(prompts) < options.prompts:
        raise LsparseError(f"{options.texts[0]}: fewer than {options.prompts} documents of "
                           f"{options.prompt_tokens} tokens for prompts")
    windows = {str(t): limit_tokens(token_windows(tokenizer, read_documents(t), 512), options.quality_tokens)
               for t in options.texts}
    return prompts, windows


def run_rung(spec: dict) -> dict:
    """One rung, in this process: greedy generation from each prompt, its costs, and (when asked) perplexity."""
    from lsparse.bench.quality import perplexity
    from lsparse.runtime.generate import GenerationStats, generate, peak_rss_bytes
    from lsparse.runtime.image_model import load_image
    from lsparse.runtime.run import flash_report
    from lsparse.runtime.sampling import make_sampler

    rung = Rung(**spec["rung"])
    kwargs = {"window": rung.window, "bundled": rung.bundled, "workers": spec["workers"],
              "tokens": spec["context"], "ram_budget": rung.budget, "lookahead": rung.lookahead,
              "kernels": rung.kernels}
    if rung.gap_bytes is not None:
        kwargs["gap_bytes"] = rung.gap_bytes
    mode = "dense" if rung.mode == "naive" else rung.mode
    model, tokenizer = load_image(spec["image"], mode, **kwargs)
    if rung.mode == "naive":
        model = NaiveModel(model, Path(spec["image"]), spec["workers"])
    result = {"tokens": [], "prompt_tps": [], "generation_tps": [], "flash": []}
    for prompt in spec["prompts"]:
        model.costs.steps.clear()
        stats = GenerationStats()
        result["tokens"].append(list(generate(model, prompt, spec["gen_tokens"], make_sampler(), set(), stats)))
        result["generation_tps"].append(stats.generation_tps)
        if model.reader is not None:
            result["flash"].append(flash_report(model))
    result["peak_memory_bytes"] = peak_rss_bytes()
    result["memory_plan"] = {k: v for k, v in model.memory_plan.items() if k != "cache_slots"}
    quality_model = model.dense if rung.mode == "naive" else model  # the same arithmetic, without the reads
    result["perplexity"] = {name: perplexity(quality_model, w) for name, w in spec["quality"].items()}
    model.close()
    return result


class NaiveModel:
    """The naive baseline: before each token, every file of the image is read from flash (timed and
    counted); the arithmetic then uses the copy already in RAM, so only the reading is emulated."""

    def __init__(self, dense, image: Path, workers: int):
        from lsparse.runtime.image_model import HYBRID_READ_BYTES
        from lsparse.runtime.reader import FlashReader
        self.dense, self.costs, self.memory_plan = dense, dense.costs, dense.memory_plan
        self.xp, self.make_cache, self.context_length = dense.xp, dense.make_cache, dense.context_length
        files = [p for p in sorted(image.rglob("*")) if p.is_file() and p.name != "manifest.json"]
        self.readers = [FlashReader(p, workers=workers) for p in files]
        self.spans = [[(at, min(HYBRID_READ_BYTES, r.size - at)) for at in range(0, r.size, HYBRID_READ_BYTES)]
                      for r in self.readers]
        self.reader = self.readers[0]
        self.dense_ffn_bytes = dense.dense_ffn_bytes
        self.gap = {"bytes": 0, "rule": "whole files"}

    def __call__(self, tokens, cache):
        out = []
        for t in tokens:
            self.costs.start()
            cost = self.costs.steps[-1]
            for reader, spans in zip(self.readers, self.spans, strict=True):
                _, transferred, io = reader.read(spans)
                cost.bytes_read += transferred
                cost.bytes_needed += sum(n for _, n in spans)
                cost.requests += len(spans)
                cost.io_s += io
                cost.read_s += io
            out.append(self.dense.model([t], cache, self.dense.ffns))
        return np.concatenate(out)

    def close(self):
        for r in self.readers:
            r.close()
        self.dense.close()


def _summary(rung: Rung, result: dict, reference: dict | None) -> dict:
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
        row.update({"bytes_per_token": f["bytes_read_per_token"], "bytes_needed_per_token": f["bytes_needed_per_token"],
                    "reads_per_token": f["reads_per_token"], "mean_read_bytes": f["mean_read_bytes"],
                    "effective_gbps": f["bytes_read_per_token"] / (f["read_ms_per_token"] * 1e6)
                    if f["read_ms_per_token"] else None,
                    "io_ms": f["io_ms_per_token"], "read_ms": f["read_ms_per_token"], "mem_ms": f["mem_ms_per_token"],
                    "compute_ms": f["compute_ms_per_token"], "cache_hit_rate": f["cache_hit_rate"],
                    "direct_io": all(r["direct_io"] for r in result["flash"]),
                    "gap_bytes": f["gap_bytes"], "gap_rule": result["flash"][0]["gap_rule"]})
    else:
        row.update({k: None for k in ("bytes_per_token", "bytes_needed_per_token", "reads_per_token",
                                      "mean_read_bytes", "effective_gbps", "io_ms", "read_ms", "mem_ms", "compute_ms",
                                      "cache_hit_rate", "direct_io", "gap_bytes", "gap_rule")})
        row["bytes_per_token"] = 0.0
    if reference is not None:
        same = [np.mean(np.equal(a, b)) for a, b in zip(result["tokens"], reference["tokens"], strict=True)]
        prefix = [next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
                  for a, b in zip(result["tokens"], reference["tokens"], strict=True)]
        row["greedy_agreement"] = float(np.mean(same))
        row["identical_prefix_tokens"] = int(min(prefix))
    return row


def bench(image, options: BenchOptions, progress=print) -> dict:
    """Every rung on the same prompts; returns {"rows": [...], "sweep": [...], "image": ..., ...}."""
    from lsparse.image.format import check_for_run, load_manifest
    from lsparse.runtime.budget import plan
    from lsparse.source.tokenizer import from_folder
    if str(image).startswith("synthetic:"):
        image = _synthetic_base(str(image).split(":", 1)[1], options, progress)
    image = Path(image)
    meta = load_manifest(image)
    check_for_run(image, meta)
    options.synthetic = meta["source"].startswith("synthetic:")
    ladder = [r for r in LADDER if not options.synthetic or r.name in SYNTHETIC_RUNGS]
    rungs = [r for r in ladder if options.rungs is None or r.name in options.rungs]
    if options.rungs is not None and len(rungs) != len(options.rungs):
        unknown = sorted(set(options.rungs) - {r.name for r in ladder})
        raise LsparseError(f"unknown rung(s) {', '.join(unknown)} (known here: {', '.join(r.name for r in ladder)})")
    if options.synthetic and not options.texts:
        from lsparse.image.compile import DEFAULT_CALIBRATION
        options.texts = [DEFAULT_CALIBRATION]
    folder = options.variants_dir or image.parent / f"{image.name}.variants"
    images = variant_images(image, {r.variant for r in rungs}, folder, progress)
    prompts, windows = prompt_and_quality_windows(from_folder(image, meta["config"]), options)
    context = options.prompt_tokens + options.gen_tokens
    if context > meta["config"].get("max_position_embeddings", context):
        raise LsparseError(f"{options.prompt_tokens} prompt + {options.gen_tokens} generated tokens exceed the "
                           f"model's context of {meta['config']['max_position_embeddings']}")

    results, quality_done = {}, {}
    for rung in rungs:
        progress(f"rung {rung.name}")
        # the same arithmetic gives the same perplexity: measure it once per image and compute path
        key = (rung.variant, "dense" if rung.mode in ("naive", "dense") else rung.mode)
        spec = {"rung": asdict(rung), "image": str(images[rung.variant]), "prompts": prompts,
                "gen_tokens": options.gen_tokens, "workers": options.workers, "context": context,
                "quality": {} if key in quality_done else windows}
        results[rung.name] = _in_subprocess(spec)
        if key in quality_done:
            results[rung.name]["perplexity"] = quality_done[key]
        quality_done[key] = results[rung.name]["perplexity"]

    def reference_for(rung):
        bits = "4bit" if rung.variant.startswith("4bit") else "fp16"
        name = f"dense {'4-bit' if bits == '4bit' else 'fp16'}"
        return results.get(name)

    rows = [_summary(r, results[r.name], reference_for(r)) for r in rungs]
    sweep = []
    full = next((r for r in rungs if r.name == "+4-bit"), None)
    # the dense model's RAM, planned rather than run: a 7B dense step would not fit here
    dense = plan(meta, "dense", context, None)
    dense_model = dense["total"] - dense["process"] - dense["kv_cache"]
    if full is not None and options.budgets:
        for share in options.budgets:
            budget = dense["total"] - dense_model + int(share * dense_model)
            rung = Rung(f"+4-bit at {share:.0%}", full.variant, full.mode, budget=budget)
            progress(f"rung {rung.name} of the dense model's RAM")
            spec = {"rung": asdict(rung), "image": str(images[full.variant]), "prompts": prompts[:1],
                    "gen_tokens": options.gen_tokens, "workers": options.workers, "context": context, "quality": {}}
            try:  # under a hard cap equal to the budget, where this machine can set one
                result = _in_subprocess(spec, cap=budget if can_cap() else None)
            except LsparseError as e:
                sweep.append({"rung": rung.name, "budget_bytes": budget, "refused": str(e)})
                continue
            row = _summary(rung, result, None)
            row["cgroup"] = result["cgroup"]
            row["perplexity"] = quality_done.get((full.variant, full.mode), {})
            sweep.append(row)
    return {"image": str(image), "source": meta["source"], "synthetic": meta.get("synthetic"),
            "dense_model_ram_bytes": dense_model, "prompts": len(prompts),
            "prompt_tokens": options.prompt_tokens, "gen_tokens": options.gen_tokens,
            "texts": [] if options.synthetic else [str(t) for t in options.texts],
            "quality_tokens": options.quality_tokens,
            "predictor_quality": {} if options.synthetic else
            predictor_quality(load_manifest(images.get("4bit-hot", image))),
            "rows": rows, "sweep": sweep}


SYNTHETIC_RUNGS = ("hybrid", "+predictor", "+window", "+bundles+layout", "+hot", "+4-bit", "+packed cache")


def _synthetic_base(name: str, options: BenchOptions, progress) -> Path:
    """The full-system variant of a synthetic model, written once into the variants folder."""
    from lsparse.bench.synthetic import write_synthetic
    from lsparse.image.format import load_manifest
    folder = options.variants_dir or Path("out") / "synthetic" / name
    out = folder / "4bit-hot"
    if not (out / "manifest.json").exists() or load_manifest(out)["options"]["layout"] != "coactivation":
        progress(f"writing synthetic:{name} into {out}")
        write_synthetic(name, out, bits=4, shared=folder / ".neurons", progress=progress)
    options.variants_dir = folder
    return out


def predictor_quality(meta: dict) -> dict:
    """The compile-time, held-out predictor figures, averaged over layers."""
    q = [layer["predictor"]["quality"] for layer in meta["layers"]]
    return {k: float(np.mean([x[k] for x in q])) for k in q[0] if isinstance(q[0][k], (int, float))}


MEMCAP = Path(__file__).resolve().parents[2] / "scripts" / "memcap.py"


def can_cap() -> bool:
    """Whether a hard memory cap can be set here: root, and the cgroup v1 memory controller."""
    import os
    return MEMCAP.exists() and os.geteuid() == 0 and Path("/sys/fs/cgroup/memory").is_dir()


def _in_subprocess(spec: dict, cap: int | None = None) -> dict:
    """A rung in a child process; with `cap`, under a hard cgroup memory cap of that many bytes (the page cache
    counts), whose peak and failures are returned under "cgroup"."""
    command = [sys.executable, "-m", "lsparse.bench.ladder"]
    if cap is not None:
        command = [sys.executable, str(MEMCAP), str(cap), "--", *command]
    done = subprocess.run(command, input=json.dumps(spec), capture_output=True, text=True)
    lines = (done.stderr.strip() or "no output").splitlines()
    report = json.loads(lines.pop()) if cap is not None and lines and lines[-1].startswith("{") else None
    if done.returncode != 0:
        why = "killed at its memory cap" if report and report["oom_killed"] else (lines[-1] if lines else "failed")
        raise LsparseError(f"rung {spec['rung']['name']} failed: {why}")
    result = json.loads(done.stdout)
    result["cgroup"] = report
    return result


def print_ladder(result: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    console = console or Console(width=None if sys.stdout.isatty() else 170)
    texts = result["texts"]
    table = Table(title=f"lsparse bench {result['image']}: {result['prompts']} prompts of "
                        f"{result['prompt_tokens']} tokens, {result['gen_tokens']} generated")
    for col in ("rung", "KB/token", "reads/token", "KB/read", "GB/s", "io ms", "mem ms", "compute ms", "tok/s",
                "peak MB", *[f"ppl {Path(t).stem}" for t in texts], "greedy =", "same prefix"):
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


CSV_COLUMNS = ("rung", "mode", "window", "bundled", "budget_bytes", "bytes_per_token", "bytes_needed_per_token",
               "reads_per_token", "mean_read_bytes", "effective_gbps", "io_ms", "read_ms", "mem_ms", "compute_ms",
               "tokens_per_second", "peak_memory_bytes", "planned_ram_bytes", "model_ram_bytes", "cache_hit_rate",
               "gap_bytes",
               "greedy_agreement", "identical_prefix_tokens")


def write_csv(result: dict, path) -> None:
    import csv
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow([*CSV_COLUMNS, *[f"perplexity:{t}" for t in result["texts"]]])
        for row in result["rows"] + [r for r in result["sweep"] if "refused" not in r]:
            w.writerow([row.get(c) for c in CSV_COLUMNS] + [row["perplexity"].get(t) for t in result["texts"]])


def plot_ladder(result: dict, path) -> None:
    """Latency per token against each configuration's measured peak memory, as a share of the dense model's
    planned RAM (LLM in a Flash, Figure 7). Naive computes from RAM copies: its point overstates its memory."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = [r for r in result["rows"] + result["sweep"] if "refused" not in r]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        x = r["peak_memory_bytes"] / result["dense_model_ram_bytes"]
        ax.scatter(x, 1e3 / r["tokens_per_second"], label=r["rung"])
    ax.set_xlabel("peak memory, share of the dense model's RAM (fp32 rows)")
    ax.set_ylabel("ms per token")
    ax.set_yscale("log")
    ax.set_title(f"{Path(result['image']).name}: latency against RAM")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    try:
        out = run_rung(json.loads(sys.stdin.read()))
    except LsparseError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(out))
