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

from lsparse.kernels.metal import SOURCES, variant_label

BLOCK = re.compile(r"Generated source code for `([^`]+)`:\n```\n(.*?)\n```", re.S)


def _trace(name: str, values: tuple[int, ...], folder: str) -> None:
    """Trace one call of a kernel variant, MLX printing its source."""
    import mlx.core as mx

    from lsparse.kernels import metal
    d, n = 128, 8
    bits, group = values[:2] if name != "compact_active" else (4, 64)
    words = d * bits // 32 + (0 if bits == 16 else d // group)
    w, slots, vec = mx.zeros((n, words), dtype=mx.uint32), mx.zeros((n,), dtype=mx.int32), mx.zeros((d,))
    path = f"{folder}/{name}-{variant_label(values)}.mlxfn"
    if name == "gather_mv":
        mx.export_function(path, lambda w, s, x: metal.gather_mv(w, s, x, bits, group, verbose=True), w, slots, vec)
    elif name == "gather_gate_up":
        mx.export_function(path, lambda g, u, s, x, t: metal.gather_gate_up(g, u, s, x, t, bits, group, values[2],
                                                                            verbose=True),
                           w, w, slots, vec, mx.zeros((1,)))
    elif name == "gather_down":
        mx.export_function(path, lambda w, s, a: metal.gather_down(w, s, a, bits, group, d, verbose=True), w, slots,
                           mx.zeros((n,)))
    else:
        mx.export_function(path, lambda p, t: metal.compact_active(p, t, values[0], verbose=True), vec,
                           mx.zeros((1,)))
    sys.stdout.flush()


def _trace_all() -> None:
    """In this process: trace one call of every kernel variant, in SOURCES' order."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, values in SOURCES:
            _trace(name, values, tmp)


def capture() -> dict[tuple[str, tuple[int, ...]], str]:
    """{(kernel, variant): the source MLX generates}, from a child process (MLX prints from C++)."""
    done = subprocess.run([sys.executable, "-c", "from lsparse.kernels.capture import _trace_all; _trace_all()"],
                          capture_output=True, text=True, check=True)
    found = BLOCK.findall(done.stdout)
    if len(found) != len(SOURCES) or any(f"lsparse_{n}" != k for (k, _), (n, _) in zip(found, SOURCES, strict=True)):
        raise RuntimeError(f"unexpected MLX output: {[k for k, _ in found]}")
    # the pattern takes the newline before the closing fence: give it back
    return {key: source + "\n" for key, (_, source) in zip(SOURCES, found, strict=True)}


if __name__ == "__main__":
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.metal"):
        old.unlink()
    for (name, values), source in capture().items():
        (out / f"{name}-{variant_label(values)}.metal").write_text(source)
    print(f"{len(SOURCES)} sources written to {out}")
