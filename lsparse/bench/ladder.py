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

from dataclasses import asdict, dataclass, field
from pathlib import Path

from lsparse.bench.report import summary
from lsparse.bench.rungs import LADDER, SYNTHETIC_RUNGS, Rung, gated_rung, synthetic_base, variant_images
from lsparse.bench.worker import can_cap, in_subprocess
from lsparse.errors import LsparseError
from lsparse.image.image import Image
from lsparse.model import architecture
from lsparse.runtime.load import plan_image
from lsparse.runtime.options import DEFAULT_READERS


@dataclass
class BenchOptions:
    texts: list = field(default_factory=list)   # held-out text files: prompts come from the first
    prompts: int = 2
    prompt_tokens: int = 128
    gen_tokens: int = 256
    quality_tokens: int = 4096
    variants_dir: Path | None = None
    rungs: list | None = None                    # names; None: all
    budgets: tuple = (0.25, 0.5, 0.75)           # shares of the model as stored for the latency-memory sweep
    cache_biases: tuple = ()                     # a +cache-aware rung for each (DIP's knob: bytes against quality)
    flock_shares: tuple = ()                     # a +flock core rung for each (GRIFFIN's knob: the flock's size)
    quality_bounds: tuple = ()                   # a +gated rung for each: an image compiled with that bound
    kv_top_ks: tuple = ()                        # a +sparq rung for each (SparQ's k)
    kv_ram_tokens: tuple = ()                    # a +sparq flash rung for each (tokens a layer holds in RAM)
    quality_window: int = 512                    # tokens of each perplexity window (long context: SparQ)
    workers: int = DEFAULT_READERS
    synthetic: bool = False                      # set by bench() for synthetic images


def prompt_and_quality_windows(tokenizer, options: BenchOptions) -> tuple[list[list[int]], dict]:
    """Prompts of `prompt_tokens` from the first text's documents, and per text the windows perplexity
    is measured on."""
    from lsparse.text import limit_tokens, read_documents, token_windows
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
    windows = {str(t): limit_tokens(token_windows(tokenizer, read_documents(t), options.quality_window),
                                    options.quality_tokens)
               for t in options.texts}
    return prompts, windows


def _check_rungs(options: BenchOptions, synthetic: bool) -> list[Rung]:
    ladder = [r for r in LADDER if not synthetic or r.name in SYNTHETIC_RUNGS]
    rungs = [r for r in ladder if options.rungs is None or r.name in options.rungs]
    if options.rungs is not None and len(rungs) != len(options.rungs):
        unknown = sorted(set(options.rungs) - {r.name for r in ladder})
        raise LsparseError(f"unknown rung(s) {', '.join(unknown)} (known here: {', '.join(r.name for r in ladder)})")
    if (options.cache_biases or options.flock_shares or options.quality_bounds or options.kv_top_ks
            or options.kv_ram_tokens) and synthetic:
        raise LsparseError("--cache-bias, --flock, --max-quality-loss, --kv-top-k and --kv-ram-tokens need a real "
                           "model's activations: a synthetic image replays its masks")
    if not all(0 < b < 10 for b in options.quality_bounds):
        raise LsparseError("--max-quality-loss takes shares above 0 (0.01 is 1%)")
    added = [Rung(f"+cache-aware {bias:g}", "4bit-hot", "predicted", cache_bias=bias,
             note=f"masks favour cached neurons by {bias:g} (DIP)") for bias in options.cache_biases] \
        + [Rung(f"+flock core {share:g}", "4bit-hot", "predicted", flock=share, flock_rule="core",
                note=f"every neuron of a flock of {share:.0%} (GRIFFIN)") for share in options.flock_shares]
    added += [gated_rung(bound) for bound in options.quality_bounds]
    added += [Rung(f"+sparq {int(k)}", "4bit-hot", "predicted", kv_top_k=int(k),
                   note=f"SparQ attention, {int(k)} keys a step") for k in options.kv_top_ks]
    k = int(options.kv_top_ks[0]) if options.kv_top_ks else 64
    added += [Rung(f"+sparq flash {int(r)}", "4bit-hot", "predicted", kv_top_k=k, kv_ram_tokens=int(r),
                   note=f"SparQ attention ({k} keys), the KV cache paged to flash past {int(r)}-{2 * int(r)} "
                        "tokens a layer") for r in options.kv_ram_tokens]
    for rung in added:  # a knob out of range refused now, not in the rung's process
        rung.decode_options(1, 1)
    return rungs + added


def _run_rungs(rungs: list[Rung], images: dict, prompts, windows, options: BenchOptions, context: int,
               progress) -> tuple[dict, dict]:
    """Each rung's result, and the perplexities measured (once per image and compute path: the same
    arithmetic gives the same perplexity)."""
    results, quality_done = {}, {}
    for rung in rungs:
        progress(f"rung {rung.name}")
        # the same arithmetic gives the same perplexity (paging the KV cache changes where keys lie, not them)
        key = (rung.variant, "dense" if rung.mode in ("naive", "dense") else rung.mode, rung.correct_every,
               rung.cache_bias, rung.flock, rung.flock_rule, rung.kv_top_k)
        spec = {"rung": asdict(rung), "image": str(images[rung.variant]), "prompts": prompts,
                "gen_tokens": options.gen_tokens, "workers": options.workers, "context": context,
                "quality": {} if key in quality_done else windows}
        results[rung.name] = in_subprocess(spec)
        if key in quality_done:
            results[rung.name]["perplexity"] = quality_done[key]
        quality_done[key] = results[rung.name]["perplexity"]
    return results, quality_done


def _sweep(full: Rung, image: Path, prompts, options: BenchOptions, context: int, perplexity: dict,
           progress) -> list[dict]:
    """The full system at each budget, a share of the model as stored (as `run --ram-budget 50%` means it),
    and at the smallest budget its plan accepts, under a hard cap equal to the budget where this machine can
    set one. A budget the plan refuses is recorded with the planner's reason, not run."""
    opened = Image.open(image)
    stored = opened.model_bytes()
    _, floor = plan_image(opened, full.decode_options(options.workers, context))
    budgets = [(f"{share:.0%}", int(share * stored)) for share in options.budgets]
    budgets.append((f"its smallest budget ({floor.smallest_budget / stored:.0%})", floor.smallest_budget))
    sweep = []
    for label, budget in sorted(budgets, key=lambda b: b[1]):
        rung = Rung(f"+4-bit at {label}", full.variant, full.mode, budget=budget)
        try:
            plan_image(opened, rung.decode_options(options.workers, context))
        except LsparseError as e:
            sweep.append({"rung": rung.name, "budget_bytes": budget, "refused": str(e)})
            continue
        progress(f"rung {rung.name} of the model as stored")
        spec = {"rung": asdict(rung), "image": str(image), "prompts": prompts[:1], "gen_tokens": options.gen_tokens,
                "workers": options.workers, "context": context, "quality": {}}
        try:
            result = in_subprocess(spec, cap=budget if can_cap() else None)
        except LsparseError as e:
            sweep.append({"rung": rung.name, "budget_bytes": budget, "refused": str(e)})
            continue
        row = summary(rung, result, None)
        row["cgroup"] = result["cgroup"]
        row["perplexity"] = perplexity
        sweep.append(row)
    return sweep


def bench(image, options: BenchOptions, progress=print) -> dict:
    """Every rung on the same prompts; returns {"rows": [...], "sweep": [...], "image": ..., ...}."""
    if str(image).startswith("synthetic:"):
        name = str(image).split(":", 1)[1]
        options.variants_dir = options.variants_dir or Path("out") / "synthetic" / name
        image = synthetic_base(name, options.variants_dir, progress)
    opened = Image.open(image)
    opened.check_for_run()
    meta, image = opened.manifest, opened.path
    options.synthetic = meta.is_synthetic
    rungs = _check_rungs(options, options.synthetic)
    if options.synthetic and not options.texts:
        from lsparse.image.compile import DEFAULT_CALIBRATION
        options.texts = [DEFAULT_CALIBRATION]
    images = variant_images(image, {r.variant for r in rungs}, options.variants_dir or
                            image.parent / f"{image.name}.variants", progress)
    prompts, windows = prompt_and_quality_windows(opened.tokenizer(), options)
    context = options.prompt_tokens + options.gen_tokens
    limit = architecture(meta.config)[1].max_position_embeddings
    if context > limit:
        raise LsparseError(f"{options.prompt_tokens} prompt + {options.gen_tokens} generated tokens exceed the "
                           f"model's context of {limit}")
    results, quality_done = _run_rungs(rungs, images, prompts, windows, options, context, progress)
    references = {"4bit": results.get("dense 4-bit"), "fp16": results.get("dense fp16")}
    rows = [summary(r, results[r.name], references["4bit" if r.variant.startswith("4bit") else "fp16"])
            for r in rungs]
    full = next((r for r in rungs if r.name == "+4-bit"), None)
    full_quality = quality_done.get((full.variant, full.mode, None, 0.0, None, "add", None), {}) if full else {}
    sweep = _sweep(full, images[full.variant], prompts, options, context, full_quality, progress) \
        if full and options.budgets else []
    return {"image": str(image), "source": meta.source, "synthetic": asdict(meta.synthetic) if meta.synthetic else None,
            "model_bytes": opened.model_bytes(), "prompts": len(prompts),
            "prompt_tokens": options.prompt_tokens, "gen_tokens": options.gen_tokens,
            "texts": [] if options.synthetic else [str(t) for t in options.texts],
            "quality_tokens": options.quality_tokens,
            "predictor_quality": {} if options.synthetic else
            Image.open(images.get("4bit-hot", image)).manifest.mean_predictor_quality(),
            "rows": rows, "sweep": sweep}
