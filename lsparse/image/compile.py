"""`lsparse compile`: calibrate a checkpoint layer by layer and write its flash image (docs/IMAGE_FORMAT.md)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path

import numpy as np

from lsparse import __version__
from lsparse.calibrate.activations import layer_stats
from lsparse.calibrate.layerwise import calibrate_layers
from lsparse.calibrate.layout import coactivation_order
from lsparse.calibrate.predictors import (
    KINDS,
    layer_rank,
    prediction_quality,
    predictor_scores,
    svd_predictor,
    threshold_for_recall,
    train_lowrank,
)
from lsparse.calibrate.residency import hot_set, neuron_scores
from lsparse.errors import LsparseError
from lsparse.image.bundles import component_rows, decode_bundles, encode_bundles, read_stats, row_sums
from lsparse.image.manifest import BundleLayout, Calibration, Layer, Manifest
from lsparse.image.quantize import check, quantize_rows, row_bytes
from lsparse.image.replace import check_target
from lsparse.image.writer import writing
from lsparse.model import architecture, check_tensors
from lsparse.model.layers import silu
from lsparse.source import resolve
from lsparse.text import limit_tokens, read_documents, token_windows

DEFAULT_CALIBRATION = Path(__file__).resolve().parent.parent / "calibrate" / "data" / "stories.txt"
MIN_CALIBRATION_TOKENS = 256
FFN_KEYS = ("gate", "up", "down", "up_bias", "down_bias")


@dataclass
class CompileOptions:
    calib: Path = DEFAULT_CALIBRATION
    calib_tokens: int = 8192
    window: int = 512
    bits: int = 4
    hot_bits: int | None = None       # a precision tier: hot neurons' bundles at 8 or 16 bits (None: at `bits`)
    group_size: int = 64
    hot_fraction: float = 0.1
    predictor: str = "lowrank"
    rank: int = 32
    recall: float = 0.99
    threshold_sparsity: float = 0.5   # SwiGLU models only: the share of activations cut
    threshold_on: str = "gate"        # SwiGLU: |silu(gate)| (CATS; exact mode can run it) or |silu(gate) * up|
    held_out: float = 0.2
    max_gap_bytes: int = 16384        # layout report: read through gaps smaller than this
    predictor_epochs: int = 30
    layout: str = "coactivation"      # or "natural": cold neurons in id order (the ablation bench runs)
    resident_bits: int = 16           # attention and embedding matrices: fp16, or 4/8-bit rows in groups of group_size
    residency: str = "frequency"      # hot neurons by activation frequency, or by Wanda's score |W| ||x|| alone
    max_quality_loss: float | None = None  # the predictor thresholds chosen to keep perplexity within this share
    force: bool = False


PRESETS = files("lsparse.presets")
PRESET_KEYS = ("calib_tokens", "bits", "group_size", "hot_fraction", "predictor", "rank", "recall",
               "threshold_sparsity", "predictor_epochs", "layout", "threshold_on", "resident_bits", "residency",
               "max_quality_loss", "hot_bits")
# The recalls a quality gate may choose among: each layer's threshold for each, on its training tokens, is in its
# figures (recall_thresholds), so that a gate can move every layer's threshold by one knob
RECALL_GRID = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.93, 0.95, 0.97, 0.98, 0.99, 0.995, 0.999, 1.0)
LAYOUTS = ("coactivation", "natural")
RESIDENCY = ("frequency", "wanda")
THRESHOLD_ON = ("gate", "product")


def load_preset(name: str) -> dict:
    """A compile preset: a TOML file, or the name of one in lsparse/presets/ (opt, reglu-llama, drelu,
    swiglu-threshold)."""
    import tomllib
    path = Path(name)
    if not path.is_file():
        path = PRESETS / f"{name}.toml"
    if not path.is_file():
        known = ", ".join(sorted(p.name.removesuffix(".toml") for p in PRESETS.iterdir()
                                 if p.name.endswith(".toml"))) or "none"
        raise LsparseError(f"no compile preset {name!r} (a TOML file, or one of: {known})")
    try:
        preset = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise LsparseError(f"{path}: malformed TOML ({e})") from None
    unknown = sorted(set(preset) - set(PRESET_KEYS))
    if unknown:
        raise LsparseError(f"{path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(PRESET_KEYS)})")
    return preset


def stored_matrices(tensors: dict, arch, options: CompileOptions) -> dict:
    """Resident tensors as the image keeps them: the architecture's weight matrices (attention, embeddings) as
    4/8-bit rows where --resident-bits asks, everything else (and every matrix at 16) in fp16."""
    return {name: quantize_rows(t, options.resident_bits, options.group_size)
            if options.resident_bits != 16 and name in arch.MATRICES else t.astype(np.float16)
            for name, t in tensors.items()}


def relu_sparse(args) -> bool:
    """Whether the FFN has exact zeros (ReLU, ReGLU, dReLU, OPT) or needs a magnitude threshold (SwiGLU)."""
    return getattr(args, "hidden_act", "relu") not in ("silu", "swish")


def calibration_windows(tokenizer, options: CompileOptions) -> tuple[list[list[int]], int]:
    windows = limit_tokens(token_windows(tokenizer, read_documents(options.calib), options.window),
                           options.calib_tokens)
    total = sum(len(w) for w in windows)
    if total < MIN_CALIBRATION_TOKENS:
        raise LsparseError(f"{options.calib}: {total} tokens of calibration text; at least "
                           f"{MIN_CALIBRATION_TOKENS} are needed")
    if len(windows) < 2:
        raise LsparseError(f"{options.calib}: too little calibration text to hold some out (one window); "
                           "give more text")
    # the last windows, about `held_out` of the tokens and at least one window, are held out
    cumulative = np.cumsum([len(w) for w in windows])
    split = int(np.clip(np.searchsorted(cumulative, (1 - options.held_out) * total) + 1, 1, len(windows) - 1))
    train_tokens = int(cumulative[split - 1])
    return windows, train_tokens


def held_out_windows(windows: list[list[int]], train_tokens: int) -> list[list[int]]:
    """The windows after the first `train_tokens` tokens (calibration_windows' split)."""
    return windows[int(np.searchsorted(np.cumsum([len(w) for w in windows]), train_tokens)) + 1:]


def _layer_mask(cal, args, options: CompileOptions, tr: slice) -> tuple[float, np.ndarray, np.ndarray]:
    """(the activation threshold, which neurons are active (N, d_ff), the activations as the image computes
    them): ReLU-family zeros are exact; SwiGLU is cut by magnitude."""
    w, acts, x = cal.weights, cal.activations, cal.inputs
    if relu_sparse(args):
        return 0.0, acts != 0, acts
    # gate: CATS, a threshold on the gate's activation alone, so that a resident gate decides the mask
    # exactly; product: on each neuron's coefficient (TEAL-like), which costs less quality but needs up
    judged = np.abs(silu(x @ w["gate"].T, np)) if options.threshold_on == "gate" else np.abs(acts)
    threshold = float(np.quantile(judged[tr], options.threshold_sparsity))
    active = judged > threshold
    return threshold, active, acts * active


def _layer_predictor(cal, arch, options: CompileOptions, active, acts, rank: int, tr: slice, ho: slice,
                     on_epoch) -> tuple[dict, float | None, dict, list]:
    """(the predictor's tensors, its threshold, its held-out quality, [recall, threshold] for each of
    RECALL_GRID)."""
    if options.predictor == "exact":
        return {}, None, prediction_quality(active[ho], active[ho], acts[ho]), []
    w, x = cal.weights, cal.inputs
    if options.predictor == "svd":
        proj = w[arch.EXACT_PROJECTION]
        tensors = svd_predictor(proj, w.get(arch.EXACT_PROJECTION + "_bias"), min(rank, min(proj.shape)))
    else:
        tensors = train_lowrank(x[tr], active[tr], rank, epochs=options.predictor_epochs, on_epoch=on_epoch)
    s = predictor_scores(options.predictor, tensors, x)
    threshold = threshold_for_recall(s[tr], active[tr], options.recall)
    table = [[r, threshold_for_recall(s[tr], active[tr], r)] for r in RECALL_GRID]
    return tensors, threshold, prediction_quality(s[ho] > threshold, active[ho], acts[ho]), table


def _layout_figures(active_held: np.ndarray, cold: np.ndarray, cold_order: np.ndarray, d_ff: int, size: int,
                    options: CompileOptions) -> dict:
    """Reads per token on the held-out tokens, cold neurons in id order against the chosen order."""
    natural, placed = np.full(d_ff, -1), np.full(d_ff, -1)
    natural[cold] = np.arange(len(cold))
    placed[cold_order] = np.arange(len(cold))
    gap = options.max_gap_bytes // size
    return {"natural": read_stats(active_held, natural, size, gap),
            "coactivation": read_stats(active_held, placed, size, gap)}


def _compile_layer(cal, arch, args, options: CompileOptions, train_n: int, writer, on_epoch=None) -> Layer:
    w = cal.weights
    d_ff = cal.activations.shape[1]
    tr, ho = slice(0, train_n), slice(train_n, None)
    threshold, active, acts = _layer_mask(cal, args, options, tr)
    inputs = [w[c] for c in arch.BUNDLE if c != "down"]
    scores = neuron_scores(active[tr], acts[tr], inputs, w["down"], cal.input_norms)
    hot = hot_set(scores["score" if options.residency == "frequency" else "wanda"], options.hot_fraction)
    cold = np.setdiff1d(np.arange(d_ff), hot)
    cold_order = cold[coactivation_order(active[tr][:, cold])] if options.layout == "coactivation" else cold
    rank = layer_rank(options.rank, cal.index, args.num_hidden_layers)
    predictor, predictor_threshold, quality, recall_thresholds = _layer_predictor(cal, arch, options, active, acts,
                                                                                  rank, tr, ho, on_epoch)

    bundles = encode_bundles(w, arch.BUNDLE, np.arange(d_ff), options.bits, options.group_size)  # (d_ff, stride)
    decoded = decode_bundles(bundles, arch.BUNDLE, w["down"].shape[0], options.bits, options.group_size)
    quant_error = {c: float(np.linalg.norm(decoded[c] - component_rows(w, c)) / np.linalg.norm(component_rows(w, c)))
                   for c in arch.BUNDLE}
    region = writer.append_region(bundles[cold_order])
    rb = row_bytes(w["down"].shape[0], options.bits, options.group_size)
    k = arch.BUNDLE.index(arch.EXACT_PROJECTION)
    resident = stored_matrices({name: t for name, t in w.items() if name not in FFN_KEYS}, arch, options)
    resident.update({name: w[name].astype(np.float32) for name in ("up_bias", "down_bias") if name in w})
    resident["hot_bundles"] = np.ascontiguousarray(bundles[hot]) if options.hot_bits is None else \
        encode_bundles(w, arch.BUNDLE, hot, options.hot_bits, options.group_size)  # (n_hot, hot stride)
    resident["exact_rows"] = np.ascontiguousarray(bundles[:, k * rb:(k + 1) * rb])
    n_rows = len(arch.BUNDLE)
    resident["cold_row_sums"] = row_sums(bundles[cold_order, :n_rows * rb].reshape(-1, n_rows, rb))  # (n_cold, rows)
    writer.save_resident(f"layer-{cal.index:03d}", {**resident, **predictor})

    held = layer_stats(active[ho], [active[ho].shape[0]])
    figures = {"predictor": quality, "held_out_hot_share": float(active[ho][:, hot].sum() / max(active[ho].sum(), 1)),
               "held_out_window_union": held["window_union_fraction"], "quantization_error": quant_error,
               "layout": _layout_figures(active[ho], cold, cold_order, d_ff, bundles.shape[1], options),
               "recall_thresholds": recall_thresholds}
    return Layer(index=cal.index, d_ff=d_ff, hot=hot, cold_order=cold_order, region=region, threshold=threshold,
                 threshold_on=options.threshold_on, predictor_rank=None if options.predictor == "exact" else rank,
                 predictor_threshold=predictor_threshold, active_fraction=float(active.mean()),
                 max_active_fraction=float(active.mean(axis=1).max()),
                 max_predicted_fraction=quality["max_predicted_fraction"], figures=figures)


def _check_options(options: CompileOptions, gate) -> None:
    """Options compile cannot use, refused before any work."""
    if options.predictor not in KINDS:
        raise LsparseError(f"unknown predictor {options.predictor!r} (choose from {', '.join(KINDS)})")
    if options.threshold_on not in THRESHOLD_ON:
        raise LsparseError(f"unknown threshold_on {options.threshold_on!r} (choose from {', '.join(THRESHOLD_ON)})")
    if options.residency not in RESIDENCY:
        raise LsparseError(f"unknown residency {options.residency!r} (choose from {', '.join(RESIDENCY)})")
    if options.layout not in LAYOUTS:
        raise LsparseError(f"unknown layout {options.layout!r} (choose from {', '.join(LAYOUTS)})")
    if options.max_quality_loss is not None and (options.predictor == "exact" or
                                                 not 0 < options.max_quality_loss < 10):
        raise LsparseError("--max-quality-loss (a share above 0%) chooses a predictor's thresholds: it needs "
                           "--predictor lowrank or svd")
    if options.hot_bits is not None and options.hot_bits <= options.bits:
        raise LsparseError(f"--hot-bits {options.hot_bits}: the hot tier is stored at more bits than the "
                           f"--bits {options.bits} of the rest")
    if options.max_quality_loss is not None and gate is None:
        raise LsparseError("a quality bound needs its gate: compile_image(..., gate=lsparse.runtime.gate."
                           "gate_thresholds)")


def compile_image(spec: str, out: str, options: CompileOptions, progress=None, training_progress=None,
                  gate=None) -> Manifest:
    """Write the image of `spec` to `out`; returns its manifest. Nothing is left at `out` unless it completes.
    progress(layers done, layers); training_progress(layer, epochs done, epochs) while a predictor trains.
    gate(path, manifest, held-out windows, bound) -> manifest: with options.max_quality_loss, the step that
    chooses the predictor thresholds by decoding the image written so far (lsparse/runtime/gate.py)."""
    _check_options(options, gate)
    check_target(Path(out), options.force, "image")  # before the minutes of work, not only at the end
    checkpoint = resolve(spec)
    if checkpoint.tokenizer is None:
        raise LsparseError(f"{checkpoint.location}: no tokenizer found; an image needs one")
    arch, args = architecture(checkpoint.config)
    check_tensors(checkpoint, arch, args)
    for bits in {options.bits, options.hot_bits or options.bits}:
        check(args.hidden_size, bits, options.group_size)
    if options.resident_bits != 16:  # rows of d_model (q, k, v, embeddings) and of the heads' width (o)
        for width in {args.hidden_size, args.num_attention_heads * args.head_dim}:
            check(width, options.resident_bits, options.group_size)
    windows, train_n = calibration_windows(checkpoint.tokenizer, options)

    with writing(out, options.force) as writer:
        checkpoint.tokenizer.save(writer.root)
        from lsparse.model import load_globals
        writer.save_resident("globals", stored_matrices(load_globals(checkpoint, arch, args), arch, options))
        layers = []
        for cal in calibrate_layers(checkpoint, windows):
            on_epoch = None
            if training_progress:
                def on_epoch(epoch, index=cal.index):
                    training_progress(index, epoch + 1, options.predictor_epochs)
            layers.append(_compile_layer(cal, arch, args, options, train_n, writer, on_epoch))
            if progress:
                progress(cal.index + 1, args.num_hidden_layers)
        tokens = sum(len(w) for w in windows)
        manifest = writer.finish(
            config=checkpoint.config, source=checkpoint.location, lsparse_version=__version__,
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            bundle=BundleLayout.of(tuple(arch.BUNDLE), arch.EXACT_PREFIX, args.hidden_size, options.bits,
                                   options.group_size), hot_bits=options.hot_bits,
            resident_bits=options.resident_bits, resident_group_size=options.group_size,
            predictor=options.predictor, recall_target=options.recall,
            calibration=Calibration(text=str(options.calib), tokens=tokens, held_out_tokens=tokens - train_n),
            options={k: getattr(options, k) for k in PRESET_KEYS}, layers=tuple(layers), synthetic=None)
        if options.max_quality_loss is None:
            return manifest
        return writer.rewrite(gate(writer.root, manifest, held_out_windows(windows, train_n),
                                   options.max_quality_loss))
