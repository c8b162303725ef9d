"""The kernels' CPU side: the numpy reference against dense arithmetic, every backend's products over slot
lists and held rows, the C kernels against MLX's quantized_matmul, the kernel bench's figures. The Metal
kernels' proofs are in test_metal.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from lsparse.image.quantize import quantize_rows

GROUP = 64


@pytest.mark.parametrize("kernels", ["cpu", "mlx", "reference"])
@pytest.mark.parametrize("cache_slots", [48, 300])
def test_backends_multiply_over_slot_lists_as_the_reference_does(kernels, cache_slots):
    """Each backend's cache store, filled by slot, against numpy on the decoded rows; cpu with and without
    its C kernels (lsparse/kernels/native), which must have been built here where there is a C compiler. At
    d = 4096 a store of 48 rows holds them decoded and one of 300 keeps them 4-bit (STORED_MIN_WEIGHTS); a
    product over 40 slots is large enough for the C kernels (NATIVE_MIN_WEIGHTS)."""
    from lsparse.image.quantize import dequantize_rows
    from lsparse.kernels.backends import NATIVE_MIN_WEIGHTS, STORED_MIN_WEIGHTS, CpuKernels, select
    from lsparse.kernels.native import compiler
    d, n_rows, bits = 4096, 44, 4
    rng = np.random.default_rng(3)
    data = quantize_rows(rng.standard_normal((n_rows, d)).astype(np.float32), bits, GROUP)
    decoded = dequantize_rows(data, d, bits, GROUP)
    backends = [select(kernels, d, bits, GROUP)]
    if kernels == "cpu":
        assert backends[0].gather == "native" or compiler() is None, "a C compiler is here, yet the C kernels " \
                                                                     "did not build"
        backends.append(CpuKernels(d, bits, GROUP, native=False))
    slots_of_rows = rng.permutation(cache_slots)[:n_rows]  # rows placed at random slots of the cache
    slots = slots_of_rows[rng.choice(n_rows, 40, replace=False)]
    assert len(slots) * d >= NATIVE_MIN_WEIGHTS and (cache_slots * d >= STORED_MIN_WEIGHTS) == (cache_slots == 300)
    row_of_slot = {s: r for r, s in enumerate(slots_of_rows)}
    x = rng.standard_normal((1, d)).astype(np.float32)
    a = rng.standard_normal((1, len(slots))).astype(np.float32)
    a[0, ::3] = 0  # zero coefficients are skipped by the C kernel
    want_rows = decoded[[row_of_slot[s] for s in slots]]
    for b in backends:
        store = b.empty(cache_slots)
        if b.name == "cpu" and b.native:
            assert store.dtype == (np.uint8 if cache_slots == 300 else np.float32)
        b.put(store, slots_of_rows, b.prepare(data, 1)[:, 0])
        want = int8_product(want_rows, row_biases(data, d, bits, GROUP)[[row_of_slot[s] for s in slots]], x, GROUP) \
            if b.name == "cpu" and b.native and store.dtype == np.uint8 else x @ want_rows.T
        np.testing.assert_allclose(b.mv(store, slots, x), want, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(b.vm(store, slots, a), a @ want_rows, rtol=1e-4, atol=1e-4)
        many = np.repeat(data, 7, axis=0)  # 308 rows: held as stored by cpu with its C kernels
        held = b.hold(b.prepare(many, 1)[:, 0])
        all_rows = np.repeat(decoded, 7, axis=0)
        want = int8_product(all_rows, np.repeat(row_biases(data, d, bits, GROUP), 7, axis=0), x, GROUP) \
            if b.name == "cpu" and b.native else x @ all_rows.T
        np.testing.assert_allclose(b.mv(held, None, x), want, rtol=1e-4, atol=1e-3)
        coefficients = np.random.default_rng(4).standard_normal((1, len(many))).astype(np.float32)
        np.testing.assert_allclose(b.vm(held, None, coefficients), coefficients @ np.repeat(decoded, 7, axis=0),
                                   rtol=1e-4, atol=1e-3)


def int8_activations(x: np.ndarray, group: int) -> np.ndarray:
    """x as the C kernels multiply 4/8-bit rows' codes with it: quantized to int8 per group of `group` (scale:
    the group's largest magnitude / 127, rounded to nearest even), then scaled back."""
    blocks = np.asarray(x, dtype=np.float32).reshape(*np.shape(x)[:-1], -1, group)
    largest = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = np.where(largest > 0, largest / np.float32(127), np.float32(1)).astype(np.float32)
    return (np.rint(blocks / scale) * scale).reshape(np.shape(x)).astype(np.float32)


def int8_product(dense: np.ndarray, biases: np.ndarray, x: np.ndarray, group: int) -> np.ndarray:
    """What the C kernels compute for rows w = scale * code + bias (dense: the rows decoded, biases: (n,
    groups)): the codes' part with x quantized to 8 bits, the biases' part with x itself (its exact group sums)."""
    def bias_part(v):
        return np.asarray(v, np.float64).reshape(*np.shape(v)[:-1], -1, group).sum(-1) @ biases.T
    quantized = int8_activations(x, group)
    return (quantized @ dense.T - bias_part(quantized) + bias_part(x)).astype(np.float32)


def row_biases(rows: np.ndarray, d: int, bits: int, group: int) -> np.ndarray:
    """(n, groups) the fp16 biases of rows in the image's format, as floats."""
    start = d * bits // 8 + 2 * (d // group)
    return np.ascontiguousarray(rows[:, start:start + 2 * (d // group)]).view(np.float16).astype(np.float64)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
def test_c_products_of_stored_rows_are_mlx_quantized_matmuls(bits, group):
    """The CPU path's products over 4/8-bit rows (lsparse/kernels/native/q.c) against MLX's own
    quantized_matmul on the same rows: exact for x quantized to 8 bits as the kernel does, within 3% of the
    largest output for x itself; with slots gathered at random and rows whose coefficient is 0 skipped."""
    import mlx.core as mx

    from lsparse.kernels import native
    products = native.load()
    if products is None:
        pytest.skip("no C compiler here: the C kernels cannot be built")
    rng = np.random.default_rng(group + bits)
    d, n = 1024, 300
    weights = rng.standard_normal((n, d)).astype(np.float32)
    codes = quantize_rows(weights, bits, group)
    q, s, b = mx.quantize(mx.array(weights.astype(np.float16)), group_size=group, bits=bits)
    slots = rng.choice(n, 200, replace=False)
    x = rng.standard_normal(d).astype(np.float32)
    a = rng.standard_normal(200).astype(np.float32)
    a[::5] = 0

    def mlx_mv(v):
        out = mx.quantized_matmul(mx.array(v[None]), q, s.astype(mx.float32), b.astype(mx.float32), transpose=True,
                                  group_size=group, bits=bits)
        return np.array(out)[0][slots]

    dense = np.array(mx.dequantize(q, s.astype(mx.float32), b.astype(mx.float32), group_size=group, bits=bits))
    biases = np.array(b.astype(mx.float32)).astype(np.float64)
    y = products.mv_q(codes, slots, x, bits, group)
    np.testing.assert_allclose(y, int8_product(dense[slots], biases[slots], x, group), rtol=1e-4, atol=1e-3)
    assert np.abs(y - mlx_mv(x)).max() <= 0.03 * np.abs(mlx_mv(x)).max()
    np.testing.assert_allclose(products.vm_q(codes, slots, a, d, bits, group), a @ dense[slots], rtol=1e-4,
                               atol=1e-3)


def test_c_products_split_over_threads_add_up_to_one_call(monkeypatch):
    """Large products run in parts on several threads (lsparse/kernels/native.py): each part's rows land in
    their place and the down product's partial sums all count."""
    from lsparse.kernels import native
    products = native.load()
    if products is None:
        pytest.skip("no C compiler here: the C kernels cannot be built")
    d, n, bits = 256, 101, 4
    rng = np.random.default_rng(5)
    weights = rng.standard_normal((n, d)).astype(np.float32)
    codes = quantize_rows(weights, bits, GROUP)
    slots = rng.permutation(n)[:97]
    x, a = rng.standard_normal(d).astype(np.float32), rng.standard_normal(97).astype(np.float32)

    def all_four():
        return [products.mv(weights, slots, x), products.vm(weights, slots, a),
                products.mv_q(codes, slots, x, bits, GROUP), products.vm_q(codes, slots, a, d, bits, GROUP)]

    monkeypatch.setattr(native, "THREADS", 1)
    whole = all_four()
    monkeypatch.setattr(native, "THREADS", 3)
    monkeypatch.setattr(native, "SPLIT_MIN_WEIGHTS", d)  # every product is split three ways, unevenly
    monkeypatch.setitem(native._pool, "pool", ThreadPoolExecutor(3))
    for one, parts in zip(whole, all_four(), strict=True):
        np.testing.assert_allclose(parts, one, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(whole[0], weights[slots] @ x, rtol=1e-4, atol=1e-4)


def test_kernel_bench_figures_are_consistent(monkeypatch):
    """Through the backends' interface; `reference` stands for metal-q4 (the Metal backend, its kernel calls
    answered by numpy), so that the Mac's rows of the table are computed by the same code here."""
    from lsparse.bench import kernels
    monkeypatch.setitem(kernels.IMPLEMENTATIONS, "reference", ("reference", 4))
    result = kernels.bench_kernels(geometries=("builtin",), fractions=(0.1, 1.0), implementations=("cpu", "reference"),
                                   seconds=0.01)
    assert [(r["active_share"], r["implementation"]) for r in result["rows"]] == [
        (0.1, "cpu"), (1.0, "cpu"), (0.1, "reference"), (1.0, "reference")]
    best = min(r["dense_ms"] for r in result["rows"])
    for r in result["rows"]:
        assert r["sparse_ms"] > 0 and r["dense_ms"] > 0
        assert r["speedup"] == pytest.approx(r["dense_ms"] / r["sparse_ms"])
        assert r["ideal_speedup"] == pytest.approx(1 / r["active_share"])
        assert r["share_of_ideal"] == pytest.approx(r["speedup"] / r["ideal_speedup"])
        assert r["vs_best_dense"] == pytest.approx(best / r["sparse_ms"])


def test_kernel_bench_steps_compute_the_same_ffn_in_every_backend():
    from lsparse.bench.kernels import ffn_step
    active = np.arange(0, 256, 3)
    outs = {name: ffn_step(name, 64, 256, np.random.default_rng(5))(active) for name in ("cpu", "mlx-q4")}
    np.testing.assert_allclose(outs["mlx-q4"], outs["cpu"], rtol=1e-4, atol=1e-4 * np.abs(outs["cpu"]).max())


def test_a_prefaulted_store_holds_its_pages_from_the_start():
    """Under a budget the caches' pages are mapped at allocation (MAP_POPULATE), not while the first tokens
    write rows into them; without one they stay untouched until used."""
    from lsparse.kernels.backends import CpuKernels

    def rss() -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

    kernels = CpuKernels(4096, 4, 64, native=False)
    kernels.quantized = True  # rows kept as stored, as the C kernels keep them
    count = (64 << 20) // kernels.row_bytes
    before = rss()
    lazy = kernels.empty(count)
    assert rss() - before < 8 << 20
    before = rss()
    ready = kernels.empty(count, prefault=True)
    assert rss() - before > 60 << 20
    assert ready.shape == lazy.shape == (count, kernels.row_bytes) and not ready.any() and ready.flags.writeable


def fake_compiler(folder, refuse: str):
    """A C compiler that refuses any argument containing `refuse` (as Apple's older clang refuses
    -march=native), passing the rest to the system's."""
    from lsparse.kernels.native import compiler
    real = compiler()
    path = folder / "cc"
    path.write_text(f"#!/bin/sh\nfor a in \"$@\"; do case \"$a\" in *{refuse}*)\n"
                    f"  echo \"error: unknown argument: '$a'\" >&2; exit 1;; esac; done\nexec {real} \"$@\"\n")
    path.chmod(0o755)
    return path


@pytest.mark.parametrize("refuse", ["-march=native", "=native"])
def test_the_c_kernels_build_where_the_compiler_refuses_march_native(tmp_path, monkeypatch, refuse):
    """-march=native refused: -mcpu=native, then no target flag at all; the library builds and multiplies."""
    from lsparse.kernels import native
    if native.compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("CC", str(fake_compiler(tmp_path, refuse)))
    monkeypatch.setattr(native, "CACHE", tmp_path / "cache")
    arch, _ = native.target(str(tmp_path / "cc"))
    assert arch == (("-mcpu=native",) if refuse == "-march=native" else ())
    lib = native._build()
    assert lib is not None and (tmp_path / "cache").exists()


def test_a_c_build_that_fails_says_so(tmp_path, monkeypatch, capsys):
    from lsparse.kernels import native
    if native.compiler() is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("CC", str(fake_compiler(tmp_path, "-shared")))
    monkeypatch.setattr(native, "CACHE", tmp_path / "cache")
    assert native._build() is None
    assert "the C kernels did not build" in capsys.readouterr().err
