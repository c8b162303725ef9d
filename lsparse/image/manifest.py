"""An image's manifest (docs/IMAGE_FORMAT.md) as frozen dataclasses. `Manifest.from_json` is the one place that
reads manifest.json and the one function that checks every invariant (types, ranges, sizes, offsets inside
files, plain file names, its own checksum), as safetensors' validate does for its header; nothing outside
lsparse/image/ reads manifest keys."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

import numpy as np

from lsparse.errors import LsparseError
from lsparse.image.bundles import ALIGN_REGION, stride
from lsparse.image.quantize import check, row_bytes

FORMAT = "lsparse-image"
VERSION = 3  # 3 added hot_bits (version 2 images read as having none)
MANIFEST = "manifest.json"
NEURONS = "neurons.bin"
MAX_MANIFEST_BYTES = 256 << 20  # a 70B model's manifest is about 30 MB
PREDICTORS = ("exact", "svd", "lowrank", "trace")  # trace: a synthetic image's replayed masks
THRESHOLD_ON = ("gate", "product")
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")


class ManifestError(LsparseError):
    """The manifest breaks an invariant: the image is damaged or was not written by lsparse."""


@dataclass(frozen=True)
class FileEntry:
    size: int
    sha256: str


@dataclass(frozen=True)
class Region:
    """A layer's cold bundles in neurons.bin: `count` bundles of the layout's stride from `offset`."""
    offset: int
    count: int
    size: int
    sha256: str


@dataclass(frozen=True)
class BundleLayout:
    components: tuple[str, ...]  # a bundle's rows in file order (Llama: up, down, gate)
    exact_prefix: int            # the rows exact mode reads (the gate is resident there)
    row_bytes: int
    stride: int                  # bytes from one bundle to the next
    d_model: int
    bits: int
    group_size: int

    @classmethod
    def of(cls, components: tuple[str, ...], exact_prefix: int, d_model: int, bits: int,
           group_size: int) -> "BundleLayout":
        return cls(components, exact_prefix, row_bytes(d_model, bits, group_size),
                   stride(d_model, len(components), bits, group_size), d_model, bits, group_size)


@dataclass(frozen=True)
class Layer:
    index: int
    d_ff: int
    hot: np.ndarray = field(repr=False)         # (n_hot,) int64 neuron ids resident in RAM, ascending
    cold_order: np.ndarray = field(repr=False)  # (n_cold,) int64 neuron ids in file order
    region: Region
    threshold: float          # 0 for ReLU-family gates; SwiGLU: the magnitude cut (CATS)
    threshold_on: str         # "gate": |silu(gate)| > threshold; "product": |silu(gate) x up| > threshold
    predictor_rank: int | None
    predictor_threshold: float | None
    active_fraction: float          # of the calibration tokens
    max_active_fraction: float      # the most one calibration token needed
    max_predicted_fraction: float   # the most one held-out token's prediction loaded (exact: its active share)
    figures: dict = field(repr=False)  # compile's report: predictor quality, layout, quantization error


@dataclass(frozen=True)
class Calibration:
    text: str             # the calibration text's path
    tokens: int
    held_out_tokens: int  # the last tokens, kept apart for the figures compile reports


@dataclass(frozen=True)
class Synthetic:
    name: str             # synthetic:NAME
    trace_model: str      # the model whose recorded masks are replayed
    trace_tokens: int
    tiles: int            # traced layers per synthetic layer
    note: str


@dataclass(frozen=True)
class Manifest:
    config: dict = field(repr=False)  # the model's config.json
    source: str
    created: str
    lsparse_version: str
    bundle: BundleLayout
    hot_bits: int | None      # the hot neurons' bundles (resident) at this precision; None: the bundle's
    resident_bits: int        # 16: resident matrices (attention, embeddings) in fp16; 4 or 8: as rows, like bundles
    resident_group_size: int
    predictor: str            # one of PREDICTORS
    recall_target: float | None
    calibration: Calibration
    options: dict             # the compile options, so that bench can compile the source again with one changed
    files: dict[str, FileEntry]  # by plain relative name: every file but the manifest
    layers: tuple[Layer, ...]
    synthetic: Synthetic | None

    @property
    def is_synthetic(self) -> bool:
        return self.synthetic is not None

    def option(self, name: str, default=None):
        """A compile option the image was made with (images record every option bench may change)."""
        return self.options.get(name, default)

    def mean_predictor_quality(self) -> dict:
        """The compile-time, held-out predictor figures, averaged over layers."""
        q = [layer.figures["predictor"] for layer in self.layers]
        return {k: float(np.mean([x[k] for x in q])) for k in q[0] if isinstance(q[0][k], (int, float))}

    @property
    def hot_bundle(self) -> BundleLayout:
        """The layout of the hot neurons' bundles: the precision tier they are stored at."""
        b = self.bundle
        return b if self.hot_bits is None else BundleLayout.of(b.components, b.exact_prefix, b.d_model,
                                                                 self.hot_bits, b.group_size)

    def dense_ffn_bytes(self) -> int:
        """What a dense step reads of the FFN at the image's precision: every bundle of every layer."""
        return sum(len(layer.hot) * self.hot_bundle.stride + len(layer.cold_order) * self.bundle.stride
                   for layer in self.layers)

    @classmethod
    def from_json(cls, text: str | bytes, where: str = MANIFEST) -> "Manifest":
        """The manifest in `text`, every invariant checked; a ManifestError naming `where` otherwise."""
        from lsparse.image.manifest_json import parse
        return parse(text, where)

    def to_json(self) -> str:
        from lsparse.image.manifest_json import dump
        return dump(self)


def checksum(fields: dict) -> str:
    """The manifest's own checksum: SHA-256 of its canonical JSON without the checksum itself."""
    body = json.dumps({k: v for k, v in fields.items() if k != "sha256"}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()


def check_layers(layers: tuple[Layer, ...], bundle: BundleLayout, neurons_size: int, fail) -> None:
    """Each layer's neurons are split exactly into hot and cold, and its region holds its cold bundles, aligned,
    inside neurons.bin, apart from every other region."""
    ends = []
    for i, layer in enumerate(layers):
        if layer.index != i:
            fail(f"layer {i} has index {layer.index}")
        seen = np.zeros(layer.d_ff, dtype=np.int64)
        for ids in (layer.hot, layer.cold_order):
            if len(ids) and (ids.min() < 0 or ids.max() >= layer.d_ff):
                fail(f"layer {i} names a neuron outside 0..{layer.d_ff - 1}")
            np.add.at(seen, ids, 1)
        if (seen != 1).any():
            fail(f"layer {i}: hot and cold neurons do not split its {layer.d_ff} neurons exactly")
        if (np.diff(layer.hot) <= 0).any():
            fail(f"layer {i}: hot neurons are not ascending")
        r = layer.region
        if r.count != len(layer.cold_order) or r.size != r.count * bundle.stride or r.offset % ALIGN_REGION:
            fail(f"layer {i}: its region does not hold its {len(layer.cold_order)} cold bundles aligned")
        if r.offset + r.size > neurons_size:
            fail(f"layer {i}: its region ends past the end of {NEURONS}")
        ends.append((r.offset, r.offset + r.size))
    ends.sort()
    if any(b[0] < a[1] for a, b in zip(ends, ends[1:], strict=False)):
        fail("two layers' regions overlap")


def check_bundle(bundle: BundleLayout, arch, args, fail) -> None:
    if bundle.components != tuple(arch.BUNDLE) or bundle.exact_prefix != arch.EXACT_PREFIX:
        fail(f"bundle components {bundle.components} do not match the architecture's {tuple(arch.BUNDLE)}")
    if bundle.d_model != args.hidden_size:
        fail(f"bundle d_model {bundle.d_model} is not the config's hidden_size {args.hidden_size}")
    try:
        check(bundle.d_model, bundle.bits, bundle.group_size)
    except LsparseError as e:
        fail(str(e))
    want_row = row_bytes(bundle.d_model, bundle.bits, bundle.group_size)
    want_stride = stride(bundle.d_model, len(bundle.components), bundle.bits, bundle.group_size)
    if (bundle.row_bytes, bundle.stride) != (want_row, want_stride):
        fail(f"bundle row_bytes {bundle.row_bytes} and stride {bundle.stride} do not follow from its "
             f"geometry ({want_row} and {want_stride})")


def check_files(files: dict, n_layers: int, predictor: str, fail) -> None:
    """Plain names, one folder deep at most, and every file an image of this shape needs."""
    for name in files:
        parts = name.split("/")
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != "resident") or \
                not all(PLAIN_NAME.fullmatch(p) for p in parts):
            fail(f"file name {name!r} is not a plain name inside the image")
    needed = {NEURONS, "resident/globals.safetensors", *(f"resident/layer-{i:03d}.safetensors"
                                                         for i in range(n_layers))}
    if predictor == "trace":
        needed.add("trace.npz")
    missing = sorted(needed - set(files))
    if missing:
        fail(f"the files list lacks {', '.join(missing)}")
