"""`lsparse compile`: calibrate a checkpoint layer by layer and write its flash image (docs/IMAGE_FORMAT.md)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from lsparse import __version__
from lsparse.bench.quality import limit_tokens, read_documents, token_windows
from lsparse.calibrate.activations import layer_stats
from lsparse.calibrate.layerwise import calibrate_layers
from lsparse.calibrate.layout import coactivation_order, read_stats
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
from lsparse.image.bundles import ALIGN_REGION, component_rows, decode_bundles, encode_bundles, stride
from lsparse.image.format import FORMAT, MANIFEST, NEURONS, VERSION, sha256_file, staging_directory
from lsparse.image.quantize import check, row_bytes
from lsparse.model import architecture
from lsparse.model.layers import silu
from lsparse.source import resolve

DEFAULT_CALIBRATION = Path(__file__).resolve().parent.parent / "calibrate" / "data" / "stories.txt"
MIN_CALIBRATION_TOKENS = 256
FFN_KEYS = ("gate", "up", "down", "up_bias", "down_bias")


@dataclass
class CompileOptions:
    calib: Path = DEFAULT_CALIBRATION
    calib_tokens: int = 8192
    window: int = 512
    bits: int = 4
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
    force: bool = False


CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
PRESET_KEYS = ("calib_tokens", "bits", "group_size", "hot_fraction", "predictor", "rank", "recall",
               "threshold_sparsity", "predictor_epochs", "layout", "threshold_on")
LAYOUTS = ("coactivation", "natural")
THRESHOLD_ON = ("gate", "product")


def load_preset(name: str) -> dict:
    """A compile preset: a TOML file, or the name of one in configs/ (opt, reglu-llama, drelu, swiglu-threshold)."""
    import tomllib
    path = Path(name)
    if not path.exists():
        path = CONFIG_DIR / f"{name}.toml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in CONFIG_DIR.glob("*.toml"))) or "none"
        raise LsparseError(f"no compile preset {name!r} (a TOML file, or one of: {known})")
    try:
        preset = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise LsparseError(f"{path}: malformed TOML ({e})") from None
    unknown = sorted(set(preset) - set(PRESET_KEYS))
    if unknown:
        raise LsparseError(f"{path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(PRESET_KEYS)})")
    return preset


def relu_sparse(args) -> bool:
    """Whether the FFN has exact zeros (ReLU, ReGLU, dReLU, OPT) or needs a magnitude threshold (SwiGLU)."""
    return getattr(args, "hidden_act", "relu") not in ("silu", "swish")


def _calibration_windows(tokenizer, options: CompileOptions) -> tuple[list[list[int]], int]:
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


def _compile_layer(cal, arch, args, options: CompileOptions, train_n: int, tmp: Path, neurons,
                   on_epoch=None) -> dict:
    w, acts, x = cal.weights, cal.activations, cal.inputs
    d_ff = acts.shape[1]
    tr, ho = slice(0, train_n), slice(train_n, None)
    if relu_sparse(args):
        threshold, active = 0.0, acts != 0
    else:
        # gate: CATS, a threshold on the gate's activation alone, so that a resident gate decides the mask
        # exactly; product: on each neuron's coefficient (TEAL-like), which costs less quality but needs up
        judged = np.abs(silu(x @ w["gate"].T, np)) if options.threshold_on == "gate" else np.abs(acts)
        threshold = float(np.quantile(judged[tr], options.threshold_sparsity))
        active = judged > threshold
        acts = acts * active
    inputs = [w[c] for c in arch.BUNDLE if c != "down"]
    scores = neuron_scores(active[tr], acts[tr], inputs, w["down"], cal.input_norms)
    hot = hot_set(scores["score"], options.hot_fraction)
    cold = np.setdiff1d(np.arange(d_ff), hot)
    cold_order = cold[coactivation_order(active[tr][:, cold])] if options.layout == "coactivation" else cold

    size = stride(w["down"].shape[0], len(arch.BUNDLE), options.bits, options.group_size)
    gap = options.max_gap_bytes // size
    natural, placed = np.full(d_ff, -1), np.full(d_ff, -1)
    natural[cold] = np.arange(len(cold))
    placed[cold_order] = np.arange(len(cold))
    layout = {"natural": read_stats(active[ho], natural, size, gap),
              "coactivation": read_stats(active[ho], placed, size, gap)}

    proj, bias = w[arch.EXACT_PROJECTION], w.get(arch.EXACT_PROJECTION + "_bias")
    rank = layer_rank(options.rank, cal.index, args.num_hidden_layers)
    predictor_tensors, predictor_threshold = {}, None
    if options.predictor == "exact":
        quality = prediction_quality(active[ho], active[ho], acts[ho])
    else:
        if options.predictor == "svd":
            predictor_tensors = svd_predictor(proj, bias, min(rank, min(proj.shape)))
        else:
            predictor_tensors = train_lowrank(x[tr], active[tr], rank, epochs=options.predictor_epochs,
                                              on_epoch=on_epoch)
        s = predictor_scores(options.predictor, predictor_tensors, x)
        predictor_threshold = threshold_for_recall(s[tr], active[tr], options.recall)
        quality = prediction_quality(s[ho] > predictor_threshold, active[ho], acts[ho])

    bundles = encode_bundles(w, arch.BUNDLE, np.arange(d_ff), options.bits, options.group_size)
    decoded = decode_bundles(bundles, arch.BUNDLE, w["down"].shape[0], options.bits, options.group_size)
    quant_error = {c: float(np.linalg.norm(decoded[c] - component_rows(w, c)) / np.linalg.norm(component_rows(w, c)))
                   for c in arch.BUNDLE}

    offset = -(-neurons.tell() // ALIGN_REGION) * ALIGN_REGION
    neurons.write(b"\0" * (offset - neurons.tell()))
    region = np.ascontiguousarray(bundles[cold_order]).tobytes()
    neurons.write(region)

    rb = row_bytes(w["down"].shape[0], options.bits, options.group_size)
    k = arch.BUNDLE.index(arch.EXACT_PROJECTION)
    resident = {name: t.astype(np.float16) for name, t in w.items() if name not in FFN_KEYS}
    resident.update({name: w[name].astype(np.float32) for name in ("up_bias", "down_bias") if name in w})
    resident["hot_bundles"] = np.ascontiguousarray(bundles[hot])
    resident["exact_rows"] = np.ascontiguousarray(bundles[:, k * rb:(k + 1) * rb])
    resident.update(predictor_tensors)
    save_file(resident, str(tmp / "resident" / f"layer-{cal.index:03d}.safetensors"))

    held = layer_stats(active[ho], [active[ho].shape[0]])
    hot_share = float(active[ho][:, hot].sum() / max(active[ho].sum(), 1))
    return {"index": cal.index, "d_ff": d_ff, "activation_threshold": threshold,
            "threshold_on": options.threshold_on,
            "hot": hot.tolist(), "cold_order": cold_order.tolist(),
            "region": {"offset": offset, "count": len(cold_order), "size": len(region),
                       "sha256": hashlib.sha256(region).hexdigest()},
            "predictor": {"rank": None if options.predictor == "exact" else rank, "threshold": predictor_threshold,
                          "quality": quality},
            "calibration": {"active_fraction": float(active.mean()),
                            "max_active_fraction": float(active.mean(axis=1).max()), "held_out_hot_share": hot_share,
                            "held_out_window_union": held["window_union_fraction"]},
            "layout": layout, "quantization_error": quant_error}


def compile_image(spec: str, out: str, options: CompileOptions, progress=None, training_progress=None) -> dict:
    """Write the image of `spec` to `out`; returns its manifest. Nothing is left at `out` unless it completes.
    progress(layers done, layers); training_progress(layer, epochs done, epochs) while a predictor trains."""
    if options.predictor not in KINDS:
        raise LsparseError(f"unknown predictor {options.predictor!r} (choose from {', '.join(KINDS)})")
    if options.threshold_on not in THRESHOLD_ON:
        raise LsparseError(f"unknown threshold_on {options.threshold_on!r} (choose from {', '.join(THRESHOLD_ON)})")
    if options.layout not in LAYOUTS:
        raise LsparseError(f"unknown layout {options.layout!r} (choose from {', '.join(LAYOUTS)})")
    out = Path(out)
    if out.exists() and not options.force:
        raise LsparseError(f"{out} already exists (pass --force to replace it)")
    checkpoint = resolve(spec)
    if checkpoint.tokenizer is None:
        raise LsparseError(f"{checkpoint.location}: no tokenizer found; an image needs one")
    arch, args = architecture(checkpoint.config)
    check(args.hidden_size, options.bits, options.group_size)
    windows, train_n = _calibration_windows(checkpoint.tokenizer, options)

    with staging_directory(out) as tmp:
        (tmp / "resident").mkdir()
        checkpoint.tokenizer.save(tmp)
        from lsparse.model import load_globals
        save_file({k: v.astype(np.float16) for k, v in load_globals(checkpoint, arch, args).items()},
                  str(tmp / "resident" / "globals.safetensors"))
        layers = []
        with open(tmp / NEURONS, "wb") as neurons:
            for cal in calibrate_layers(checkpoint, windows):
                on_epoch = None
                if training_progress:
                    def on_epoch(epoch, index=cal.index):
                        training_progress(index, epoch + 1, options.predictor_epochs)
                layers.append(_compile_layer(cal, arch, args, options, train_n, tmp, neurons, on_epoch))
                if progress:
                    progress(cal.index + 1, args.num_hidden_layers)
            neurons.flush()
            os.fsync(neurons.fileno())
        files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = {
            "format": FORMAT, "version": VERSION, "config": checkpoint.config, "source": checkpoint.location,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "lsparse_version": __version__,
            "quantization": {"bits": options.bits, "group_size": options.group_size},
            "bundle": {"components": list(arch.BUNDLE), "exact_prefix": arch.EXACT_PREFIX,
                       "row_bytes": row_bytes(args.hidden_size, options.bits, options.group_size),
                       "stride": stride(args.hidden_size, len(arch.BUNDLE), options.bits, options.group_size),
                       "d_model": args.hidden_size},
            "predictor": {"kind": options.predictor, "recall_target": options.recall},
            "calibration": {"text": str(options.calib), "tokens": sum(len(w) for w in windows),
                            "held_out_tokens": sum(len(w) for w in windows) - train_n},
            "options": {k: getattr(options, k) for k in PRESET_KEYS},
            "files": files, "layers": layers,
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest) + "\n", encoding="utf-8")
    return manifest
