"""The Metal sources, proven on Linux: the exact source MLX would compile (captured while tracing, held byte
for byte against lsparse's rendering and the committed copies), clang's syntax and address-space check with
a negative case, and the numerics on a Mac (skipped elsewhere)."""

from __future__ import annotations

import numpy as np
import pytest

from lsparse.image.quantize import quantize_rows
from lsparse.kernels import cpu
from lsparse.kernels.metal import BITS, GROUP, KERNELS, METAL_DIR, render
from lsparse.kernels.proof import clang, syntax_check

SOURCES = [(name, bits) for name in KERNELS for bits in BITS]


def test_mlx_generates_exactly_the_source_lsparse_renders_and_commits():
    from lsparse.kernels.capture import capture
    captured = capture()
    assert sorted(captured) == sorted(SOURCES)
    for (name, bits), source in captured.items():
        assert source == render(name, bits), f"{name} {bits}-bit: MLX's source differs from lsparse's rendering"
        committed = (METAL_DIR / "generated" / f"{name}-{bits}.metal").read_text()
        assert committed == source, f"metal/generated/{name}-{bits}.metal is stale: python -m " \
                                    "lsparse.kernels.capture metal/generated, then review the diff"


needs_clang = pytest.mark.skipif(clang() is None, reason="clang++ is absent (`make proof-tools` installs Debian's)")


@needs_clang
@pytest.mark.parametrize("name,bits", SOURCES)
def test_clang_accepts_every_kernel(name, bits):
    ok, errors = syntax_check(render(name, bits))
    assert ok, errors


@needs_clang
def test_clang_rejects_device_memory_passed_as_a_plain_pointer():
    """Metal's most common mistake: a device buffer handed to a function taking a thread (plain) pointer."""
    source = render("gather_mv", 4)
    helper = "inline float first(const float* p) {\n  return p[0];\n}\n"
    kernel = "template <int BITS, int GROUP>\n[[kernel]]"
    broken = source.replace(kernel, helper + kernel, 1).replace("  float acc = 0.0f;\n  if (slot >= 0) {",
                                                               "  float acc = first(x);\n  if (slot >= 0) {", 1)
    assert broken.count("first(") == 2
    ok, errors = syntax_check(broken)
    assert not ok and "to generic address space" in errors
    ok, _ = syntax_check(broken.replace("const float* p", "const device float* p"))
    assert ok  # the same helper taking a device pointer is fine


def rows_and_slots(bits, d=256, n_rows=40, capacity=24, seed=0):
    rng = np.random.default_rng(seed)
    rows = quantize_rows(rng.standard_normal((n_rows, d)).astype(np.float32), bits, GROUP)
    w = np.ascontiguousarray(rows).view(np.uint32)
    slots = np.full(capacity, -1, dtype=np.int32)
    slots[:17] = rng.choice(n_rows, 17, replace=False)
    return w, slots, rng.standard_normal(d).astype(np.float32), rng.standard_normal(capacity).astype(np.float32)


@pytest.mark.parametrize("bits", BITS)
def test_cpu_path_matches_dense_arithmetic_on_decoded_rows(bits):
    from lsparse.image.quantize import dequantize_rows
    w, slots, x, a = rows_and_slots(bits)
    dense = dequantize_rows(w.view(np.uint8), x.shape[0], bits, GROUP)
    valid = slots >= 0
    np.testing.assert_allclose(cpu.gather_mv(w, slots, x, bits)[valid], dense[slots[valid]] @ x, rtol=1e-5,
                               atol=1e-4)
    assert (cpu.gather_mv(w, slots, x, bits)[~valid] == 0).all()
    np.testing.assert_allclose(cpu.gather_down(w, slots, a, bits, x.shape[0]), a[valid] @ dense[slots[valid]],
                               rtol=1e-5, atol=1e-4)


def metal_available():
    try:
        import mlx.core as mx
        return mx.metal.is_available()
    except ImportError:
        return False


@pytest.mark.metal
@pytest.mark.skipif(not metal_available(), reason="needs a Mac with Metal (run `make test-metal` there)")
@pytest.mark.parametrize("bits", BITS)
def test_metal_kernels_match_the_cpu_path(bits):
    import mlx.core as mx

    from lsparse.kernels import metal
    w, slots, x, a = rows_and_slots(bits)
    y = np.array(metal.gather_mv(mx.array(w), mx.array(slots), mx.array(x), bits))
    np.testing.assert_allclose(y, cpu.gather_mv(w, slots, x, bits), rtol=1e-4, atol=1e-3)
    out = np.array(metal.gather_down(mx.array(w), mx.array(slots), mx.array(a), bits, x.shape[0]))
    np.testing.assert_allclose(out, cpu.gather_down(w, slots, a, bits, x.shape[0]), rtol=1e-4, atol=1e-3)


def emulate_kernel(name, bits, sanitizer="address", source=None, d=320, capacity=26):
    """One dispatch in the CPU emulator, with partial threadgroups at the grid's edge, and the numpy answer."""
    from lsparse.kernels import emulate
    w, slots, x, a = rows_and_slots(bits, d=d, capacity=capacity)
    binary = emulate.build(name, bits, sanitizer, source)
    if name == "gather_mv":
        got = emulate.run(binary, {"w": w, "slots": slots, "x": x}, {"y": ((capacity,), np.float32)},
                          grid=(32, capacity, 1), threadgroup=(32, 4, 1))["y"]
        return got, cpu.gather_mv(w, slots, x, bits)
    words = d * bits // 32
    got = emulate.run(binary, {"w": w, "slots": slots, "a": a}, {"out": ((d,), np.float32)},
                      grid=(words, 1, 1), threadgroup=(32, 1, 1))["out"]
    return got, cpu.gather_down(w, slots, a, bits, d)


@needs_clang
@pytest.mark.parametrize("name,bits", SOURCES)
def test_kernels_run_clean_under_asan_and_ubsan_and_match_numpy(name, bits):
    got, want = emulate_kernel(name, bits)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


@needs_clang
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernels_run_clean_under_tsan(name):
    got, want = emulate_kernel(name, 4, sanitizer="thread")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def mutated(name, old, new):
    source = render(name, 4)
    assert source.count(old) == 1, f"the mutation's anchor is not unique in {name}"
    return source.replace(old, new)


@needs_clang
def test_emulator_catches_a_missing_bounds_clamp():
    from lsparse.kernels.emulate import EmulatorError
    source = mutated("gather_down", "tile_slot[k] = i < n ? slots[i] : -1;", "tile_slot[k] = slots[i];")
    with pytest.raises(EmulatorError, match="AddressSanitizer: heap-buffer-overflow"):
        emulate_kernel("gather_down", 4, source=source)


@needs_clang
def test_emulator_catches_a_deleted_barrier():
    from lsparse.kernels.emulate import EmulatorError
    source = mutated("gather_down", "    threadgroup_barrier(mem_flags::mem_threadgroup);\n    if (word < words) {",
                     "    if (word < words) {")
    with pytest.raises(EmulatorError, match="ThreadSanitizer: data race"):
        emulate_kernel("gather_down", 4, sanitizer="thread", source=source)


@needs_clang
def test_emulator_catches_simd_sum_in_a_divergent_branch():
    from lsparse.kernels.emulate import EmulatorError
    source = mutated("gather_mv", "  acc = simd_sum(acc);", "  if (lane < 16) {\n    acc = simd_sum(acc);\n  }")
    with pytest.raises(EmulatorError, match="SIMD-group calls|divergent"):
        emulate_kernel("gather_mv", 4, source=source)


def test_kernel_bench_figures_are_consistent():
    from lsparse.bench.kernels import bench_kernels
    result = bench_kernels(geometries=("builtin",), fractions=(0.1, 1.0), implementations=("numpy",), seconds=0.01)
    assert [(r["active_share"], r["implementation"]) for r in result["rows"]] == [(0.1, "numpy"), (1.0, "numpy")]
    for r in result["rows"]:
        assert r["sparse_ms"] > 0 and r["dense_ms"] > 0
        assert r["speedup"] == pytest.approx(r["dense_ms"] / r["sparse_ms"])
        assert r["ideal_speedup"] == pytest.approx(1 / r["active_share"])
        assert r["share_of_ideal"] == pytest.approx(r["speedup"] / r["ideal_speedup"])
