"""`lsparse bench kernels`: the sparse FFN against the dense one, at a share of active neurons from 5% to
100%, at the built-in model's geometry and at 7B's, for each kernel backend this machine can run, through
the interface the runtime computes with (lsparse/kernels/backends.py).

An FFN step here is what one layer does per token: the gate and up products of the active neurons, the
activation, and the down product. Sparse: the rows sit in a neuron-cache store and the active neurons come
as a slot list; dense: every row in a held store, multiplied whole. Backends:
- cpu: rows kept 4-bit as stored and multiplied where they lie by lsparse's C kernels, sparse and dense;
- cpu-fp16: an fp16 image's rows, decoded to fp32 as they arrive, multiplied where they lie in C (sparse)
  and by OpenBLAS (dense);
- cpu-numpy-gather: the CPU path where no C compiler is found: rows decoded to fp32, gathered by numpy (a
  copy of the rows) and multiplied by OpenBLAS; dense, OpenBLAS over every row;
- mlx: rows 4-bit, gathered with `take` and multiplied by `quantized_matmul`;
- metal: lsparse's Metal kernels on the slot lists, 4-bit and fp16 (only where `mx.metal.is_available()`).
Each is set against its own dense step, so the ratio shows what sparsity buys in that backend, and against the
fastest dense step measured at that geometry (`vs_best_dense`); the ideal ratio is 1 / active share, the
bytes a step need not touch.
"""

from __future__ import annotations

import time

import numpy as np

from lsparse.kernels import native
from lsparse.model.backend import array_module

GROUP = 64  # the group size `lsparse compile` writes by default
GEOMETRIES = {"builtin": (64, 256), "7b": (4096, 11008)}
FRACTIONS = (0.05, 0.10, 0.20, 0.40, 0.60, 1.00)
IMPLEMENTATIONS = {"cpu": ("cpu", 4), "cpu-fp16": ("cpu", 16), "cpu-numpy-gather": ("cpu", 4),
                   "mlx-q4": ("mlx", 4), "metal-q4": ("metal", 4),
                   "metal-fp16": ("metal", 16)}  # name: (backend, bits of the rows)


def _timeit(fn, seconds: float) -> float:
    """Median seconds per call, after one warm-up call."""
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def ffn_step(name: str, d: int, f: int, rng):
    """step(active): one ReLU FFN step through the backend, over the active neurons (None: dense)."""
    from lsparse.image.quantize import quantize_rows
    from lsparse.kernels.backends import CpuKernels, select
    backend, bits = IMPLEMENTATIONS[name]
    if name == "cpu-numpy-gather":
        kernels = CpuKernels(d, bits, GROUP, native=False)
    else:
        kernels = select(backend, d, bits, GROUP)
    cache, held = {}, {}
    for c in ("gate", "up", "down"):  # down: columns as rows
        rows = kernels.prepare(quantize_rows(rng.standard_normal((f, d)).astype(np.float32), bits, GROUP), 1)[:, 0]
        cache[c] = kernels.empty(f)
        kernels.put(cache[c], np.arange(f), rows)
        held[c] = kernels.hold(rows)
        del rows
    x = rng.standard_normal((1, d)).astype(np.float32)

    def step(active):
        """The FFN step as the runtime computes it (gate and up in one call), computed to the end: a lazy
        backend's graph is evaluated once, by the host's read."""
        stores, slots = (held, None) if active is None else (cache, active)
        gate, up = kernels.gate_up(stores["gate"], stores["up"], slots, x, 0.0)
        a = (np if isinstance(gate, np.ndarray) else array_module("mlx")).maximum(gate, 0) * up
        return kernels.host(kernels.vm(stores["down"], slots, a))[0]

    return step


def available() -> tuple[str, ...]:
    """The implementations this machine runs: metal only where MLX has a Metal device."""
    import mlx.core as mx
    return tuple(n for n in IMPLEMENTATIONS if not n.startswith("metal") or mx.metal.is_available())


def bench_kernels(geometries=tuple(GEOMETRIES), fractions=FRACTIONS, implementations=None,
                  seconds: float = 0.5, seed: int = 0, progress=None) -> dict:
    rng = np.random.default_rng(seed)
    implementations = implementations or available()
    rows = []
    for geometry in geometries:
        d, f = GEOMETRIES[geometry]
        for name in implementations:
            step = ffn_step(name, d, f, rng)
            dense = _timeit(lambda step=step: step(None), seconds)
            for share in fractions:
                if progress:
                    progress(f"{geometry} {name} {share:.0%}")
                active = np.sort(rng.choice(f, max(1, round(share * f)), replace=False))
                sparse = _timeit(lambda a=active, step=step: step(a), seconds)
                rows.append({"geometry": geometry, "d_model": d, "d_ff": f, "implementation": name,
                             "active_share": share, "sparse_ms": 1e3 * sparse, "dense_ms": 1e3 * dense,
                             "speedup": dense / sparse, "ideal_speedup": 1 / share,
                             "share_of_ideal": dense / sparse * share})
    for r in rows:
        best = min(o["dense_ms"] for o in rows if o["geometry"] == r["geometry"])
        r["vs_best_dense"] = best / r["sparse_ms"]
    import os
    return {"rows": rows, "break_even": break_even(rows), "date": time.strftime("%Y-%m-%d"),
            "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default"), "c_threads": native.THREADS}


def break_even(rows: list[dict]) -> dict:
    """Per geometry and implementation: the largest active share measured at which sparse still beats dense."""
    out = {}
    for r in rows:
        key = f"{r['geometry']}/{r['implementation']}"
        if r["speedup"] > 1 and r["active_share"] > out.get(key, 0.0):
            out[key] = r["active_share"]
    return out


def print_kernels(result: dict, console=None) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table
    console = console or Console(width=None if sys.stdout.isatty() else 120)
    table = Table(title=f"sparse FFN step against dense, per layer and token (OPENBLAS_NUM_THREADS="
                        f"{result['openblas_threads']}, C kernels on {result.get('c_threads', 1)} threads)")
    for col in ("geometry", "implementation", "active", "sparse ms", "dense ms", "speed-up", "ideal", "of ideal",
                "vs best dense"):
        table.add_column(col, justify="left" if col in ("geometry", "implementation") else "right")
    for r in result["rows"]:
        table.add_row(f"{r['geometry']} {r['d_model']}x{r['d_ff']}", r["implementation"], f"{r['active_share']:.0%}",
                      f"{r['sparse_ms']:.3f}", f"{r['dense_ms']:.3f}", f"{r['speedup']:.2f}x",
                      f"{r['ideal_speedup']:.1f}x", f"{r['share_of_ideal']:.0%}", f"{r['vs_best_dense']:.2f}x")
    console.print(table)
    for key, share in result["break_even"].items():
        console.print(f"{key}: sparse still faster at {share:.0%} active")
    memory = result.get("memory")
    if memory:
        console.print(f"From memory (rows of 24 layers, beyond the caches), 7B 4-bit; streaming read "
                      f"{memory['stream_gbps']:.1f} GB/s on these cores:")
        for r in memory["rows"]:
            peer = f", {r['vs_llama_cpp_dense']:.1f}x llama.cpp's dense step" if "vs_llama_cpp_dense" in r else ""
            console.print(f"  {r['active_share']:.0%} active: {r['step_ms']:.3f} ms, {r['gbps']:.1f} GB/s "
                          f"({r['of_bandwidth']:.0%} of streaming){peer}")
        if memory["llama_cpp"]:
            console.print(f"  llama.cpp dense step ({memory['llama_cpp']['settings']}): "
                          f"{memory['llama_cpp']['step_ms']:.2f} ms per token")
