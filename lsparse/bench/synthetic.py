"""Synthetic images at real geometries, for what only shows at scale: reads, bytes and I/O time with bundles
of kilobytes and neuron files of gigabytes.

`synthetic:llama-7b-relu` has Llama-2-7B's FFN (32 layers of 4096 x 11008, which is two thirds of the 7B
model's weights) with random weights, attention cut to one 64-wide head and a 512-token vocabulary, so that
everything but the FFN is negligible. Which neurons fire is not computed from those random weights: it is
replayed from activations recorded on the trained built-in model (lsparse's calibration text), so that the
per-layer active share, the window growth and the hot/cold skew are a real model's. Synthetic layer l replays
built-in layer l mod 6; its 11008 neurons are 43 tiles of the built-in layer's 256, each tile with its own
permutation and its own offset in the trace, so that tiles fire as different tokens of the same model would.

No quality figure applies to a synthetic image, and the bench says so.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from lsparse import __version__
from lsparse.errors import LsparseError
from lsparse.image.manifest import Calibration, Layer, Region, Synthetic
from lsparse.image.trace import TRACE, Trace

GEOMETRIES = {"llama-7b-relu": {"hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32},
              "tiny-relu": {"hidden_size": 128, "intermediate_size": 768, "num_hidden_layers": 4}}  # for tests
TRACE_MODEL = "builtin:tinystories-reglu"
PATTERN_NEURONS = 512  # distinct random bundles, repeated through the neuron file: the bytes only need reading


def record_trace(tokens: int) -> tuple[np.ndarray, object]:
    """(tokens, layers, d_ff) activation masks of the built-in model on lsparse's calibration text."""
    from lsparse.calibrate.activations import record_activations
    from lsparse.image.compile import DEFAULT_CALIBRATION
    from lsparse.model import load_model
    from lsparse.source import resolve
    from lsparse.text import limit_tokens, read_documents, token_windows
    checkpoint = resolve(TRACE_MODEL)
    windows = limit_tokens(token_windows(checkpoint.tokenizer, read_documents(DEFAULT_CALIBRATION), 512), tokens)
    acts = record_activations(load_model(checkpoint, "numpy"), windows)
    return np.stack([a != 0 for a in acts], axis=1), checkpoint.tokenizer


def _config(name: str, tokenizer_config: dict) -> dict:
    g = GEOMETRIES[name]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **g, "num_attention_heads": 1,
            "num_key_value_heads": 1, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 2048,
            "hidden_act": "relu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
            "bos_token_id": tokenizer_config.get("bos_token_id", 1), "eos_token_id": 2}


def _pattern(d: int, bits: int, rng) -> np.ndarray:
    """PATTERN_NEURONS random bundles (up, down, gate rows), weights of about 1/sqrt(d)."""
    from lsparse.image.bundles import encode_bundles
    from lsparse.model.llama import BUNDLE
    n = PATTERN_NEURONS
    scale = 1 / np.sqrt(d)
    w = {"up": rng.standard_normal((n, d)) * scale, "gate": rng.standard_normal((n, d)) * scale,
         "down": rng.standard_normal((d, n)) * scale}
    return encode_bundles({k: v.astype(np.float32) for k, v in w.items()}, BUNDLE, np.arange(n), bits, 64)


def write_neuron_file(path: Path, layers: int, d_ff: int, pattern: np.ndarray, progress=None) -> list[int]:
    """Every layer's region holds d_ff bundles (hot ones included, so that variants share the file); returns
    the region offsets."""
    from lsparse.image.bundles import ALIGN_REGION
    stride = pattern.shape[1]
    region = np.resize(pattern, (d_ff, stride)).tobytes()
    offsets, at = [], 0
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            for layer in range(layers):
                at = -(-at // ALIGN_REGION) * ALIGN_REGION
                f.seek(at)
                f.write(region)
                offsets.append(at)
                at += len(region)
                if progress:
                    progress(f"writing {path.name}: layer {layer + 1}/{layers}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return offsets


def _shared_neuron_file(shared: Path, n_layers: int, d: int, f: int, bits: int, seed: int,
                        progress) -> tuple[Path, dict, np.ndarray]:
    """(the neuron file of this precision, its region offsets and checksums, the pattern of bundles it
    repeats), written once into `shared`."""
    from lsparse.image.image import sha256_file
    shared.mkdir(parents=True, exist_ok=True)
    neuron_file = shared / f"neurons-{bits}bit.bin"
    pattern = _pattern(d, bits, np.random.default_rng(seed + 1))
    meta_file = neuron_file.with_suffix(".json")
    if not (neuron_file.exists() and meta_file.exists()):
        offsets = write_neuron_file(neuron_file, n_layers, f, pattern, progress)
        meta_file.write_text(json.dumps({"offsets": offsets, "sha256": sha256_file(neuron_file)}))
    return neuron_file, json.loads(meta_file.read_text()), pattern


def _synthetic_layer(index: int, d: int, trace: Trace, masks: np.ndarray, hot_fraction: float, layout: str,
                     neuron_file: Path, offset: int, pattern: np.ndarray, pattern_sums: np.ndarray, writer, rng,
                     wr) -> Layer:
    """One layer: its hot set and cold order from the replayed masks, its resident tensors written."""
    from lsparse.calibrate.layout import coactivation_order
    from lsparse.calibrate.residency import hot_set
    from lsparse.image.image import sha256_file
    t_len, _, traced_ff = masks.shape
    active = trace.all_masks(index, t_len)  # (t_len, d_ff)
    f, stride = active.shape[1], pattern.shape[1]
    hot = hot_set(active.mean(0) + 1e-9 * rng.random(f), hot_fraction)
    is_hot = np.zeros(f, bool)
    is_hot[hot] = True
    if layout == "coactivation":  # the traced layer's order, through each tile's permutation
        base = coactivation_order(masks[:, trace.source_layer[index]])
        order = np.concatenate([k * traced_ff + np.argsort(trace.perms[index, k])[base]
                                for k in range(len(trace.perms[index]))])
    else:
        order = np.arange(f)
    cold_order = order[~is_hot[order]]
    size = len(cold_order) * stride
    region = Region(offset=offset, count=len(cold_order), size=size, sha256=sha256_file(neuron_file, offset, size))
    attention = {"q": (64, d), "k": (64, d), "v": (64, d), "o": (d, 64)}
    writer.save_resident(f"layer-{index:03d}", {
        **{k: (wr.standard_normal(shape) * 0.02).astype(np.float16) for k, shape in attention.items()},
        "input_norm": np.ones(d, np.float16), "post_norm": np.ones(d, np.float16),
        "hot_bundles": np.ascontiguousarray(np.resize(pattern, (len(hot), stride))),
        # (n_cold, 3): position p of a region holds pattern bundle p mod PATTERN_NEURONS
        "cold_row_sums": pattern_sums[np.arange(len(cold_order)) % len(pattern)]})
    per_token = active.mean(1)
    return Layer(index=index, d_ff=f, hot=hot, cold_order=cold_order, region=region, threshold=0.0,
                 threshold_on="gate", predictor_rank=None, predictor_threshold=None,
                 active_fraction=float(per_token.mean()), max_active_fraction=float(per_token.max()),
                 max_predicted_fraction=float(per_token.max()),
                 figures={"predictor": {"predicted_fraction": float(per_token.mean()),
                                        "max_predicted_fraction": float(per_token.max())}})


def write_synthetic(name: str, out, bits: int = 4, hot_fraction: float = 0.1, layout: str = "coactivation",
                    trace_tokens: int = 1024, seed: int = 0, shared: Path | None = None, progress=None):
    """Write the synthetic image `name` to `out` (returns its Manifest); the neuron file of each precision is
    kept once in `shared` (default: beside `out`) and hard-linked in, so that the ladder's variants cost no
    more disk."""
    from lsparse.image.bundles import row_sums
    from lsparse.image.bundles import stride as bundle_stride
    from lsparse.image.manifest import BundleLayout
    from lsparse.image.quantize import check, row_bytes
    from lsparse.image.writer import writing
    from lsparse.model.llama import BUNDLE, EXACT_PREFIX
    if name not in GEOMETRIES:
        raise LsparseError(f"unknown synthetic model {name!r} (known: {', '.join(GEOMETRIES)})")
    out = Path(out)
    g = GEOMETRIES[name]
    d, f, n_layers = g["hidden_size"], g["intermediate_size"], g["num_hidden_layers"]
    check(d, bits, 64)
    rng = np.random.default_rng(seed)
    masks, tokenizer = record_trace(trace_tokens)
    t_len, traced_layers, traced_ff = masks.shape
    tiles = -(-f // traced_ff)
    if tiles * traced_ff != f:
        raise LsparseError(f"{name}: d_ff {f} is not a multiple of the traced model's {traced_ff}")
    perms = np.stack([np.stack([rng.permutation(traced_ff) for _ in range(tiles)]) for _ in range(n_layers)])
    offsets = rng.integers(0, t_len, tiles)
    neuron_file, file_meta, pattern = _shared_neuron_file(Path(shared or out.parent / f".{name}-neurons"),
                                                          n_layers, d, f, bits, seed, progress)
    rb = row_bytes(d, bits, 64)
    pattern_sums = row_sums(pattern[:, :len(BUNDLE) * rb].reshape(-1, len(BUNDLE), rb))  # (PATTERN_NEURONS, 3)
    with writing(out, force=True) as writer:
        writer.link_neurons(neuron_file, file_meta["sha256"])
        tokenizer.save(writer.root)
        np.savez(writer.path(TRACE), masks=np.packbits(masks, axis=-1), d_ff=traced_ff,
                 perms=perms.astype(np.int16), offsets=offsets, source_layer=np.arange(n_layers) % traced_layers)
        trace = Trace(writer.path(TRACE))
        wr = np.random.default_rng(seed + 2)
        writer.save_resident("globals", {"embed": (wr.standard_normal((512, d)) * 0.02).astype(np.float16),
                                         "norm": np.ones(d, np.float16)})
        layers = []
        for index in range(n_layers):
            layers.append(_synthetic_layer(index, d, trace, masks, hot_fraction, layout, neuron_file,
                                           file_meta["offsets"][index], pattern, pattern_sums, writer, rng, wr))
            if progress:
                progress(f"{name}: layer {index + 1}/{n_layers}")
        return writer.finish(
            config=_config(name, {}), source=f"synthetic:{name}", lsparse_version=__version__,
            created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            bundle=BundleLayout(components=tuple(BUNDLE), exact_prefix=EXACT_PREFIX, row_bytes=row_bytes(d, bits, 64),
                                stride=bundle_stride(d, len(BUNDLE), bits, 64), d_model=d, bits=bits, group_size=64),
            resident_bits=16, resident_group_size=64, predictor="trace", recall_target=None,
            calibration=Calibration(text="lsparse calibration stories (traced)", tokens=t_len, held_out_tokens=0),
            options={"bits": bits, "hot_fraction": hot_fraction, "layout": layout, "trace_tokens": trace_tokens,
                     "seed": seed},
            layers=tuple(layers),
            synthetic=Synthetic(name=name, trace_model=TRACE_MODEL, trace_tokens=t_len, tiles=tiles,
                                note="random weights; neuron masks replayed from the built-in model's recorded "
                                     "activations. No quality figure applies."))
