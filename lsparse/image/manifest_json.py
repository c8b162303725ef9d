"""manifest.json to and from the Manifest dataclasses: each JSON object holds exactly its dataclass's fields,
each value of the field's declared type, so that one table of types reads the whole format."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np

from lsparse.errors import LsparseError
from lsparse.image.manifest import (
    FORMAT,
    MAX_MANIFEST_BYTES,
    NEURONS,
    PREDICTORS,
    THRESHOLD_ON,
    VERSION,
    BundleLayout,
    Calibration,
    FileEntry,
    Layer,
    Manifest,
    ManifestError,
    Region,
    Synthetic,
    check_bundle,
    check_files,
    check_layers,
    checksum,
)
from lsparse.image.quantize import check

SHA256 = re.compile(r"[0-9a-f]{64}")
RECORDS = {"Region": Region, "BundleLayout": BundleLayout, "FileEntry": FileEntry, "Layer": Layer,
           "Calibration": Calibration, "Synthetic": Synthetic}


def _value(value, kind: str, at: str, fail):
    """`value` as the declared type `kind` (a field annotation), or a failure naming where it is."""
    if kind.endswith(" | None"):
        return None if value is None else _value(value, kind.removesuffix(" | None"), at, fail)
    if kind == "int" and type(value) is int and value >= 0:
        return value
    if kind == "float" and type(value) in (int, float) and math.isfinite(value):
        return float(value)
    if (kind, type(value)) in (("str", str), ("dict", dict)):
        return value
    if kind == "tuple[str, ...]" and isinstance(value, list) and all(type(v) is str for v in value):
        return tuple(value)
    if kind == "np.ndarray" and isinstance(value, list) and all(type(v) is int for v in value):
        ids = np.array(value, dtype=np.int64)
        ids.flags.writeable = False
        return ids
    if kind in RECORDS:
        return _record(RECORDS[kind], value, at, fail)
    if kind == "tuple[Layer, ...]" and isinstance(value, list):
        return tuple(_record(Layer, v, f"{at}[{i}]", fail) for i, v in enumerate(value))
    if kind == "dict[str, FileEntry]" and isinstance(value, dict):
        return {name: _record(FileEntry, v, f"{at}[{name!r}]", fail) for name, v in value.items()}
    fail(f"{at} is not a {kind.replace('np.ndarray', 'list of neuron ids')}")


def _record(cls, value, at: str, fail):
    if not isinstance(value, dict):
        fail(f"{at} is not an object")
    names = [f.name for f in dataclasses.fields(cls)]
    if sorted(value) != sorted(names):
        odd = sorted(set(value) ^ set(names))
        fail(f"{at} has the wrong fields ({', '.join(odd)})")
    out = {f.name: _value(value[f.name], f.type, f"{at}.{f.name}", fail) for f in dataclasses.fields(cls)}
    if "sha256" in out and not SHA256.fullmatch(out["sha256"]):
        fail(f"{at}.sha256 is not a SHA-256 in hex")
    return cls(**out)


def parse(text: str | bytes, where: str) -> Manifest:
    def fail(why: str):
        raise ManifestError(f"{where}: {why}; the image is damaged or was not written by lsparse")

    if len(text) > MAX_MANIFEST_BYTES:
        fail(f"{len(text)} bytes, more than any image needs")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError; nesting too deep
        fail(f"not readable JSON ({str(e)[:80]})")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise LsparseError(f"{where}: not an lsparse image manifest")
    if data.get("version") not in (2, VERSION):
        raise LsparseError(f"{where}: image format version {data.get('version')!r}; this lsparse reads versions 2 "
                           f"and {VERSION}: compile the image again")
    if data.get("sha256") != checksum(data):
        fail("its contents do not match its own checksum (altered)")
    if data["version"] == 2:  # before precision tiers: the hot bundles at the bundle's precision
        if "hot_bits" in data:
            fail("version 2 has no hot_bits")
        data = {**data, "hot_bits": None}
    manifest = _record(Manifest, {k: v for k, v in data.items() if k not in ("format", "version", "sha256")},
                       "manifest", fail)
    _check(manifest, fail)
    return manifest


def _check(m: Manifest, fail) -> None:
    """The invariants between fields."""
    from lsparse.model import architecture
    try:
        arch, args = architecture(m.config)
    except LsparseError as e:
        fail(f"config: {e}")
    check_bundle(m.bundle, arch, args, fail)
    if m.hot_bits is not None:
        try:
            check(m.bundle.d_model, m.hot_bits, m.bundle.group_size)
        except LsparseError as e:
            fail(f"hot bundles: {e}")
        if m.hot_bits == m.bundle.bits:
            fail("hot_bits equals the bundle's bits (null says so)")
    if m.resident_bits != 16:
        try:
            check(args.hidden_size, m.resident_bits, m.resident_group_size)
        except LsparseError as e:
            fail(f"resident matrices: {e}")
    if m.predictor not in PREDICTORS or (m.predictor == "trace") != (m.synthetic is not None):
        fail(f"predictor {m.predictor!r} (known: {', '.join(PREDICTORS)}; trace only for synthetic images)")
    if len(m.layers) != args.num_hidden_layers:
        fail(f"{len(m.layers)} layers where the config has {args.num_hidden_layers}")
    learned = m.predictor in ("svd", "lowrank")
    for layer in m.layers:
        fractions = (layer.active_fraction, layer.max_active_fraction, layer.max_predicted_fraction)
        # learned predictors have a rank and a threshold; exact gating neither; a synthetic image's simulated
        # predictor a rank (its compute is real) and no threshold (its masks are replayed)
        ranked = layer.predictor_rank is not None
        if layer.d_ff != args.intermediate_size or layer.threshold < 0 or layer.threshold_on not in THRESHOLD_ON \
                or not all(0 <= f <= 1 for f in fractions) or (layer.predictor_threshold is not None) != learned \
                or (m.predictor != "trace" and ranked != learned):
            fail(f"layer {layer.index}: its size, threshold, figures or predictor fields are out of range")
    check_files(m.files, len(m.layers), m.predictor, fail)
    check_layers(m.layers, m.bundle, m.files[NEURONS].size, fail)


def _plain(value):
    """A value as JSON holds it."""
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def dump(manifest: Manifest) -> str:
    data = {"format": FORMAT, "version": VERSION, **_plain(manifest)}
    data["sha256"] = checksum(data)
    return json.dumps(data) + "\n"
