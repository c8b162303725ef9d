"""lsparse run on an image: exact mode equals dense, the window bounds what is read, faults end cleanly."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lsparse.image.compile import CompileOptions, compile_image
from lsparse.kernels.proof import clang
from lsparse.runtime.load import load_image
from tests.conftest import LSPARSE, lsparse, shared_file
from tests.models import TINY_LLAMA, write_tiny_llama, write_tiny_opt


@pytest.fixture(scope="module")
def relu_image(tmp_path_factory):
    root = tmp_path_factory.mktemp("run")
    folder = write_tiny_llama(root / "llama", {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 256,
                                               "max_position_embeddings": 512},
                              tokenizer=shared_file("stories260K/tok512.model"))
    options = CompileOptions(calib=shared_file("tinystories/validation_100.txt"), calib_tokens=1024, window=128,
                             bits=8, predictor="svd", rank=16, hot_fraction=0.1)
    compile_image(str(folder), str(root / "image"), options)
    return root / "image"


def logits(model, tokens):
    cache = model.make_cache(len(tokens))
    return np.concatenate([model(tokens[:4], cache)] + [model([t], cache) for t in tokens[4:]])


def test_exact_mode_equals_dense_from_the_same_image(relu_image):
    tokens = list(np.random.default_rng(0).integers(3, 512, 40))
    exact, _ = load_image(relu_image, mode="exact")
    dense, _ = load_image(relu_image, mode="dense")
    a, b = logits(exact, tokens), logits(dense, tokens)
    np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max())
    assert sum(s.bytes_read for s in exact.costs.steps) > 0  # cold neurons really came from the file


def test_exact_greedy_run_matches_dense(relu_image):
    exact = json.loads(lsparse("run", str(relu_image), "-m", "48", "--json").stdout)
    dense = json.loads(lsparse("run", str(relu_image), "--dense", "-m", "48", "--json").stdout)
    one_reader = json.loads(lsparse("run", str(relu_image), "-m", "48", "--readers", "1", "--json").stdout)
    assert exact["tokens"] == dense["tokens"] == one_reader["tokens"] and len(exact["tokens"]) > 0
    f = exact["flash"]
    # neurons of the last 5 tokens are kept: some lookups hit, and a text of 48 tokens needs new ones too
    assert 0 < f["bytes_read_per_token"] <= f["dense_ffn_bytes"] and 0 < f["cache_hit_rate"] < 1


def test_a_larger_window_never_reads_more(relu_image):
    tokens = list(np.random.default_rng(1).integers(3, 512, 60))
    read = []
    for window in (1, 2, 4, 8):
        model, _ = load_image(relu_image, mode="exact", window=window)
        logits(model, tokens)
        read.append(sum(s.bytes_read for s in model.costs.steps[1:]))
    assert all(a >= b for a, b in zip(read, read[1:], strict=False)) and read[0] > read[-1]


def test_rows_read_apart_change_requests_not_results(relu_image):
    """The unbundled ablation reads each row of each neuron on its own: the same rows must arrive."""
    tokens = list(np.random.default_rng(7).integers(3, 512, 30))
    bundled, _ = load_image(relu_image, mode="exact", window=2)
    apart, _ = load_image(relu_image, mode="exact", window=2, bundled=False)
    np.testing.assert_array_equal(logits(bundled, tokens), logits(apart, tokens))
    assert sum(s.requests for s in apart.costs.steps) > sum(s.requests for s in bundled.costs.steps)


def test_hot_neurons_computed_while_reading_change_nothing_computed(relu_image, monkeypatch):
    """With a large hot set, a layer computes its hot neurons while its cold reads are in flight: the same
    logits and bytes, the reads' time kept apart from the time waited for them."""
    from lsparse.runtime import ffn_paged
    tokens = list(np.random.default_rng(8).integers(3, 512, 30))
    plain, _ = load_image(relu_image, mode="exact", window=2)
    assert not any(f.overlap for f in plain.ffns)  # this model's hot sets are small
    monkeypatch.setattr(ffn_paged, "OVERLAP_MIN_WEIGHTS", 0)
    overlapped, _ = load_image(relu_image, mode="exact", window=2)
    assert all(f.overlap for f in overlapped.ffns)
    np.testing.assert_array_equal(logits(plain, tokens), logits(overlapped, tokens))
    for key in ("bytes_read", "requests", "hits"):
        assert [getattr(s, key) for s in plain.costs.steps] == [getattr(s, key) for s in overlapped.costs.steps]
    assert sum(s.read_s for s in overlapped.costs.steps) > 0
    overlapped.close()


def test_lookahead_changes_reads_not_results(relu_image):
    tokens = list(np.random.default_rng(6).integers(3, 512, 40))
    plain, _ = load_image(relu_image, mode="exact", window=2)
    ahead, _ = load_image(relu_image, mode="exact", window=2, lookahead=True)
    np.testing.assert_array_equal(logits(plain, tokens), logits(ahead, tokens))

    def total(model, key):
        return sum(getattr(s, key) for s in model.costs.steps)

    assert total(ahead, "bytes_needed") == total(plain, "bytes_needed")
    assert total(ahead, "lookahead_used") > 0  # some neurons came from a read started a layer early


def test_dense_mode_computes_what_the_model_does_with_the_decoded_weights(relu_image):
    """Dense mode goes through the kernel backend; the model's own FFN on the image's decoded rows is the
    independent reference."""
    from lsparse.image.bundles import decode_bundles
    from lsparse.model import Model
    from lsparse.source.safetensors_store import SafetensorsFile
    tokens = list(np.random.default_rng(8).integers(3, 512, 20))
    dense, _ = load_image(relu_image, mode="dense")
    # the image read apart from lsparse's reader: its manifest as JSON, its files as bytes
    meta = json.loads((relu_image / "manifest.json").read_text())
    b = meta["bundle"]
    neurons = np.fromfile(relu_image / "neurons.bin", dtype=np.uint8)
    layers = []
    for layer, weights in zip(meta["layers"], dense.model.layers, strict=True):
        hot = SafetensorsFile(relu_image / "resident" / f"layer-{layer['index']:03d}.safetensors").get(
            "hot_bundles", as_float=False)
        r = layer["region"]
        cold = neurons[r["offset"]:r["offset"] + r["size"]].reshape(r["count"], b["stride"])
        order = np.argsort(np.concatenate([layer["hot"], layer["cold_order"]]))
        rows = decode_bundles(np.concatenate([hot, cold])[order], tuple(b["components"]), b["d_model"],
                              b["bits"], b["group_size"])
        layers.append({**weights, "gate": rows["gate"], "up": rows["up"], "down": rows["down"].T.copy()})
    reference = Model(dense.model.arch, dense.model.args, dense.model.globals, layers, np)
    want = reference(tokens, reference.make_cache(len(tokens)))
    np.testing.assert_allclose(dense(tokens, dense.make_cache(len(tokens))), want, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("kernels", ["mlx", "reference"])
@pytest.mark.parametrize("mode", ["exact", "predicted", "hybrid", "dense"])
def test_every_kernel_backend_computes_what_the_cpu_path_does_in_every_mode(relu_image, mode, kernels):
    """mlx keeps rows 8-bit and multiplies with MLX; reference is the Metal backend (slot lists of a fixed
    capacity, rows as stored in MLX arrays, compaction for exact gating) with each Metal kernel call answered
    by the numpy reference."""
    tokens = list(np.random.default_rng(7).integers(3, 512, 24))
    cpu_model, _ = load_image(relu_image, mode=mode, kernels="cpu")
    other, _ = load_image(relu_image, mode=mode, kernels=kernels)
    assert other.kernels.name == kernels and cpu_model.kernels.name == "cpu"
    want = logits(cpu_model, tokens)
    np.testing.assert_allclose(logits(other, tokens), want, atol=1e-5 * np.abs(want).max())
    if mode in ("exact", "predicted"):
        assert sum(s.bytes_read for s in other.costs.steps) > 0  # neurons went through the cache's slot lists
    # both keep this 8-bit image's rows as stored: about a quarter of the RAM of fp32 rows (plan with None)
    from lsparse.image.image import Image
    from lsparse.runtime.options import DecodeOptions
    from lsparse.runtime.plan import plan
    fp32 = plan(Image.open(relu_image).manifest, None, DecodeOptions(mode=mode))
    assert other.memory_plan.hot_neurons < 0.3 * fp32.hot_neurons


@pytest.mark.parametrize("mode", ["exact", pytest.param("predicted", marks=pytest.mark.slow)])
def test_the_runtime_runs_the_exact_metal_source_in_the_emulator(relu_image, mode):
    """The Metal backend as on a Mac, but each kernel call runs the exact source MLX would compile, in the CPU
    emulator under ASan and UBSan: the runtime's slot lists, padding and buffers, checked end to end."""
    if clang() is None:
        pytest.skip("clang++ is absent (`make proof-tools` installs Debian's)")
    tokens = list(np.random.default_rng(9).integers(3, 512, 5))
    cpu_model, _ = load_image(relu_image, mode=mode, kernels="cpu")
    emulated, _ = load_image(relu_image, mode=mode, kernels="emulated")
    want = logits(cpu_model, tokens)
    np.testing.assert_allclose(logits(emulated, tokens), want, atol=1e-5 * np.abs(want).max())
    assert sum(s.bytes_read for s in emulated.costs.steps) > 0


@pytest.fixture(scope="module", params=[32, 128])
def grouped_image(request, tmp_path_factory):
    """A 4-bit image at groups of 32 (the built-in model) or 128 (a ReLU Llama of width 128: the built-in
    model's rows, 64 wide, cannot hold a group of 128)."""
    root = tmp_path_factory.mktemp(f"group{request.param}")
    source = "builtin:tinystories-reglu"
    if request.param == 128:
        source = str(write_tiny_llama(root / "llama", {**TINY_LLAMA, "hidden_size": 128, "intermediate_size": 512,
                                                       "max_position_embeddings": 512},
                                      tokenizer=shared_file("stories260K/tok512.model")))
    compile_image(source, str(root / "image"), CompileOptions(
        bits=4, group_size=request.param, predictor="svd", calib=shared_file("tinystories/validation_100.txt"),
        calib_tokens=1024))
    return root / "image"


@pytest.mark.parametrize("mode", ["exact", pytest.param("predicted", marks=pytest.mark.slow)])
def test_images_at_groups_of_32_and_128_decode_alike_through_cpu_reference_and_emulated(grouped_image, mode):
    """The Metal kernels' group size follows the image (a template parameter): the same greedy tokens from
    the C kernels, the Metal backend answered by numpy, and the exact Metal source in the emulator."""
    from lsparse.runtime.generate import generate
    greedy = lambda logits: int(np.argmax(logits))  # noqa: E731
    backends = ["cpu", "reference"] + (["emulated"] if clang() is not None else [])
    runs = {}
    for kernels in backends:
        model, tok = load_image(grouped_image, mode=mode, kernels=kernels)
        runs[kernels] = generate(model, tok, tok.encode("Once upon a time"), 6, greedy, set())
    assert all(run == runs["cpu"] for run in runs.values()) and len(runs["cpu"]) == 6, runs


def test_predicted_mode_runs_and_reports(relu_image):
    """With a window of one token every token reads its neurons; without a window, neurons stay until the
    cache is full (here: never), so later tokens read less, and nothing once every neuron has been seen."""
    runs = {}
    for window in ("1", None):
        result = lsparse("run", str(relu_image), "--mode", "predicted", "-m", "16", "--json",
                         *(["--window", window] if window else []))
        assert result.returncode == 0, result.stderr
        runs[window] = json.loads(result.stdout)
    f = runs["1"]["flash"]
    assert runs["1"]["generated_tokens"] > 0 and f["reads_per_token"] > 0
    assert 0 < f["bytes_read_per_token"] < f["dense_ffn_bytes"]
    assert runs[None]["flash"]["bytes_read_per_token"] < f["bytes_read_per_token"]
    assert runs[None]["flash"]["cache_hit_rate"] > f["cache_hit_rate"]


def test_opt_image_exact_equals_dense(tmp_path):
    folder = write_tiny_opt(tmp_path / "opt", tokenizer=shared_file("stories260K/tok512.model"))
    options = CompileOptions(calib=shared_file("tinystories/validation_100.txt"), calib_tokens=1024, window=100,
                             bits=16, predictor="svd", rank=8)
    compile_image(str(folder), str(tmp_path / "image"), options)
    tokens = list(np.random.default_rng(2).integers(3, 512, 24))
    exact, dense = load_image(tmp_path / "image", mode="exact")[0], load_image(tmp_path / "image", mode="dense")[0]
    b = logits(dense, tokens)
    np.testing.assert_allclose(logits(exact, tokens), b, atol=1e-4 * np.abs(b).max())


def test_swiglu_exact_mode_is_exact_against_its_cats_threshold(tmp_path):
    """SwiGLU has no exact zeros: compile cuts the smallest |silu(gate)| (CATS) and exact mode, with the gate
    resident, must compute exactly that thresholded FFN, which hybrid mode computes over every neuron."""
    folder = write_tiny_llama(tmp_path / "swiglu", {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 256,
                                                    "hidden_act": "silu", "max_position_embeddings": 128},
                              tokenizer=shared_file("stories260K/tok512.model"))
    options = CompileOptions(calib=shared_file("tinystories/validation_100.txt"), calib_tokens=1024, window=100,
                             bits=8, predictor="svd", rank=8, threshold_sparsity=0.6)
    compile_image(str(folder), str(tmp_path / "image"), options)
    tokens = list(np.random.default_rng(5).integers(3, 512, 24))
    exact, hybrid = load_image(tmp_path / "image", mode="exact")[0], load_image(tmp_path / "image", mode="hybrid")[0]
    dense = load_image(tmp_path / "image", mode="dense")[0]
    a, b, c = logits(exact, tokens), logits(hybrid, tokens), logits(dense, tokens)
    np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max())
    assert np.abs(a - c).max() > 1e-3 * np.abs(c).max()  # the threshold really cuts something
    read = sum(s.bytes_needed for s in exact.costs.steps[1:]) / (len(exact.costs.steps) - 1)
    assert 0 < read < 0.6 * exact.dense_ffn_bytes()


def test_swiglu_product_threshold_runs_the_thresholded_model_and_refuses_exact_mode(tmp_path):
    """--threshold-on product cuts by |silu(gate) x up|: hybrid mode must compute exactly the dense model with
    those per-layer cuts, and exact mode, which cannot know the mask from the gate alone, must refuse."""
    from lsparse.calibrate.activations import thresholded_ffns
    from lsparse.errors import LsparseError
    from lsparse.image.image import Image
    from lsparse.model import load_model
    from lsparse.source import resolve
    folder = write_tiny_llama(tmp_path / "swiglu", {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 256,
                                                    "hidden_act": "silu", "max_position_embeddings": 128},
                              tokenizer=shared_file("stories260K/tok512.model"))
    options = CompileOptions(calib=shared_file("tinystories/validation_100.txt"), calib_tokens=1024, window=100,
                             bits=16, predictor="svd", rank=8, threshold_sparsity=0.5, threshold_on="product")
    compile_image(str(folder), str(tmp_path / "image"), options)
    with pytest.raises(LsparseError, match="exact mode needs the mask from the resident gate"):
        load_image(tmp_path / "image", mode="exact")
    tokens = list(np.random.default_rng(8).integers(3, 512, 20))
    hybrid = logits(load_image(tmp_path / "image", mode="hybrid")[0], tokens)
    dense = load_model(resolve(str(folder)), "numpy")
    cuts = [layer.threshold for layer in Image.open(tmp_path / "image").manifest.layers]
    want = dense(tokens, dense.make_cache(len(tokens)), thresholded_ffns(dense, cuts))
    # fp16 rows move a few neurons across the cut (0.75% of the largest logit here); no cut at all moves 4.6%
    np.testing.assert_allclose(hybrid, want, atol=2e-2 * np.abs(want).max())


def test_neuron_file_truncated_while_running_is_a_clean_error(relu_image, tmp_path):
    import shutil

    from lsparse.errors import LsparseError
    image = tmp_path / "image"
    shutil.copytree(relu_image, image)
    model, _ = load_image(image, mode="exact", window=1)
    data = (image / "neurons.bin").read_bytes()
    (image / "neurons.bin").write_bytes(data[: len(data) // 3])  # the image changes under a running decoder
    with pytest.raises(LsparseError, match="reading neuron bundles failed"):
        logits(model, list(np.random.default_rng(4).integers(3, 512, 30)))


def test_a_checkpoint_without_dense_is_refused(tmp_path):
    result = lsparse("run", str(shared_file("stories260K/stories260K.bin")))
    assert result.returncode == 1 and "is not a flash image" in result.stderr


def test_too_small_a_budget_names_the_smallest(relu_image):
    result = lsparse("run", str(relu_image), "--ram-budget", "10MB", "-m", "4")
    assert result.returncode == 1 and "the smallest that works is" in result.stderr


def test_run_within_its_budget_under_a_memory_cgroup(relu_image):
    """A hard cap (cgroup v1, root only) equal to the budget: the run must finish and stay under it."""
    import subprocess
    import sys

    from lsparse.bench import memcap
    if not memcap.available():
        pytest.skip("needs root and the cgroup v1 memory controller")
    budget = "160MB"
    result = subprocess.run([sys.executable, "-m", "lsparse.bench.memcap", budget, "--", str(LSPARSE), "run",
                             str(relu_image), "--ram-budget", budget, "-m", "32", "--json"],
                            capture_output=True, text=True, timeout=300, check=False)
    report = json.loads(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["generated_tokens"] > 0 and not report["oom_killed"]
    assert report["peak_bytes"] <= 160 * 2**20 and out["peak_memory_bytes"] <= 160 * 2**20


def test_the_smallest_budget_still_decodes_exactly(relu_image):
    """With the cache cut to its minimum, neurons are evicted and read again, and nothing changes."""
    tokens = list(np.random.default_rng(3).integers(3, 512, 40))
    roomy, _ = load_image(relu_image, mode="exact", window=8, context=len(tokens))
    smallest = roomy.memory_plan.smallest_budget
    tight, _ = load_image(relu_image, mode="exact", window=8, ram_budget=smallest, context=len(tokens))
    assert sum(tight.memory_plan.cache_slots) < sum(roomy.memory_plan.cache_slots)
    a, b = logits(tight, tokens), logits(roomy, tokens)
    np.testing.assert_allclose(a, b, atol=1e-5 * np.abs(b).max())
    assert sum(s.bytes_read for s in tight.costs.steps) > sum(s.bytes_read for s in roomy.costs.steps)


@pytest.mark.parametrize("damage,message", [("flip", "layer-000.safetensors: checksum mismatch"),
                                            ("cut", "truncated or altered"), ("version", "image format version 7")])
def test_run_refuses_a_damaged_image(relu_image, tmp_path, damage, message):
    import shutil
    image = tmp_path / "image"
    shutil.copytree(relu_image, image)
    path = image / "resident" / "layer-000.safetensors"
    if damage == "flip":
        data = bytearray(path.read_bytes())
        data[-3] ^= 0x01
        path.write_bytes(bytes(data))
    elif damage == "cut":
        (image / "neurons.bin").write_bytes((image / "neurons.bin").read_bytes()[:-1])
    else:
        manifest = json.loads((image / "manifest.json").read_text())
        (image / "manifest.json").write_text(json.dumps({**manifest, "version": 7}))
    result = lsparse("run", str(image), "-m", "4")
    assert result.returncode == 1 and message in result.stderr and "Traceback" not in result.stderr


def test_ctrl_c_while_decoding_exits_130_and_leaves_the_image_intact(relu_image, monkeypatch, capsys):
    """Ctrl-C arrives in the middle of a token's FFN reads: one line, status 130, the image untouched."""
    import sys

    from lsparse import cli
    from lsparse.image.image import Image
    from lsparse.runtime.ffn_paged import PagedFFN
    calls = {"n": 0}
    real = PagedFFN.__call__

    def interrupted(self, *args):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(self, *args)

    monkeypatch.setattr(PagedFFN, "__call__", interrupted)
    monkeypatch.setattr(sys, "argv", ["lsparse", "run", str(relu_image), "-m", "100"])
    with pytest.raises(SystemExit) as exit_:
        cli.main()
    assert exit_.value.code == 130 and calls["n"] == 3
    assert capsys.readouterr().err.strip().endswith("interrupted")
    assert Image.open(relu_image).verify() == []


def test_every_read_buffer_is_the_plans(relu_image):
    """The reader, the lookahead's reader and the device measurement read into buffers of the plan's size, and
    a token whose reads exceed a buffer is read in batches, with the same result."""
    tokens = list(np.random.default_rng(11).integers(3, 512, 24))
    model, _ = load_image(relu_image, mode="exact", window=2, lookahead=True)
    assert len(model.fetcher.reader.buffer) == len(model.fetcher.ahead.buffer) == model.memory_plan.read_buffer_bytes
    want = logits(model, tokens)
    from lsparse.runtime.fetch import Fetcher
    small, _ = load_image(relu_image, mode="exact", window=2)
    f = small.fetcher
    small.fetcher = Fetcher(small.image.neurons, f.stride, f.row_bytes, f.gap_bytes, True, 4, True,
                            2 * 4096, False)  # a buffer of two blocks: many batches
    for ffn in small.ffns:
        ffn.fetcher = small.fetcher
    np.testing.assert_array_equal(logits(small, tokens), want)
    assert sum(s.requests for s in small.costs.steps) >= sum(s.requests for s in model.costs.steps)


@pytest.mark.slow
def test_the_first_device_measurement_fits_under_a_cap_equal_to_the_budget(tmp_path, monkeypatch):
    """A neuron file of 64 MB or more is measured on its first run (the gap rule). That measurement reads into
    the reader's planned buffer, so a run under a hard cap equal to the smallest budget the plan accepts
    finishes (it was OOM-killed when the measurement took a buffer of its own)."""
    import os
    import subprocess
    import sys

    from lsparse.bench import memcap, synthetic
    from lsparse.image.image import Image
    from lsparse.runtime.device import MIN_FILE_BYTES
    from lsparse.runtime.options import DecodeOptions
    from lsparse.runtime.plan import plan
    if not memcap.available():
        pytest.skip("needs root and the cgroup v1 memory controller")
    from lsparse.bench.synthetic_parts import Geometry, llama_config
    monkeypatch.setitem(synthetic.GEOMETRIES, "test-85mb",
                        Geometry(llama_config(1024, 3072, 16, 1, 1, 64, 512, tied=True), 16, False, "a test"))
    image = tmp_path / "image"
    synthetic.write_synthetic("test-85mb", image)
    assert (image / "neurons.bin").stat().st_size >= MIN_FILE_BYTES
    budget = plan(Image.open(image).manifest, None, DecodeOptions(mode="predicted", context=40)).smallest_budget
    fd = os.open(image / "neurons.bin", os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # pages cached by the writer would escape the cap
    os.close(fd)
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache")}  # no measurement kept: this run measures
    done = subprocess.run([sys.executable, "-m", "lsparse.bench.memcap", str(budget), "--", str(LSPARSE), "run",
                           str(image), "--mode", "predicted", "-m", "8", "--ram-budget", str(budget), "--json",
                           "--ignore-chat-template", "-p", "Once upon a time"], capture_output=True, text=True,
                          env=env, timeout=600)
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert done.returncode == 0 and not report["oom_killed"], done.stderr
    assert json.loads(done.stdout)["flash"]["gap_rule"] == "measured" and report["peak_bytes"] <= budget


@pytest.mark.parametrize("bits", [4, 8])
def test_resident_matrices_as_stored_rows(tmp_path, bits):
    """--resident-bits keeps attention and embeddings as 4/8-bit rows, multiplied where they lie: exact mode
    still equals dense on the same image, both stay near the fp16 image's logits (MLX's own dequantize of the
    same rows is the reference), and the plan counts them as stored."""
    import mlx.core as mx

    from lsparse.image.image import Image
    folder = write_tiny_llama(tmp_path / "llama", {**TINY_LLAMA, "hidden_size": 64, "intermediate_size": 256,
                                                   "max_position_embeddings": 128},
                              tokenizer=shared_file("stories260K/tok512.model"))
    options = dict(calib=shared_file("tinystories/validation_100.txt"), calib_tokens=1024, window=100, bits=8,
                   predictor="svd", rank=8)
    compile_image(str(folder), str(tmp_path / "stored"), CompileOptions(**options, resident_bits=bits))
    compile_image(str(folder), str(tmp_path / "fp16"), CompileOptions(**options))
    tokens = list(np.random.default_rng(12).integers(3, 512, 20))
    exact, dense = load_image(tmp_path / "stored", mode="exact")[0], load_image(tmp_path / "stored", mode="dense")[0]
    a, b = logits(exact, tokens), logits(dense, tokens)
    np.testing.assert_allclose(a, b, atol=1e-4 * np.abs(b).max())
    # the rows decode as MLX decodes them
    q = Image.open(tmp_path / "stored").layer_tensors(0)["q"]
    want = np.array(mx.dequantize(*map(mx.array, _mlx_parts(q, 64, bits)), group_size=64, bits=bits))
    np.testing.assert_allclose(dense.model.layers[0]["q"][np.arange(64)], want, rtol=1e-6, atol=1e-6)
    fp16 = logits(load_image(tmp_path / "fp16", mode="dense")[0], tokens)
    assert np.abs(b - fp16).max() < (0.3 if bits == 4 else 0.05) * np.abs(fp16).max()
    assert dense.memory_plan.attention < 0.4 * load_image(tmp_path / "fp16", mode="dense")[0].memory_plan.attention


def _mlx_parts(rows: np.ndarray, d: int, bits: int, group: int = 64):
    """The image's row format split as MLX keeps it: codes (uint32 words), fp32 scales, fp32 biases."""
    codes = np.ascontiguousarray(rows[:, : d * bits // 8]).view(np.uint32)
    scales = np.ascontiguousarray(rows[:, d * bits // 8: d * bits // 8 + 2 * (d // group)]).view(np.float16)
    biases = np.ascontiguousarray(rows[:, d * bits // 8 + 2 * (d // group):]).view(np.float16)
    return codes, scales.astype(np.float32), biases.astype(np.float32)


def test_cache_aware_masks_trade_reads_for_the_cached_neurons(relu_image):
    """DIP (--cache-bias): no bias is plain predicted mode, logits and all; a larger bias never needs more bytes
    from flash per token, and a cached neuron's score is raised as an uncached one's is lowered."""
    from lsparse.runtime.predictors import Scored
    tokens = list(np.random.default_rng(11).integers(3, 512, 48))
    plain, _ = load_image(relu_image, mode="predicted", window=2)
    unbiased, _ = load_image(relu_image, mode="predicted", window=2, cache_bias=0.0)
    np.testing.assert_array_equal(logits(plain, tokens), logits(unbiased, tokens))
    needed = []
    for bias in (0.0, 0.5, 2.0):
        model, _ = load_image(relu_image, mode="predicted", window=2, cache_bias=bias)
        logits(model, tokens)
        needed.append(sum(s.bytes_needed for s in model.costs.steps))
    assert needed[0] >= needed[1] >= needed[2] and needed[0] > needed[2]
    layer = plain.ffns[0].predictor
    scored = Scored(layer.kind, layer.tensors, layer.threshold, cache_bias=1e9)
    x = np.random.default_rng(0).standard_normal((1, 64)).astype(np.float32)
    cached = np.zeros(256, dtype=bool)
    cached[:10] = True
    assert list(scored.predict(x, cached)[0]) == list(range(10))  # only the cached pass a huge bias
    with pytest.raises(Exception, match="cache-bias"):
        load_image(relu_image, mode="exact", cache_bias=1.0)


@pytest.mark.parametrize("fields", [{"mode": "dense"}, {"mode": "exact"}, {"mode": "predicted"},
                                    {"mode": "predicted", "kv_top_k": 4}, {"mode": "exact", "flock": 0.5}])
def test_a_prompts_last_logits_alone_are_the_last_row_of_all(relu_image, fields):
    """Generation asks a prompt for its last token's logits only (the head once, no row per token kept): the
    same numbers as the last row of every token's, on each path a prompt takes (whole, token by token, flock)."""
    tokens = list(np.random.default_rng(5).integers(3, 512, 30))
    model, _ = load_image(relu_image, **fields)
    every = model(tokens, model.make_cache(len(tokens)))
    cache = model.make_cache(len(tokens))
    last = model(tokens, cache, last_only=True)
    assert last.shape == (1, every.shape[1]) and cache[0].offset == len(tokens)
    np.testing.assert_allclose(np.asarray(last), np.asarray(every[-1:]), rtol=1e-5, atol=1e-6)
