"""`lsparse bench kernels`: the sparse FFN against the dense one, at a share of active neurons from 5% to
100%, at the built-in model's geometry and at 7B's, for each implementation this machine can run.

An FFN step here is what one layer does per token: the gate and up products of the active neurons, the
activation, and the down product, from the rows of the neuron cache. Implementations:
- numpy: the rows held decoded in fp32 (the runtime's CPU path), gathered and multiplied with OpenBLAS;
- mlx-q4: the rows held 4-bit, gathered with `take` and multiplied with `quantized_matmul`;
- metal: lsparse's kernels on the slot lists (only where `mx.metal.is_available()`).
Each is set against its own dense step (every neuron), so the ratio shows what sparsity buys in that
implementation; the ideal ratio is 1 / active share, the bytes a step need not touch.
"""

from __future__ import annotations

import time

import numpy as np

GEOMETRIES = {"builtin": (64, 256), "7b": (4096, 11008)}
FRACTIONS = (0.05, 0.10, 0.20, 0.40, 0.60, 1.00)


def _timeit(fn, seconds: float) -> float:
    """Median seconds per call, after one warm-up call."""
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def _numpy(d: int, f: int, rng):
    gate, up, down = (rng.standard_normal((f, d)).astype(np.float32) for _ in range(3))  # down: columns as rows
    x = rng.standard_normal(d).astype(np.float32)

    def step(active):
        if active is None:
            g, u = gate @ x, up @ x
            return (np.maximum(g, 0) * u) @ down
        g, u = gate[active] @ x, up[active] @ x
        return (np.maximum(g, 0) * u) @ down[active]

    return step


def _mlx_q4(d: int, f: int, rng):
    import mlx.core as mx
    mats = [mx.quantize(mx.array(rng.standard_normal((f, d)).astype(np.float16)), group_size=64, bits=4)
            for _ in range(3)]
    mats = [(q, s.astype(mx.float32), b.astype(mx.float32)) for q, s, b in mats]
    x = mx.array(rng.standard_normal((1, d)).astype(np.float32))

    def qmv(m, v, idx):
        q, s, b = m if idx is None else (mx.take(m[0], idx, 0), mx.take(m[1], idx, 0), mx.take(m[2], idx, 0))
        return mx.quantized_matmul(v, q, s, b, transpose=True, group_size=64, bits=4)

    def step(active):
        idx = None if active is None else mx.array(active)
        a = mx.maximum(qmv(mats[0], x, idx), 0) * qmv(mats[1], x, idx)
        q, s, b = mats[2] if idx is None else tuple(mx.take(t, idx, 0) for t in mats[2])
        out = mx.quantized_matmul(a, q, s, b, transpose=False, group_size=64, bits=4)  # down rows: (n, d)
        mx.eval(out)
        return out

    return step


def _metal_q4(d: int, f: int, rng):
    """lsparse's Metal kernels over slot lists of a fixed capacity (all neurons), padded with -1."""
    import mlx.core as mx

    from lsparse.image.quantize import quantize_rows
    from lsparse.kernels.metal import gather_down, gather_mv
    w = [mx.array(np.ascontiguousarray(quantize_rows(rng.standard_normal((f, d)).astype(np.float32), 4))
                  .view(np.uint32)) for _ in range(3)]
    x = mx.array(rng.standard_normal(d).astype(np.float32))

    def step(active):
        slots = np.full(f, -1, dtype=np.int32)
        ids = np.arange(f) if active is None else active
        slots[: len(ids)] = ids
        s = mx.array(slots)
        a = mx.maximum(gather_mv(w[0], s, x, 4), 0) * gather_mv(w[1], s, x, 4)
        out = gather_down(w[2], s, a, 4, d)
        mx.eval(out)
        return out

    return step


IMPLEMENTATIONS = {"numpy": _numpy, "mlx-q4": _mlx_q4, "metal": _metal_q4}


def available() -> tuple[str, ...]:
    """The implementations this machine runs: metal only where MLX has a Metal device."""
    import mlx.core as mx
    return tuple(n for n in IMPLEMENTATIONS if n != "metal" or mx.metal.is_available())


def bench_kernels(geometries=tuple(GEOMETRIES), fractions=FRACTIONS, implementations=None,
                  seconds: float = 0.5, seed: int = 0, progress=None) -> dict:
    rng = np.random.default_rng(seed)
    implementations = implementations or available()
    rows = []
    for geometry in geometries:
        d, f = GEOMETRIES[geometry]
        for name in implementations:
            step = IMPLEMENTATIONS[name](d, f, rng)
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
    import os
    return {"rows": rows, "break_even": break_even(rows), "date": time.strftime("%Y-%m-%d"),
            "openblas_threads": os.environ.get("OPENBLAS_NUM_THREADS", "default")}


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
                        f"{result['openblas_threads']})")
    for col in ("geometry", "implementation", "active", "sparse ms", "dense ms", "speed-up", "ideal", "of ideal"):
        table.add_column(col, justify="left" if col in ("geometry", "implementation") else "right")
    for r in result["rows"]:
        table.add_row(f"{r['geometry']} {r['d_model']}x{r['d_ff']}", r["implementation"], f"{r['active_share']:.0%}",
                      f"{r['sparse_ms']:.3f}", f"{r['dense_ms']:.3f}", f"{r['speedup']:.2f}x",
                      f"{r['ideal_speedup']:.1f}x", f"{r['share_of_ideal']:.0%}")
    console.print(table)
    for key, share in result["break_even"].items():
        console.print(f"{key}: sparse still faster at {share:.0%} active")
