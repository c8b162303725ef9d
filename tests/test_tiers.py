"""Precision tiers (compile --hot-bits): the hot neurons' bundles at 8 bits, the cold ones' at 4, in one image.
The reference is the checkpoint with each neuron's rows put through MLX's own quantize and dequantize at its
tier's bits; the manifest records the tier and older images (format 2) still read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lsparse.image.compile import CompileOptions, compile_image
from lsparse.image.image import Image
from lsparse.image.manifest import MANIFEST, ManifestError, checksum
from lsparse.model import load_model
from lsparse.runtime.load import load_image
from lsparse.source import resolve
from tests.conftest import lsparse, shared_file
from tests.models import TINY_LLAMA, write_tiny_llama

OPTIONS = dict(calib_tokens=1024, window=128, bits=4, predictor="svd", rank=16, hot_fraction=0.25)


@pytest.fixture(scope="module")
def tiered(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiers")
    folder = write_tiny_llama(root / "llama", {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 256,
                                               "max_position_embeddings": 128},
                              tokenizer=shared_file("stories260K/tok512.model"))
    compile_image(str(folder), str(root / "image"),
                  CompileOptions(calib=shared_file("tinystories/validation_100.txt"), hot_bits=8, **OPTIONS))
    return folder, root / "image"


def mlx_round_trip(rows: np.ndarray, bits: int) -> np.ndarray:
    """(n, d) rows as MLX quantizes fp16 rows in groups of 64 and dequantizes them."""
    import mlx.core as mx
    q = mx.quantize(mx.array(rows.astype(np.float16)), group_size=64, bits=bits)
    return np.array(mx.dequantize(*q, group_size=64, bits=bits).astype(mx.float32))


def reference(folder, image, hot_bits: int):
    """The checkpoint as the image stores it: fp16 resident tensors; each FFN neuron's gate and up rows and down
    column at hot_bits where the neuron is hot, at 4 bits where cold (MLX's arithmetic, not lsparse's)."""
    model = load_model(resolve(str(folder)), "numpy")
    for weights in (model.globals, *model.layers):
        for name, t in weights.items():
            weights[name] = t.astype(np.float16).astype(np.float32)
    for layer, w in zip(Image.open(image).manifest.layers, model.layers, strict=True):
        for name in ("gate", "up", "down"):
            rows = (w[name].T if name == "down" else w[name]).copy()  # (d_ff, d_model)
            rows[layer.hot] = mlx_round_trip(rows[layer.hot], hot_bits)
            rows[layer.cold_order] = mlx_round_trip(rows[layer.cold_order], 4)
            w[name] = rows.T.copy() if name == "down" else rows
    return model


def logits(model, tokens):
    return model(tokens, model.make_cache(len(tokens)))


def test_hot_rows_at_their_tier_give_mlxs_model(tiered):
    folder, image = tiered
    tokens = list(np.random.default_rng(3).integers(3, 512, 24))
    want, untiered = logits(reference(folder, image, 8), tokens), logits(reference(folder, image, 4), tokens)
    scale = np.abs(want).max()
    for mode in ("dense", "exact", "hybrid"):
        got = logits(load_image(image, mode=mode)[0], tokens)
        error = np.abs(got - want).max()
        assert error < 2e-3 * scale, (mode, error)
        # the tiers matter at this tolerance: every neuron at 4 bits is far from the tiered model
        assert np.abs(got - untiered).max() > 10 * error, mode
    # predicted mode computes the hot tier whatever its mask: with every cold neuron predicted, dense's logits
    everything = load_image(image, mode="predicted", threshold_shift=-1e9)[0]
    np.testing.assert_allclose(logits(everything, tokens), want, atol=2e-3 * scale)


def test_the_manifest_records_the_tier_and_format_2_still_reads(tiered, tmp_path):
    _, image = tiered
    m = Image.open(image).manifest
    assert (m.bundle.bits, m.hot_bits, m.hot_bundle.bits) == (4, 8, 8)
    assert m.hot_bundle.stride > m.bundle.stride
    summary = json.loads(lsparse("inspect", str(image), "--json").stdout)
    assert summary["quantization"]["bits"] == 4 and summary["quantization"]["hot_bits"] == 8
    data = json.loads((image / MANIFEST).read_text())

    def parsed(**change):
        edited = {k: v for k, v in {**data, **change}.items() if v is not DROP}
        return type(m).from_json(json.dumps({**edited, "sha256": checksum(edited)}))
    older = parsed(version=2, hot_bits=DROP)  # before tiers: hot bundles at the bundle's precision
    assert older.hot_bits is None and older.hot_bundle == older.bundle
    for change in ({"version": 2}, {"hot_bits": 4}, {"hot_bits": 3}):
        with pytest.raises(ManifestError):
            parsed(**change)


DROP = object()


def test_compile_refuses_a_tier_no_finer_than_the_rest(tmp_path):
    for bad in (["--hot-bits", "4"], ["--hot-bits", "3"], ["--bits", "16", "--hot-bits", "8"]):
        done = lsparse("compile", "builtin:tinystories-reglu", "-o", str(tmp_path / "image"), *bad)
        assert done.returncode != 0 and done.stderr.startswith("error:") and done.stderr.count("\n") == 1, bad
        assert not (tmp_path / "image").exists()
