"""The Metal source MLX would compile on a Mac, captured on any machine: while `mx.export_function` traces a
call, `metal_kernel` does not need a Metal device, and with verbose=True MLX prints the exact source.

    python -m lsparse.kernels.capture OUT_DIR    # writes OUT_DIR/<kernel>-<variant>.metal for every kernel
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from lsparse.kernels.metal import BITS, SOURCES

BLOCK = re.compile(r"Generated source code for `([^`]+)`:\n```\n(.*?)\n```", re.S)


def _trace_all() -> None:
    """In this process: trace one call of every kernel at every precision, printing MLX's source."""
    import mlx.core as mx

    from lsparse.kernels.metal import compact_active, gather_down, gather_mv
    d, capacity = 128, 8
    with tempfile.TemporaryDirectory() as tmp:
        for bits in BITS:
            words = d * bits // 32 + (0 if bits == 16 else d // 32)
            w = mx.zeros((capacity, words), dtype=mx.uint32)
            slots = mx.zeros((capacity,), dtype=mx.int32)
            vec = mx.zeros((d,))
            mx.export_function(f"{tmp}/mv{bits}.mlxfn",
                               lambda w, s, x, b=bits: gather_mv(w, s, x, b, verbose=True), w, slots, vec)
            mx.export_function(f"{tmp}/down{bits}.mlxfn",
                               lambda w, s, a, b=bits: gather_down(w, s, a, b, d, verbose=True), w, slots,
                               mx.zeros((capacity,)))
            sys.stdout.flush()
        for cats in (0, 1):
            mx.export_function(f"{tmp}/compact{cats}.mlxfn",
                               lambda p, t, c=cats: compact_active(p, t, c, verbose=True), mx.zeros((capacity,)),
                               mx.zeros((1,)))
            sys.stdout.flush()


def capture() -> dict[tuple[str, int], str]:
    """{(kernel, variant): the source MLX generates}, from a child process (MLX prints from C++)."""
    done = subprocess.run([sys.executable, "-c", "from lsparse.kernels.capture import _trace_all; _trace_all()"],
                          capture_output=True, text=True, check=True)
    found = BLOCK.findall(done.stdout)
    order = [(name, bits) for bits in BITS for name in ("gather_mv", "gather_down")] + \
        [("compact_active", cats) for cats in (0, 1)]
    if len(found) != len(order) or any(f"lsparse_{n}" != k for (k, _), (n, _) in zip(found, order, strict=True)):
        raise RuntimeError(f"unexpected MLX output: {[k for k, _ in found]}")
    # the pattern takes the newline before the closing fence: give it back
    return {key: source + "\n" for key, (_, source) in zip(order, found, strict=True)}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for (name, value), source in capture().items():
        (out / f"{name}-{value}.metal").write_text(source)
    print(f"{len(SOURCES)} sources written to {out}")
