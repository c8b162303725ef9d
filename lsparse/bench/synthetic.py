"""Synthetic images at real geometries, for what only shows at scale: reads, bytes and I/O time with bundles
of kilobytes and neuron files of gigabytes, and attention that costs what a 7B's costs.

Weights are random. Which neurons fire is not computed from them: it is replayed from the trained built-in
model's masks (lsparse/bench/trace_record.py): hot sets and the co-activation order come from the masks of
compile's training tokens, and decoding replays the held-out tokens' masks, so that the layout is measured out
of sample. Synthetic layer l replays built-in layer l mod 6; its neurons are tiles of the built-in layer's 256,
each tile with its own permutation and its own offset in the trace, so that tiles fire as different tokens of
the same model would.

- `synthetic:llama-2-7b`: Llama-2-7B's whole geometry (32 layers, d_model 4096, 32 heads of 128, d_ff 11008,
  vocabulary 32000, an untied head), attention and embeddings kept as 4-bit rows and multiplied by the same
  kernels as the FFN; a low-rank predictor of the real shape runs every token (its compute and RAM are real)
  and the masks the built-in model's trained predictor gave replay beside the true ones: its false positives
  are read, its misses counted.
- `synthetic:llama-7b-relu`: Llama-2-7B's FFN only (attention one 64-wide head, a 512-token vocabulary), the
  true masks replayed (an oracle predictor).

No quality figure applies to a synthetic image, and the bench says so.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from lsparse import __version__
from lsparse.bench import synthetic_parts as parts
from lsparse.bench.synthetic_parts import Geometry, llama_config
from lsparse.bench.trace_record import TRACE_MODEL, Recording, record
from lsparse.errors import LsparseError
from lsparse.image.manifest import Calibration, Layer, Region, Synthetic
from lsparse.image.trace import TRACE, Trace

GEOMETRIES = {
    "llama-2-7b": Geometry(llama_config(4096, 11008, 32, 32, 32, 128, 32000, tied=False), 4, True,
                           "Llama-2-7B's whole geometry, random weights; attention and embeddings 4-bit as "
                           "stored; masks replayed (held-out tokens) from the built-in model: the true ones and "
                           "its trained predictor's, which a predictor of the real shape stands in for"),
    "llama-7b-relu": Geometry(llama_config(4096, 11008, 32, 1, 1, 64, 512, tied=True), 16, False,
                              "Llama-2-7B's FFN geometry only (attention one 64-wide head, vocabulary 512), random "
                              "weights; true masks replayed (held-out tokens) from the built-in model: an oracle "
                              "predictor"),
    "tiny-relu": Geometry(llama_config(128, 768, 4, 1, 1, 64, 512, tied=True), 16, False, "for tests"),
    "tiny-2-7b": Geometry(llama_config(128, 768, 4, 2, 2, 64, 1000, tied=False), 4, True, "for tests"),
}
PATTERN_NEURONS = 512  # distinct random bundles, repeated through the neuron file: the bytes only need reading


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


@dataclass
class _Image:
    """What every layer of one synthetic image shares while it is written."""
    geometry: Geometry
    config: dict
    recording: Recording
    trace: Trace
    hot_fraction: float
    layout: str
    neuron_file: Path
    offsets: list            # each layer's region offset in the neuron file
    pattern: np.ndarray      # (PATTERN_NEURONS, stride) the bundles the neuron file repeats
    pattern_sums: np.ndarray  # (PATTERN_NEURONS, 3) their rows' checksums
    writer: object
    rng: object              # hot-set ties
    weights: object          # random weights


def _order(s: _Image, index: int) -> tuple[np.ndarray, np.ndarray]:
    """(hot neurons, cold neurons in file order) of a layer, from the layout part of the trace: each neuron's
    frequency and the traced layer's co-activation order, through its tile's permutation."""
    from lsparse.calibrate.layout import coactivation_order
    from lsparse.calibrate.residency import hot_set
    traced = s.recording.layout[:, s.trace.source_layer[index]]  # (layout tokens, traced d_ff)
    perms = s.trace.perms[index]                                 # (tiles, traced d_ff)
    f = perms.size
    frequency = np.concatenate([traced.mean(0)[p] for p in perms])
    hot = hot_set(frequency + 1e-9 * s.rng.random(f), s.hot_fraction)
    is_hot = np.zeros(f, bool)
    is_hot[hot] = True
    if s.layout == "coactivation":
        base = coactivation_order(traced)
        order = np.concatenate([k * perms.shape[1] + np.argsort(p)[base] for k, p in enumerate(perms)])
    else:
        order = np.arange(f)
    return hot, order[~is_hot[order]]


def _synthetic_layer(s: _Image, index: int) -> Layer:
    """One layer: its hot set and cold order, its region, its resident tensors written."""
    from lsparse.calibrate.predictors import layer_rank
    from lsparse.image.image import sha256_file
    hot, cold_order = _order(s, index)
    stride, d = s.pattern.shape[1], s.config["hidden_size"]
    size = len(cold_order) * stride
    offset = s.offsets[index]
    region = Region(offset=offset, count=len(cold_order), size=size, sha256=sha256_file(s.neuron_file, offset, size))
    rank = layer_rank(32, index, s.config["num_hidden_layers"]) if s.geometry.simulated_predictor else None
    s.writer.save_resident(f"layer-{index:03d}", {
        **parts.attention(s.config, s.geometry.resident_bits, s.weights),
        **(parts.predictor(d, len(hot) + len(cold_order), rank, s.weights) if rank else {}),
        "hot_bundles": np.ascontiguousarray(np.resize(s.pattern, (len(hot), stride))),
        # (n_cold, 3): position p of a region holds pattern bundle p mod PATTERN_NEURONS
        "cold_row_sums": s.pattern_sums[np.arange(len(cold_order)) % len(s.pattern)]})
    replayed = s.trace.all_masks(index, len(s.trace.masks))  # the held-out tokens' masks, as decoding sees them
    loaded = s.trace.all_masks(index, len(s.trace.masks), predicted=True) if rank else replayed
    return Layer(index=index, d_ff=len(hot) + len(cold_order), hot=hot, cold_order=cold_order, region=region,
                 threshold=0.0, threshold_on="gate", predictor_rank=rank, predictor_threshold=None,
                 active_fraction=float(replayed.mean()), max_active_fraction=float(replayed.mean(1).max()),
                 max_predicted_fraction=float(loaded.mean(1).max()),
                 figures={"predictor": {"predicted_fraction": float(loaded.mean()),
                                        "max_predicted_fraction": float(loaded.mean(1).max()),
                                        "recall": float((loaded & replayed).sum() / max(replayed.sum(), 1))}})


def _trace_file(writer, recording: Recording, n_layers: int, d_ff: int, rng) -> tuple[Trace, int]:
    """trace.npz: the held-out masks (and predicted ones), each layer's tile permutations and offsets."""
    tokens, traced_layers, traced_ff = recording.replay.shape
    tiles = d_ff // traced_ff
    if tiles * traced_ff != d_ff:
        raise LsparseError(f"d_ff {d_ff} is not a multiple of the traced model's {traced_ff}")
    perms = np.stack([np.stack([rng.permutation(traced_ff) for _ in range(tiles)]) for _ in range(n_layers)])
    extra = {} if recording.predicted is None else {"predicted": np.packbits(recording.predicted, axis=-1),
                                                    "ahead": np.packbits(recording.ahead, axis=-1)}
    np.savez(writer.path(TRACE), masks=np.packbits(recording.replay, axis=-1), d_ff=traced_ff,
             perms=perms.astype(np.int16), offsets=rng.integers(0, tokens, tiles),
             source_layer=np.arange(n_layers) % traced_layers, **extra)
    return Trace(writer.path(TRACE)), tiles


def write_synthetic(name: str, out, bits: int = 4, hot_fraction: float = 0.1, layout: str = "coactivation",
                    seed: int = 0, shared: Path | None = None, progress=None, layers: int | None = None):
    """Write the synthetic image `name` (with `layers` layers: its own number, or fewer for tests) to `out`;
    returns its Manifest. The neuron file of each precision, and the traced model's predictor, are kept once in
    `shared` (default: beside `out`), the neuron file hard-linked in, so that the ladder's variants cost no
    more disk."""
    from lsparse.image.bundles import row_sums
    from lsparse.image.quantize import check, row_bytes
    from lsparse.image.writer import writing
    from lsparse.model.llama import BUNDLE
    if name not in GEOMETRIES:
        raise LsparseError(f"unknown synthetic model {name!r} (known: {', '.join(GEOMETRIES)})")
    g = GEOMETRIES[name]
    config = {**g.config, "num_hidden_layers": layers or g.config["num_hidden_layers"]}
    d, f, n_layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    check(d, bits, 64)
    shared = Path(shared or Path(out).parent / f".{name}-neurons")
    recording = record(g.simulated_predictor, shared)
    neuron_file, file_meta, pattern = _shared_neuron_file(shared, n_layers, d, f, bits, seed, progress)
    rb = row_bytes(d, bits, 64)
    rng = np.random.default_rng(seed)
    with writing(out, force=True) as writer:
        writer.link_neurons(neuron_file, file_meta["sha256"])
        parts.tokenizer(config["vocab_size"], recording.tokenizer).save(writer.root)
        trace, tiles = _trace_file(writer, recording, n_layers, f, rng)
        weights = np.random.default_rng(seed + 2)
        writer.save_resident("globals", parts.embeddings(config, g.resident_bits, weights))
        s = _Image(g, config, recording, trace, hot_fraction, layout, neuron_file, file_meta["offsets"], pattern,
                   row_sums(pattern[:, :len(BUNDLE) * rb].reshape(-1, len(BUNDLE), rb)), writer, rng, weights)
        written = []
        for index in range(n_layers):
            written.append(_synthetic_layer(s, index))
            if progress:
                progress(f"{name}: layer {index + 1}/{n_layers}")
        return writer.finish(**_manifest_fields(name, g, config, bits, written, recording, tiles,
                                                {"bits": bits, "hot_fraction": hot_fraction, "layout": layout,
                                                 "seed": seed, "layers": layers}))


def _manifest_fields(name, g: Geometry, config, bits, layers, recording: Recording, tiles, options) -> dict:
    from lsparse.image.manifest import BundleLayout
    from lsparse.model.llama import BUNDLE, EXACT_PREFIX
    d = config["hidden_size"]
    recall = "" if recording.predictor_recall is None else f"; predictor recall {recording.predictor_recall:.3f}"
    return dict(
        config=config, source=f"synthetic:{name}", lsparse_version=__version__,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        bundle=BundleLayout.of(tuple(BUNDLE), EXACT_PREFIX, d, bits, 64), hot_bits=None,
        resident_bits=g.resident_bits, resident_group_size=64, predictor="trace", recall_target=None,
        calibration=Calibration(text="lsparse calibration stories (traced)", tokens=len(recording.layout) +
                                len(recording.replay), held_out_tokens=len(recording.replay)),
        options=options, layers=tuple(layers),
        synthetic=Synthetic(name=name, trace_model=TRACE_MODEL, trace_tokens=len(recording.replay), tiles=tiles,
                            note=f"{g.note}{recall}. No quality figure applies."))
