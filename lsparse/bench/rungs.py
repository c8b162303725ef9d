"""The ladder's rungs: LLM in a Flash's configurations, each adding one idea to the one before, and the image
variants they run on (compiled from the image's recorded source and options with one change)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lsparse.errors import LsparseError
from lsparse.image.image import Image, is_image
from lsparse.runtime.options import DecodeOptions

# Image variants as changes to the compile options recorded in the image; None: the image itself.
VARIANTS = {
    "fp16-natural": {"bits": 16, "hot_bits": None, "hot_fraction": 0.0, "layout": "natural"},
    "fp16-layout": {"bits": 16, "hot_bits": None, "hot_fraction": 0.0, "layout": "coactivation"},
    "fp16-hot": {"bits": 16, "hot_bits": None, "layout": "coactivation"},
    "4bit-hot": {"bits": 4, "hot_bits": None, "layout": "coactivation"},
    "4bit-wanda": {"bits": 4, "hot_bits": None, "layout": "coactivation", "residency": "wanda"},
    "4bit-hot8": {"bits": 4, "hot_bits": 8, "layout": "coactivation"},
}
GATED = "4bit-gated-"  # and a bound: the 4-bit image with its thresholds chosen for that quality bound


def variant_options(name: str) -> dict:
    """The compile options a variant changes."""
    if name.startswith(GATED):
        return {"bits": 4, "hot_bits": None, "layout": "coactivation",
                "max_quality_loss": float(name.removeprefix(GATED))}
    return VARIANTS[name]


def gated_rung(bound: float) -> "Rung":
    """Predicted mode on the image whose thresholds keep held-out perplexity within `bound` of dense's."""
    return Rung(f"+gated {bound:.1%}", f"{GATED}{bound:g}", "predicted",
                note=f"thresholds chosen at compile for at most {bound:.1%} more perplexity than dense on held-out "
                     "calibration text (deployable: predicted mode)")


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
    correct_every: int | None = None  # the dense path checks the drafts every k tokens (runtime/correct.py)
    cache_bias: float = 0.0           # cache-aware masks (DIP): runtime/predictors.py Scored
    flock: float | None = None        # flocking (GRIFFIN): runtime/flock.py
    flock_rule: str = "add"
    kv_top_k: int | None = None       # SparQ attention: model/sparq.py
    kv_ram_tokens: int | None = None  # ... with the KV cache paged to flash: runtime/kv_flash.py
    note: str = ""

    def decode_options(self, readers: int, context: int) -> DecodeOptions:
        """The rung as the options `lsparse run` takes (naive computes as dense does; only its reads differ)."""
        return DecodeOptions(mode="dense" if self.mode == "naive" else self.mode, window=self.window,
                             bundled=self.bundled, gap_bytes=self.gap_bytes, ram_budget=self.budget,
                             lookahead=self.lookahead, kernels=self.kernels, readers=readers, context=context,
                             correct_every=self.correct_every, cache_bias=self.cache_bias, flock=self.flock,
                             flock_rule=self.flock_rule, kv_top_k=self.kv_top_k, kv_ram_tokens=self.kv_ram_tokens)


LADDER = [
    Rung("naive", "fp16-natural", "naive", note="every byte of the image read each token; computed from RAM"),
    Rung("hybrid", "fp16-natural", "hybrid", note="all but the FFN resident; the whole FFN read each token"),
    Rung("+predictor", "fp16-natural", "predicted", window=1, bundled=False, gap_bytes=0,
         note="only predicted neurons read; rows read apart, no reuse"),
    Rung("+window", "fp16-natural", "predicted", window=5, bundled=False, gap_bytes=0,
         note="neurons of the last 5 tokens kept"),
    Rung("+bundles", "fp16-natural", "predicted", note="row-column bundles and the gap rule, in the model's order"),
    Rung("+bundles+layout", "fp16-layout", "predicted",
         note="bundles in co-activation order: the layout's gain on held-out text, against +bundles"),
    Rung("+hot", "fp16-hot", "predicted", note="hot neurons pinned in RAM"),
    Rung("+4-bit", "4bit-hot", "predicted", note="4-bit bundles: the full system"),
    Rung("+wanda hot", "4bit-wanda", "predicted",
         note="hot neurons by Wanda's |W| ||x|| instead of frequency, at the same RAM: against +4-bit"),
    Rung("+8-bit hot", "4bit-hot8", "predicted",
         note="a precision tier: hot neurons' bundles at 8 bits, cold ones at 4 (a larger image, the same cold "
              "reads): against +4-bit"),
    Rung("+packed cache", "4bit-hot", "predicted", kernels="mlx",
         note="cached neurons kept 4-bit, multiplied by MLX's quantized kernel"),
    Rung("+lookahead", "4bit-hot", "predicted", lookahead=True, note="the next layer read while this one runs"),
    Rung("+correction", "4bit-hot", "predicted", correct_every=4,
         note="the dense path checks the drafts every 4 tokens (Sirius): dense's text; perplexity does not apply"),
    Rung("+flock", "4bit-hot", "predicted", flock=0.5, flock_rule="within",
         note="the predictor's mask within the prompt's flock (half of each layer's neurons, GRIFFIN's statistic): "
              "read once in the prompt's stream"),
    Rung("+flock core", "4bit-hot", "predicted", flock=0.5, flock_rule="core",
         note="every neuron of the flock, no predictor (GRIFFIN as published)"),
    Rung("exact+flock", "4bit-hot", "exact", flock=0.5,
         note="exact gating, the flock pinned after the prompt: lossless, fewer reads"),
    Rung("+sparq", "4bit-hot", "predicted", kv_top_k=64,
         note="SparQ attention: 64 keys and values read whole a step, ranked by a quarter of each query's "
              "components: against +4-bit"),
    Rung("+sparq flash", "4bit-hot", "predicted", kv_top_k=64, kv_ram_tokens=64,
         note="+sparq with the KV cache paged to flash: each layer holds its newest 64-128 tokens, reads of the rest "
              "as SparQ uses them (kv_flash_bytes_per_token); perplexity: +sparq's arithmetic"),
    Rung("exact 4-bit", "4bit-hot", "exact", note="gate resident: lossless against dense 4-bit"),
    Rung("exact 8-bit hot", "4bit-hot8", "exact", note="the precision tier's model itself: against exact 4-bit"),
    Rung("dense 4-bit", "4bit-hot", "dense", note="every weight in RAM"),
    Rung("dense fp16", "fp16-natural", "dense", note="every weight in RAM: the reference"),
]


SYNTHETIC_RUNGS = ("hybrid", "+predictor", "+window", "+bundles+layout", "+hot", "+4-bit", "+packed cache")


def synthetic_base(name: str, folder: Path, progress, layers: int | None = None) -> Path:
    """The full-system variant of a synthetic model, written once into its variants folder."""
    from lsparse.bench.synthetic import write_synthetic
    out = folder / "4bit-hot"
    if not _reusable(out, {"layout": "coactivation", "layers": layers}):
        progress(f"writing synthetic:{name} into {out}")
        write_synthetic(name, out, bits=4, shared=folder / ".neurons", progress=progress, layers=layers)
    return out


def variant_images(image: Path, needed: set[str], folder: Path, progress=print) -> dict[str, Path]:
    """The image for each variant, compiled from the image's source when its options differ."""
    from lsparse.image.compile import CompileOptions, compile_image
    from lsparse.runtime.gate import gate_thresholds
    meta = Image.open(image).manifest
    recorded = meta.options
    if not recorded:
        raise LsparseError(f"{image} does not record its compile options: compile it again to bench it")
    base = {**recorded} if meta.is_synthetic else {**recorded, "calib": Path(meta.calibration.text)}
    if base.get("predictor") == "exact":
        base["predictor"] = "lowrank"  # the predicted rungs need a predictor
    images = {}
    for name in sorted(needed):
        options = {**base, "max_quality_loss": None, **variant_options(name)}
        if all(recorded.get(k) == v for k, v in options.items() if k != "calib"):
            images[name] = image
            continue
        out = folder / name
        if _same_variant(out, meta.source, {k: options[k] for k in recorded}):
            images[name] = out
            continue
        if meta.is_synthetic:
            from lsparse.bench.synthetic import write_synthetic
            progress(f"writing the {name} variant of {meta.source} into {out}")
            write_synthetic(meta.synthetic.name, out, shared=folder / ".neurons",
                            progress=progress, **{k: options[k] for k in recorded})
        else:
            progress(f"compiling the {name} variant of {meta.source} into {out}")
            compile_image(meta.source, str(out), CompileOptions(force=True, **options), gate=gate_thresholds)
        images[name] = out
    return images


def _same_variant(image: Path, source: str, options: dict) -> bool:
    """Whether a variant compiled earlier is of this source with these options."""
    return _reusable(image, options) and Image.open(image).manifest.source == source


def _reusable(image: Path, options: dict) -> bool:
    """Whether an image written earlier has these options (an image this lsparse cannot read, or a
    damaged one, is written again)."""
    try:
        manifest = Image.open(image).manifest if is_image(image) else None
    except LsparseError:
        return False
    return manifest is not None and all(manifest.option(k) == v for k, v in options.items())
