"""The Metal kernels, proven on Linux: the exact source MLX would compile (captured while tracing, held byte
for byte against lsparse's rendering and the committed copies); clang's syntax and address-space check with a
negative case; every variant (4/8 bits at groups 32, 64 and 128, fp16) run in the CPU emulator under ASan
and UBSan, outputs poisoned with NaN beforehand, against MLX's own dequantize of the same rows; mutants that
must be caught; and the numerics on a Mac (skipped elsewhere)."""

from __future__ import annotations

import re
import tempfile

import numpy as np
import pytest

from lsparse.kernels.metal import KERNELS, METAL_DIR, SOURCES, render, variant_label
from lsparse.kernels.proof import clang, syntax_check

SLOT_COUNTS = (1, 7, 8, 31, 32, 33, 300)  # a SIMD group's rows, a threadgroup's, a split's edges, several splits
ROW_KERNELS = [(n, v) for n, v in SOURCES if n != "compact_active"]
needs_clang = pytest.mark.skipif(clang() is None, reason="clang++ is absent (`make proof-tools` installs Debian's)")


def ids(sources):
    return [f"{name}-{variant_label(values)}" for name, values in sources]


def test_mlx_generates_exactly_the_source_lsparse_renders_and_commits():
    from lsparse.kernels.capture import capture
    captured = capture()
    assert sorted(captured) == sorted(SOURCES)
    committed = sorted(p.name for p in (METAL_DIR / "generated").iterdir())
    assert committed == sorted(f"{n}-{variant_label(v)}.metal" for n, v in SOURCES)
    for (name, values), source in captured.items():
        assert source == render(name, values), f"{name} {values}: MLX's source differs from lsparse's rendering"
        label = variant_label(values)
        assert (METAL_DIR / "generated" / f"{name}-{label}.metal").read_text() == source, \
            f"lsparse/kernels/metal/generated/{name}-{label}.metal is stale: python -m lsparse.kernels.capture " \
            "lsparse/kernels/metal/generated, then review the diff"


@needs_clang
@pytest.mark.parametrize("name,values", SOURCES, ids=ids(SOURCES))
def test_clang_accepts_every_kernel(name, values):
    ok, errors = syntax_check(render(name, values))
    assert ok, errors


@needs_clang
def test_clang_rejects_device_memory_passed_as_a_plain_pointer():
    """Metal's most common mistake: a device buffer handed to a function taking a thread (plain) pointer."""
    source = render("gather_mv", (4, 64))
    helper = "inline float head(const float* p) {\n  return p[0];\n}\n"
    kernel = "template <int BITS, int GROUP>\n[[kernel]]"
    broken = source.replace(kernel, helper + kernel, 1).replace("  float xr[V];\n", "  float xr[V];\n"
                                                                "  acc[0] = head(x);\n", 1)
    assert broken.count("head(") == 2
    ok, errors = syntax_check(broken)
    assert not ok and "to generic address space" in errors
    ok, _ = syntax_check(broken.replace("const float* p", "const device float* p"))
    assert ok  # the same helper taking a device pointer is fine


def mlx_rows(bits: int, group: int, d: int, n_rows: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(rows in the image's row format as uint32 words, the same rows as MLX's dequantize decodes them): the
    codes, scales and biases come from MLX's own quantize, so no lsparse code makes the expected values."""
    import mlx.core as mx
    weights = np.random.default_rng(seed).standard_normal((n_rows, d)).astype(np.float16)
    if bits == 16:
        return np.ascontiguousarray(weights).view(np.uint32), weights.astype(np.float64)
    q, s, b = mx.quantize(mx.array(weights), group_size=group, bits=bits)
    rows = np.concatenate([np.array(q).view(np.uint8), np.array(s).view(np.uint8), np.array(b).view(np.uint8)], 1)
    dense = np.array(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group,
                                   bits=bits)).astype(np.float64)  # fp16 scales would give fp16 weights
    return np.ascontiguousarray(rows).view(np.uint32), dense


def compaction(pre: np.ndarray, cut: float, cats: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices, count) as compact_active writes them, in numpy: the passing neurons ascending, then -1."""
    passes = np.abs(pre / (1 + np.exp(-pre))) > cut if cats else pre > cut
    indices = np.full(len(pre), -1, dtype=np.int32)
    indices[: passes.sum()] = np.flatnonzero(passes)
    return indices, np.array([passes.sum()], dtype=np.int32)


def slot_list(n: int, n_rows: int, rng) -> np.ndarray:
    """n slots: rows in random order, every seventh -1 (padding within a list must be skipped too)."""
    slots = rng.integers(0, n_rows, n).astype(np.int32)
    slots[3::7] = -1
    return slots


def emulated(name, values, n=26, d=384, sanitizer="address", source=None, seed=0, zero_split=False):
    """One dispatch of a kernel variant in the CPU emulator over an n-slot list, grid as Metal gets it, and the
    expected output from MLX's dequantize (compact_active: from numpy over 2100 neurons)."""
    from lsparse.kernels import emulate, metal
    variants = (tuple(values),) if source is not None else None
    binary = emulate.build(name, variants, sanitizer, source)
    rng = np.random.default_rng(seed)
    if name == "compact_active":
        count = 2100
        pre = rng.standard_normal(count).astype(np.float32)
        got = emulate.run(binary, values, {"pre": pre, "threshold": np.array([0.3], np.float32)},
                          {"indices": ((count,), np.int32), "count": ((1,), np.int32)},
                          *metal.launch("compact_active", count))
        want = compaction(pre, 0.3, values[0])
        return np.concatenate([got["count"], got["indices"]]), np.concatenate(want[::-1])
    bits, group = values[:2]
    n_rows = 50
    w, dense = mlx_rows(bits, group, d, n_rows, seed)
    slots = slot_list(n, n_rows, rng)
    x = rng.standard_normal(d).astype(np.float32)
    valid = slots >= 0
    grid = metal.launch(name, n, d, bits)
    if name == "gather_mv":
        got = emulate.run(binary, values, {"w": w, "slots": slots, "x": x}, {"y": ((n,), np.float32)}, *grid)
        return got["y"], np.where(valid, dense[np.maximum(slots, 0)] @ x, 0)
    if name == "gather_gate_up":
        up_w, up_dense = mlx_rows(bits, group, d, n_rows, seed + 1)
        cut = 0.3
        got = emulate.run(binary, values, {"gate_w": w, "up_w": up_w, "slots": slots, "x": x,
                                           "threshold": np.array([cut], np.float32)},
                          {"gate": ((n,), np.float32), "up": ((n,), np.float32)}, *grid)
        gate = np.where(valid, dense[np.maximum(slots, 0)] @ x, 0)
        up = np.where(valid, up_dense[np.maximum(slots, 0)] @ x, 0)
        if values[2]:
            up = np.where(gate > cut, up, 0)
        return np.concatenate([got["gate"], got["up"]]), np.concatenate([gate, up])
    a = rng.standard_normal(n).astype(np.float32)
    a[::5] = 0
    if zero_split:
        a[metal.DOWN_SPLIT:2 * metal.DOWN_SPLIT] = 0  # a split of ReLU zeros: its partial sums are all 0
    got = emulate.run(binary, values, {"w": w, "slots": slots, "a": a},
                      {"partial": ((metal.down_splits(n), d), np.float32)}, *grid)["partial"]
    return got.sum(0), a[valid] @ dense[slots[valid]]


def close(got, want, bits):
    """fp32 sums in another order than float64's: within 1e-4 of the largest value."""
    assert not np.isnan(got).any(), "the kernel left outputs unwritten (NaN-poisoned)"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * max(1.0, np.abs(want).max()))


@needs_clang
@pytest.mark.parametrize("name,values", ROW_KERNELS, ids=ids(ROW_KERNELS))
def test_row_kernels_run_clean_under_asan_and_ubsan_at_every_slot_count(name, values):
    for n in SLOT_COUNTS:
        got, want = emulated(name, values, n=n, seed=n)
        close(got, want, values[0])
    got, want = emulated(name, values, n=300, d=1152, seed=1)  # columns over several lane blocks
    close(got, want, values[0])


@needs_clang
@pytest.mark.parametrize("cats", [0, 1])
def test_compaction_runs_clean_under_asan_and_ubsan(cats):
    got, want = emulated("compact_active", (cats,))
    np.testing.assert_array_equal(got, want)


@needs_clang
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernels_run_clean_under_tsan(name):
    values = KERNELS[name].variants[0]
    got, want = emulated(name, values, n=300, sanitizer="thread")
    if name == "compact_active":
        np.testing.assert_array_equal(got, want)
    else:
        close(got, want, values[0])


def mutated(name, values, old, new):
    """The kernel's whole source (its header included) with one change."""
    source = render(name, values)
    assert source.count(old) == 1, f"the mutation's anchor is not unique in {name}"
    return source.replace(old, new)


def caught(name, values, source, match, **kw):
    from lsparse.kernels.emulate import EmulatorError
    try:
        got, want = emulated(name, values, source=source, **kw)
    except EmulatorError as e:
        assert match is not None and re.search(match, str(e)), str(e)[-2000:]
        return
    assert match is None, "the mutant ran clean"
    with pytest.raises(AssertionError):
        close(got, want, values[0])


@needs_clang
def test_emulator_catches_a_missing_bounds_clamp():
    source = mutated("gather_mv", (4, 64), "first + r < n ? slots[first + r] : -1", "slots[first + r]")
    caught("gather_mv", (4, 64), source, "AddressSanitizer: heap-buffer-overflow", n=7)


@needs_clang
def test_emulator_catches_a_deleted_barrier():
    source = mutated("gather_down", (4, 64), "  threadgroup_barrier(mem_flags::mem_threadgroup);\n", "")
    caught("gather_down", (4, 64), source, "ThreadSanitizer: data race", n=300, sanitizer="thread")


@needs_clang
def test_emulator_catches_the_compaction_reading_simd_totals_before_the_barrier():
    source = mutated("compact_active", (0,), "  threadgroup_barrier(mem_flags::mem_threadgroup);\n  int at", "  int at")
    caught("compact_active", (0,), source, "ThreadSanitizer: data race", sanitizer="thread")


@needs_clang
def test_emulator_catches_simd_sum_in_a_divergent_branch():
    source = mutated("gather_mv", (4, 64), "    const float total = simd_sum(acc[r]);",
                     "    float total = acc[r];\n    if (lane < 16) {\n      total = simd_sum(acc[r]);\n    }")
    caught("gather_mv", (4, 64), source, "SIMD-group calls|divergent")


@needs_clang
def test_emulator_catches_a_dropped_split_k_partial():
    """The second SIMD group's sums left out of the threadgroup's partial: wrong sums."""
    source = mutated("gather_down", (4, 64), "acc[k] + other[lane * V + k]", "acc[k]")
    caught("gather_down", (4, 64), source, None, n=300)


@needs_clang
def test_emulator_catches_a_partial_left_unwritten():
    """A split whose sums are all 0 skips its write: right on zeroed memory, wrong on Metal's (NaN here)."""
    source = mutated("gather_down", (4, 64), "  if (simd == 0 && col < d) {",
                     "  if (simd == 0 && col < d && (acc[0] != 0.0f || other[lane * V] != 0.0f)) {")
    caught("gather_down", (4, 64), source, None, n=300, zero_split=True)


@needs_clang
@pytest.mark.parametrize("name", ["gather_mv", "gather_down"])
def test_emulator_catches_a_wrong_group_stride(name):
    """Scales looked up with group 64 in rows of groups of 32."""
    source = mutated(name, (4, 32), "scales[col / GROUP]) * q", "scales[col / 64]) * q") if name == "gather_mv" \
        else mutated(name, (4, 32), "a * float(scales[col / GROUP])", "a * float(scales[col / 64])")
    caught(name, (4, 32), source, None, n=33)


@needs_clang
def test_emulator_catches_up_rows_skipped_at_the_wrong_cut():
    """With SKIP the up rows are read where gate > the cut (FATReLU's threshold), not where gate > 0."""
    source = mutated("gather_gate_up", (4, 64, 1), "g[r] > cut", "g[r] > 0.0f")
    caught("gather_gate_up", (4, 64, 1), source, None, n=300)


def metal_available():
    try:
        import mlx.core as mx
        return mx.metal.is_available()
    except ImportError:
        return False


on_a_mac = pytest.mark.skipif(not metal_available(), reason="needs a Mac with Metal (run `make test-metal` there)")


@pytest.mark.metal
@on_a_mac
@pytest.mark.parametrize("name,values", ROW_KERNELS, ids=ids(ROW_KERNELS))
def test_metal_kernels_match_mlx_dequantize(name, values):
    import mlx.core as mx

    from lsparse.kernels import metal
    bits, group = values[:2]
    d, n_rows = 1152, 50
    w, dense = mlx_rows(bits, group, d, n_rows)
    rng = np.random.default_rng(1)
    for n in (8, 32, 40, 304):
        slots = slot_list(n, n_rows, rng)
        x = rng.standard_normal(d).astype(np.float32)
        valid = slots >= 0
        y = np.where(valid, dense[np.maximum(slots, 0)] @ x, 0)
        if name == "gather_mv":
            close(np.array(metal.gather_mv(mx.array(w), mx.array(slots), mx.array(x), bits, group)), y, bits)
        elif name == "gather_gate_up":
            gate, up = metal.gather_gate_up(mx.array(w), mx.array(w), mx.array(slots), mx.array(x),
                                            mx.array(np.array([0.3], np.float32)), bits, group, values[2])
            close(np.array(gate), y, bits)
            close(np.array(up), np.where(y > 0.3, y, 0) if values[2] else y, bits)
        else:
            a = rng.standard_normal(n).astype(np.float32)
            out = np.array(metal.gather_down(mx.array(w), mx.array(slots), mx.array(a), bits, group, d))
            close(out, a[valid] @ dense[slots[valid]], bits)


@pytest.mark.metal
@on_a_mac
@pytest.mark.parametrize("cats", [0, 1])
@pytest.mark.parametrize("n", [7, 300, 11008])
def test_metal_compaction_matches_the_cpu_path(cats, n):
    import mlx.core as mx

    from lsparse.kernels import metal
    pre = np.random.default_rng(n).standard_normal(n).astype(np.float32)
    indices, count = metal.compact_active(mx.array(pre), mx.array(np.array([0.3], np.float32)), cats)
    want_indices, want_count = compaction(pre, 0.3, cats)
    np.testing.assert_array_equal(np.array(count), want_count)
    np.testing.assert_array_equal(np.array(indices), want_indices)


# The runtime on Metal: one evaluation per layer at most.

MODES = ("exact", "predicted", "hybrid", "dense")


@pytest.fixture(scope="module")
def q4_image(tmp_path_factory):
    from lsparse.image.compile import CompileOptions, compile_image
    image = tmp_path_factory.mktemp("metal") / "image"
    compile_image("builtin:tinystories-reglu", str(image), CompileOptions(bits=4, predictor="svd"))
    return image


@pytest.fixture
def host_reads(monkeypatch):
    """Every value the host reads from a lazy backend, in order: (arrays read, kernels object)."""
    from lsparse.kernels.slots import SlotKernels
    reads, host = [], SlotKernels.host

    def recorded(self, *arrays):
        out = host(self, *arrays)
        reads.append(out)
        return out
    monkeypatch.setattr(SlotKernels, "host", recorded)
    return reads


RUNS = [(mode, False) for mode in MODES] + [("exact", True), ("predicted", True)]


@pytest.mark.parametrize("mode,lookahead", RUNS)
def test_the_lazy_backend_reads_the_host_once_per_layer_at_most(q4_image, host_reads, mode, lookahead):
    """Exact gating reads each layer's active list, a numpy predictor each layer's input; hybrid and dense
    modes read nothing before the logits. The lookahead's guess of the next layer rides on the same read."""
    from lsparse.runtime.load import load_image
    model, tok = load_image(q4_image, mode=mode, kernels="reference", lookahead=lookahead)
    cache = model.make_cache(16)
    model(tok.encode("Once upon a time"), cache)
    del host_reads[:]
    for token in (5, 6, 7):
        np.array(model([token], cache))
    assert len(host_reads) == 3 * (len(model.ffns) if mode in ("exact", "predicted") else 0)


@pytest.mark.parametrize("mode,lookahead", RUNS)
def test_a_token_on_the_metal_backend_is_one_graph_between_host_reads(q4_image, host_reads, monkeypatch, mode,
                                                                       lookahead):
    """The proof from the traced graph: a token runs on the real metal backend (lsparse's Metal kernels, as MLX
    builds them) inside mx.export_function, which refuses any evaluation of a value that depends on its input,
    here the token's embedding; the host's reads are replayed from the same token computed by the reference
    backend. So between the host reads nothing is evaluated: no implicit conversion, no kernel answered on
    the host. (Building the graph needs no Metal device; running it would.)"""
    import mlx.core as mx

    from lsparse.kernels import backends
    from lsparse.kernels.slots import SlotKernels
    from lsparse.model import llama
    from lsparse.runtime.load import load_image
    reference, tok = load_image(q4_image, mode=mode, kernels="reference", lookahead=lookahead)
    token = tok.encode("Once")[:1]
    want = np.array(reference(token, reference.make_cache(4)))
    replay = list(host_reads)
    monkeypatch.setattr(backends, "metal_available", lambda: True)
    metal_model, _ = load_image(q4_image, mode=mode, kernels="metal", lookahead=lookahead)
    assert metal_model.kernels.name == "metal"
    monkeypatch.setattr(SlotKernels, "host", lambda self, *arrays: replay.pop(0))

    def token_from(embedding):
        monkeypatch.setattr(llama, "embed", lambda *args: embedding)
        return metal_model(token, metal_model.make_cache(4))
    embedding = llama.embed(reference.model.args, reference.model.globals, np.asarray(token), None, mx)
    with tempfile.TemporaryDirectory() as tmp:
        mx.export_function(f"{tmp}/token.mlxfn", token_from, mx.array(embedding))
    assert replay == [] and want.shape == (1, tok.vocab_size)


def test_the_performance_model_counts_the_bytes_and_launches_of_a_7b_layer():
    """`lsparse bench kernels --model`, through the console script: labelled predicted; at 7B, 10% active, 4-bit
    groups of 64 a row is 2048 bytes of codes and 256 of scales and biases; the dense FFN reads all three
    matrices; the split-K down product keeps more threadgroups busy than a base chip has GPU cores."""
    import json

    from tests.conftest import lsparse
    result = json.loads(lsparse("bench", "kernels", "--model", "--json").stdout)
    assert result["predicted"] is True
    row = next(r for r in result["rows"] if r["geometry"] == "7b" and r["share"] == 0.10)
    kernels = {k["kernel"]: k for k in row["kernels"]}
    n = 1104  # 1101 active neurons, sent as a list of a multiple of 8
    assert kernels["gather_gate_up"]["memory_bytes"] == 2 * n * 2304 + 3 * 4 * n
    assert kernels["mlx dense FFN (3 x quantized_matmul)"]["memory_bytes"] >= 3 * 11008 * 2304
    cores = max(c for _, c in result["chips"].values() if c < 16)  # the base chips' GPU cores
    assert kernels["gather_down"]["threadgroups"] >= cores and kernels["gather_gate_up"]["threadgroups"] >= cores
    dense = next(t for t in row["layer"] if t["path"] == "dense FFN (MLX)")
    assert dense["floor_us"]["M1"] == pytest.approx(dense["memory_bytes"] / 68.25e3)


def test_the_performance_model_needs_the_kernels_bench():
    from tests.conftest import lsparse
    done = lsparse("bench", "out/none", "--model")
    assert done.returncode != 0 and "--model goes with" in done.stderr and "Traceback" not in done.stderr


def test_an_empty_slot_list_is_answered_without_a_dispatch():
    """0 active neurons: zeros of the right shapes from every stand-in, and from the metal functions themselves
    (which MLX would refuse to dispatch over an empty grid)."""
    import mlx.core as mx

    from lsparse.kernels import emulate, metal
    from lsparse.kernels.slots import ReferenceOps
    w, slots = mx.zeros((4, 40), dtype=mx.uint32), mx.zeros((0,), dtype=mx.int32)
    x, a, t = mx.ones((64,)), mx.zeros((0,)), mx.array([0.0])
    for ops in (metal, ReferenceOps, emulate.Ops()):
        assert ops.gather_mv(w, slots, x, 4, 64).shape == (0,)
        assert [v.shape for v in ops.gather_gate_up(w, w, slots, x, t, 4, 64, True)] == [(0,), (0,)]
        out = ops.gather_down(w, slots, a, 4, 64, 64)
        assert out.shape == (64,) and not np.array(out).any()


@pytest.mark.skipif(metal_available(), reason="on a Mac, mac-check runs instead of refusing")
def test_mac_check_elsewhere_says_what_it_would_run_and_fails():
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "scripts/mac_check.py"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    for step in ("make test-metal", "bench kernels --json", "bench kernels --model --json", "--kernels metal",
                 "synthetic:llama-2-7b", "report.json"):
        assert step in done.stdout, step
