"""lsparse compile: quantization, bundles, layout, predictors, the image format, and damaged images."""

from __future__ import annotations

import errno
import json
import shutil

import numpy as np
import pytest

from lsparse.calibrate.layout import coactivation_order
from lsparse.errors import LsparseError
from lsparse.image import compile as compile_module
from lsparse.image.bundles import decode_bundles, encode_bundles, read_stats
from lsparse.image.compile import CompileOptions, compile_image
from lsparse.image.image import Image
from lsparse.image.quantize import dequantize_rows, quantize_rows
from lsparse.source import resolve
from lsparse.source.safetensors_store import SafetensorsFile
from tests.conftest import lsparse, shared_file
from tests.models import TINY_LLAMA, write_tiny_llama, write_tiny_opt


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_quantized_rows_match_mlx_and_bound_the_error(bits, group_size):
    import mlx.core as mx
    w = np.random.default_rng(bits).standard_normal((7, 128)).astype(np.float32)
    got = dequantize_rows(quantize_rows(w, bits, group_size), 128, bits, group_size)
    q = mx.quantize(mx.array(w.astype(np.float16)), group_size=group_size, bits=bits)
    ref = np.array(mx.dequantize(*q, group_size=group_size, bits=bits).astype(mx.float32))
    np.testing.assert_allclose(got, ref, atol=2e-3 * np.abs(ref).max())  # MLX rounds its result to fp16
    # within one step of each group's grid (MLX moves the grid so that zero is on it, so not always half a step)
    step = np.abs(np.array(q[1].astype(mx.float32)))
    assert (np.abs(got - w).reshape(7, -1, group_size) <= step[..., None] * 1.01 + 2e-3).all()


def test_fp16_rows_round_trip_exactly():
    w = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(dequantize_rows(quantize_rows(w, 16), 64, 16), w)


def test_bundles_hold_each_neurons_rows_and_column():
    rng = np.random.default_rng(0)
    w = {"gate": rng.standard_normal((10, 64)), "up": rng.standard_normal((10, 64)),
         "down": rng.standard_normal((64, 10))}
    neurons = np.array([7, 2, 5])
    data = encode_bundles(w, ("up", "down", "gate"), neurons, 16, 64)
    assert data.shape == (3, 384) and data.shape[1] % 64 == 0
    rows = decode_bundles(data, ("up", "down", "gate"), 64, 16, 64)
    np.testing.assert_allclose(rows["down"], w["down"][:, neurons].T, atol=1e-2)
    np.testing.assert_allclose(rows["gate"], w["gate"][neurons], atol=1e-2)


def test_coactivation_order_needs_fewer_reads_than_natural_order():
    """Neurons that fire in groups, scattered over the ids: the chain puts each group together."""
    rng = np.random.default_rng(0)
    groups = rng.permutation(256).reshape(32, 8)
    active = np.zeros((400, 256), dtype=bool)
    for t in range(400):
        for g in rng.choice(32, 3, replace=False):
            active[t, groups[g]] = True
    train, held = active[:300], active[300:]
    natural = np.arange(256)
    placed = np.empty(256, dtype=int)
    placed[coactivation_order(train)] = np.arange(256)
    before, after = read_stats(held, natural, 512, 0), read_stats(held, placed, 512, 0)
    assert after["reads_per_token"] < before["reads_per_token"] / 4
    assert after["mean_read_bytes"] > 4 * before["mean_read_bytes"]
    assert after["bytes_read_per_token"] == before["bytes_read_per_token"]  # no gaps read: same bytes


@pytest.fixture(scope="module")
def tiny_relu_llama(tmp_path_factory):
    folder = tmp_path_factory.mktemp("relu") / "llama"
    return write_tiny_llama(folder, {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 256},
                            tokenizer=shared_file("stories260K/tok512.model"))


def options(**kw):
    base = dict(calib=shared_file("tinystories/validation_100.txt"), calib_tokens=1024, window=128, bits=16,
                predictor="svd", rank=8)
    return CompileOptions(**{**base, **kw})


def test_compile_tiny_relu_llama_then_verify_and_inspect(tiny_relu_llama, tmp_path):
    image = tmp_path / "image"
    manifest = compile_image(str(tiny_relu_llama), str(image), options(hot_fraction=0.25))
    assert Image.open(image).verify() == []
    checkpoint = resolve(str(tiny_relu_llama))
    for layer in manifest.layers:
        assert sorted(layer.hot.tolist() + layer.cold_order.tolist()) == list(range(256))
        assert len(layer.hot) == 64 and layer.region.offset % 4096 == 0
        assert layer.threshold == 0.0  # ReLU: exact zeros
        # the hot bundles in RAM are the checkpoint's rows, in fp16
        hot = SafetensorsFile(image / "resident" / f"layer-{layer.index:03d}.safetensors").get("hot_bundles")
        rows = decode_bundles(hot.astype(np.uint8), ("up", "down", "gate"), 64, 16, 64)
        up = checkpoint.tensors.get(f"model.layers.{layer.index}.mlp.up_proj.weight")
        np.testing.assert_allclose(rows["up"], up[layer.hot], atol=2e-3)
        q = layer.figures["predictor"]
        assert 0.9 <= q["recall"] <= 1.0 and 0 < q["precision"] <= 1
    assert (image / "tokenizer.model").exists() and (image / "tokenizer_config.json").exists()
    result = lsparse("inspect", str(image), "--json")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert len(summary["layers"]) == 2
    assert sum(c["share"] for c in summary["components"].values()) == pytest.approx(1.0)
    assert lsparse("verify", str(image)).returncode == 0


def test_compile_tiny_opt_with_exact_gating(tmp_path):
    folder = write_tiny_opt(tmp_path / "opt", tokenizer=shared_file("stories260K/tok512.model"))
    manifest = compile_image(str(folder), str(tmp_path / "image"), options(predictor="exact"))
    assert manifest.bundle.components == ("down", "up") and manifest.bundle.exact_prefix == 1
    assert all(layer.figures["predictor"]["recall"] == 1.0 for layer in manifest.layers)
    assert Image.open(tmp_path / "image").verify() == []


@pytest.mark.parametrize("damage,message", [
    ("truncate", "neurons.bin: .* bytes, expected"),
    ("flip", "checksum mismatch"),
    ("version", "image format version 99; this lsparse reads versions 2 and 3"),
    ("manifest", "not an lsparse image"),
])
def test_damaged_images_are_refused(tiny_relu_llama, tmp_path, damage, message):
    image = tmp_path / "image"
    compile_image(str(tiny_relu_llama), str(image), options())
    if damage == "truncate":
        data = (image / "neurons.bin").read_bytes()
        (image / "neurons.bin").write_bytes(data[:-100])
    elif damage == "flip":
        path = image / "resident" / "layer-001.safetensors"
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))
    elif damage == "version":
        m = json.loads((image / "manifest.json").read_text())
        (image / "manifest.json").write_text(json.dumps({**m, "version": 99}))
    else:
        (image / "manifest.json").unlink()
    result = lsparse("verify", str(image))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    import re
    assert re.search(message, result.stderr), result.stderr


@pytest.mark.parametrize("kw,message", [
    ({"bits": 3}, "unsupported bit width 3"),
    ({"calib_tokens": 100}, "at least 256 are needed"),
    ({"bits": 4, "group_size": 128}, "need rows of a multiple of 128"),
])
def test_bad_compile_input_writes_nothing(tiny_relu_llama, tmp_path, kw, message):
    with pytest.raises(LsparseError, match=message):
        compile_image(str(tiny_relu_llama), str(tmp_path / "image"), options(**kw))
    assert list(tmp_path.iterdir()) == []


def test_existing_image_needs_force(tiny_relu_llama, tmp_path):
    compile_image(str(tiny_relu_llama), str(tmp_path / "image"), options())
    with pytest.raises(LsparseError, match="already exists"):
        compile_image(str(tiny_relu_llama), str(tmp_path / "image"), options())
    compile_image(str(tiny_relu_llama), str(tmp_path / "image"), options(force=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image"] and Image.open(tmp_path / "image").verify() == []


@pytest.mark.parametrize("fault", [KeyboardInterrupt(), OSError(errno.ENOSPC, "No space left on device")])
def test_interrupted_or_full_disk_leaves_nothing(tiny_relu_llama, tmp_path, monkeypatch, fault):
    real = compile_module._compile_layer

    def failing(cal, *args, **kw):
        if cal.index == 1:
            raise fault
        return real(cal, *args, **kw)

    monkeypatch.setattr(compile_module, "_compile_layer", failing)
    expected = KeyboardInterrupt if isinstance(fault, KeyboardInterrupt) else LsparseError
    with pytest.raises(expected, match=None if expected is KeyboardInterrupt else "disk is full"):
        compile_image(str(tiny_relu_llama), str(tmp_path / "image"), options())
    assert list(tmp_path.iterdir()) == []
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_presets_load_and_the_command_line_wins(tiny_relu_llama, tmp_path):
    from lsparse.image.compile import load_preset
    assert load_preset("swiglu-threshold")["threshold_sparsity"] == 0.4
    (tmp_path / "mine.toml").write_text("bits = 16\npredictor = 'svd'\nrank = 4\nhot_fraction = 0.5\n")
    result = lsparse("compile", str(tiny_relu_llama), "-o", str(tmp_path / "image"), "--config",
                     str(tmp_path / "mine.toml"), "--hot-fraction", "0.25", "--calib-tokens", "512")
    assert result.returncode == 0, result.stderr
    manifest = Image.open(tmp_path / "image").manifest
    assert manifest.bundle.bits == 16 and manifest.predictor == "svd"
    assert len(manifest.layers[0].hot) == 64  # 0.25 of 256, from the command line, not the preset's 0.5
    (tmp_path / "bad.toml").write_text("bitz = 4\n")
    bad = lsparse("compile", str(tiny_relu_llama), "-o", str(tmp_path / "other"), "--config",
                  str(tmp_path / "bad.toml"))
    assert bad.returncode == 1 and "unknown key(s) bitz" in bad.stderr and not (tmp_path / "other").exists()


def test_pack_round_trips_and_refuses_damage(tiny_relu_llama, tmp_path):
    from lsparse.image.pack import pack, unpack
    image = tmp_path / "image"
    compile_image(str(tiny_relu_llama), str(image), options(bits=4))
    sizes = pack(image, tmp_path / "image.lsimg.zst")
    assert 0 < sizes["packed_bytes"] < sizes["image_bytes"]
    unpack(tmp_path / "image.lsimg.zst", tmp_path / "copy")
    for name in Image.open(image).manifest.files:
        assert (tmp_path / "copy" / name).read_bytes() == (image / name).read_bytes()

    data = (tmp_path / "image.lsimg.zst").read_bytes()
    (tmp_path / "cut.zst").write_bytes(data[: len(data) // 2])
    with pytest.raises(LsparseError, match="not a complete lsparse pack"):
        unpack(tmp_path / "cut.zst", tmp_path / "cut")
    # a neuron region altered before packing: the pack is whole, the image inside is not
    neurons = image / "neurons.bin"
    raw = bytearray(neurons.read_bytes())
    raw[Image.open(image).manifest.layers[0].region.offset] ^= 0xFF
    neurons.write_bytes(bytes(raw))
    pack(image, tmp_path / "altered.zst")
    with pytest.raises(LsparseError, match="damaged"):
        unpack(tmp_path / "altered.zst", tmp_path / "altered")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["altered.zst", "copy", "cut.zst", "image",
                                                         "image.lsimg.zst"]


def test_predictor_training_reports_its_progress(tiny_relu_llama, tmp_path):
    calls, layers = [], []
    compile_image(str(tiny_relu_llama), str(tmp_path / "image"),
                  options(predictor="lowrank", predictor_epochs=3, calib_tokens=512),
                  progress=lambda done, total: layers.append((done, total)),
                  training_progress=lambda *call: calls.append(call))
    n = layers[-1][1]
    assert layers == [(i + 1, n) for i in range(n)]
    assert calls == [(layer, epoch, 3) for layer in range(n) for epoch in (1, 2, 3)]


def test_wanda_residency_pins_the_top_neurons_by_wanda_score(tmp_path):
    """--residency wanda: each layer's hot set is the top of sum_j |W_nj| ||X_j|| over the gate and up rows,
    with ||X_j|| the norm of the FFN's input channel j over the calibration tokens, here computed again from
    the dense model's forward pass; frequency residency picks mostly other neurons."""
    from lsparse.image.compile import calibration_windows
    from lsparse.model import llama, load_model
    source = "builtin:tinystories-reglu"
    for residency in ("wanda", "frequency"):
        compile_image(source, str(tmp_path / residency), CompileOptions(bits=4, predictor="svd", calib_tokens=2048,
                                                                        residency=residency))
    checkpoint = resolve(source)
    model = load_model(checkpoint, "numpy")
    windows, _ = calibration_windows(checkpoint.tokenizer, CompileOptions(calib_tokens=2048))
    squares = [0.0] * len(model.layers)

    def recording(i):
        def ffn(args, w, x, xp):
            squares[i] = squares[i] + (np.asarray(x, np.float64) ** 2).sum(0)
            return llama.ffn(args, w, x, xp)
        return ffn
    for window in windows:
        model(window, model.make_cache(len(window)), [recording(i) for i in range(len(model.layers))])
    overlap = {}
    for residency in ("wanda", "frequency"):
        for i, layer in enumerate(Image.open(tmp_path / residency).manifest.layers):
            norms = np.sqrt(squares[i])
            score = np.abs(model.layers[i]["gate"]) @ norms + np.abs(model.layers[i]["up"]) @ norms
            top = set(np.argsort(-score)[: len(layer.hot)])
            overlap.setdefault(residency, []).append(len(top & set(layer.hot)) / len(layer.hot))
    assert min(overlap["wanda"]) >= 0.95 and np.mean(overlap["frequency"]) < 0.5, overlap
