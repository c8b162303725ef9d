"""`lsparse bench kernels --model`: what the Metal kernels should cost on Apple silicon, by counting. PREDICTED:
no Mac has run them (no Mac here); `make mac-check` measures them on one.

For one layer's FFN at a geometry and share of active neurons: the bytes each kernel moves to and from memory
(rows, partial sums, slot lists, outputs; x is 16 KB at 7B and is read from the caches after the first SIMD
group, so it is listed apart), the threadgroups and threads it launches (the launch configuration the code
uses, lsparse.kernels.metal.launch), and a floor on its time at each chip's memory bandwidth as Apple publishes
it: a kernel cannot move its bytes faster. Beside them, MLX's dense 4-bit FFN (three quantized_matmul over
every row) for the same layer, counted the same way. Two costs the floor leaves out are listed as assumptions:
a dispatch (about 5 us each to encode and launch) and the host's read once per layer (about 100 us for the
GPU to finish and the CPU to see it); both are guesses until a Mac measures them.
"""

from __future__ import annotations

import time

from lsparse.image.quantize import row_bytes
from lsparse.kernels.metal import ROWS_PER_SIMDGROUP, down_splits, launch, padded_length

# name: (memory bandwidth GB/s, GPU cores), Apple's published figures for the base and Max chips
CHIPS = {"M1": (68.25, 8), "M1 Max": (400, 32), "M2": (100, 10), "M2 Max": (400, 38), "M3": (100, 10),
         "M3 Max": (400, 40), "M4": (120, 10), "M4 Max": (546, 40)}
GEOMETRIES = {"builtin": (64, 256), "7b": (4096, 11008)}
DISPATCH_S = 5e-6     # assumed: encoding and launching one kernel
HOST_READ_S = 100e-6  # assumed: the GPU finishing a layer and the CPU reading its mask
F32 = 4


def kernel_rows(d: int, d_ff: int, share: float, bits: int = 4, group: int = 64) -> list[dict]:
    """One layer's kernels at n = share x d_ff active neurons: bytes from memory, x's bytes (cache), launch."""
    n = padded_length(max(1, round(share * d_ff)))
    rb = row_bytes(d, bits, group)
    rows = []

    def add(kernel, memory, cache, n_slots, dispatches=1, width=d):
        if kernel.startswith("mlx"):
            grid, group_size = None, None
        else:
            grid, group_size = launch(kernel.split()[0], n_slots, width, bits)
        threadgroups = None if grid is None else (-(-grid[0] // group_size[0])) * (-(-grid[1] // group_size[1]))
        rows.append({"kernel": kernel, "active": n, "memory_bytes": memory, "cache_bytes": cache,
                     "threadgroups": threadgroups, "threads": None if grid is None else grid[0] * grid[1],
                     "dispatches": dispatches})
    add("gather_gate_up", 2 * n * rb + n * F32 + 2 * n * F32, -(-n // ROWS_PER_SIMDGROUP) * d * F32, n)
    splits = down_splits(n)
    # the rows, slots and coefficients; the splits' partial sums written, then read and summed by MLX
    add("gather_down", n * rb + 2 * n * F32 + 2 * splits * d * F32 + d * F32, 0, n, dispatches=2)
    add("compact_active (exact mode)", 2 * d_ff * F32, 0, d_ff)
    add("mlx gate, every row (exact mode)", d_ff * rb + d_ff * F32, d * F32, d_ff)
    add("mlx dense FFN (3 x quantized_matmul)", 3 * d_ff * rb + 2 * d_ff * F32 + d * F32, 2 * d * F32, d_ff, 3)
    return rows


def predict(geometries=("7b",), shares=(0.05, 0.10, 0.20)) -> dict:
    """Per geometry and share: each kernel's row, then the layer's totals in predicted and exact mode and the
    dense FFN, each with its floor (bytes / bandwidth) on every chip and the assumed overheads."""
    out = []
    for geometry in geometries:
        d, d_ff = GEOMETRIES[geometry]
        for share in shares:
            kernels = kernel_rows(d, d_ff, share)
            by = {r["kernel"]: r for r in kernels}
            sparse = [by["gather_gate_up"], by["gather_down"]]
            totals = {
                "sparse FFN, predicted mode": (sparse, 1),
                "sparse FFN, exact mode": (sparse + [by["compact_active (exact mode)"],
                                                     by["mlx gate, every row (exact mode)"]], 1),
                "dense FFN (MLX)": ([by["mlx dense FFN (3 x quantized_matmul)"]], 0),
            }
            for r in kernels:
                r.update(geometry=geometry, share=share, floor_us=_floors(r["memory_bytes"]))
            layer = []
            for name, (parts, host_reads) in totals.items():
                memory = sum(p["memory_bytes"] for p in parts)
                dispatches = sum(p["dispatches"] for p in parts)
                overhead = dispatches * DISPATCH_S + host_reads * HOST_READ_S
                layer.append({"geometry": geometry, "share": share, "path": name, "memory_bytes": memory,
                              "dispatches": dispatches, "host_reads": host_reads,
                              "floor_us": _floors(memory),
                              "with_overhead_us": {c: f + 1e6 * overhead for c, f in _floors(memory).items()}})
            out.append({"geometry": geometry, "share": share, "kernels": kernels, "layer": layer})
    return {"predicted": True, "date": time.strftime("%Y-%m-%d"), "chips": CHIPS,
            "assumptions": {"dispatch_us": 1e6 * DISPATCH_S, "host_read_us": 1e6 * HOST_READ_S,
                            "bits": 4, "group_size": 64},
            "rows": out}


def _floors(memory_bytes: int) -> dict:
    """Microseconds to move these bytes at each chip's bandwidth."""
    return {chip: 1e6 * memory_bytes / (bandwidth * 1e9) for chip, (bandwidth, _) in CHIPS.items()}


SHORT = {"gather_gate_up": "gate_up", "gather_down": "down+sum", "compact_active (exact mode)": "compact",
         "mlx gate, every row (exact mode)": "MLX gate", "mlx dense FFN (3 x quantized_matmul)": "MLX dense",
         "sparse FFN, predicted mode": "=predicted", "sparse FFN, exact mode": "=exact", "dense FFN (MLX)": "=dense"}
SHOWN_CHIPS = ("M1", "M2 Max", "M4 Max")


def print_model(result: dict, console=None) -> None:
    import sys

    from rich.console import Console
    from rich.table import Table
    console = console or Console(file=sys.stdout)
    table = Table(title="Metal kernels, one layer, 4-bit groups of 64: PREDICTED, not measured")
    for column in ("geometry", "active", "kernel", "MB", "TGs", "calls", *[f"{c} us" for c in SHOWN_CHIPS]):
        table.add_column(column, justify="left" if column in ("geometry", "kernel") else "right", no_wrap=True)
    for row in result["rows"]:
        head = (row["geometry"], f"{row['share']:.0%}")
        for k in row["kernels"]:
            table.add_row(*head, SHORT[k["kernel"]], f"{k['memory_bytes'] / 1e6:.2f}", str(k["threadgroups"] or "-"),
                          str(k["dispatches"]), *[f"{k['floor_us'][c]:.1f}" for c in SHOWN_CHIPS])
            head = ("", "")
        for t in row["layer"]:
            table.add_row("", "", SHORT[t["path"]], f"{t['memory_bytes'] / 1e6:.2f}", "", str(t["dispatches"]),
                          *[f"{t['floor_us'][c]:.0f}/{t['with_overhead_us'][c]:.0f}" for c in SHOWN_CHIPS])
    console.print(table)
    a = result["assumptions"]
    console.print(f"us: bytes from memory / the chip's published bandwidth (a floor); for a layer, floor/with "
                  f"assumed overheads ({a['dispatch_us']:.0f} us a dispatch, {a['host_read_us']:.0f} us a host "
                  "read). TGs: threadgroups launched. No Mac has measured these: `make mac-check` does.")
