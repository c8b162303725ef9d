"""Running the Metal kernels on the CPU: the exact source MLX generates, compiled as C++ against
metal/proof/emulator.h, under AddressSanitizer and UBSan or under ThreadSanitizer, with real inputs; the
outputs are compared with the numpy path by the tests.
"""

from __future__ import annotations

import hashlib
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from lsparse.kernels import metal
from lsparse.kernels.metal import (
    KERNELS,
    METAL_DIR,
    function_name,
    launch,
    parameters,
    read_source,
    render,
    template_args,
    variant_label,
)
from lsparse.kernels.proof import checkable, clang

INCLUDE = METAL_DIR / "proof" / "emulator-include"
HALF = Path(__file__).parent / "native" / "half.h"  # included by emulator.h
SANITIZERS = {"address": ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"),
              "thread": ("-fsanitize=thread",)}
ATTRIBUTE_FROM_THREAD = {"thread_position_in_grid": "t.position_in_grid",
                         "thread_position_in_threadgroup": "t.position_in_threadgroup",
                         "threadgroup_position_in_grid": "t.threadgroup_position",
                         "threads_per_threadgroup": "t.threads_per_threadgroup",
                         "simdgroup_index_in_threadgroup": "t.simdgroup_index",
                         "thread_index_in_simdgroup": "t.index_in_simdgroup"}
BUILD_DIR = Path(tempfile.gettempdir()) / "lsparse-emulator"
POISON = 0x5A5A5A5A  # what an integer output holds before a kernel writes it


class EmulatorError(RuntimeError):
    """The kernel did something the emulator or a sanitizer caught; the message is their report."""


def program(name: str, variants: tuple[tuple[int, ...], ...], source: str | None = None) -> str:
    """A C++ program that loads a kernel's inputs from a folder, runs the grid of the variant it is asked for
    and saves its outputs: every variant's exact source after one copy of the header (or `source`, one
    variant's whole source, such as a mutant)."""
    header, _ = read_source(name)
    if source is not None:
        (values,) = variants
        text = checkable(source)
    else:
        text = checkable(header) + "".join(checkable(render(name, values)).removeprefix(checkable(header))
                                           for values in variants)
    args, loads, saves = [], [], []
    for role, arg, ctype in parameters(name):
        if role in ("input", "constant"):
            loads.append(f'  auto {arg} = emu::Buffer<{ctype}>::load(dir, "{arg}");')
            args.append(f"{arg}.data.data()")
        elif role == "shape":
            args.append(f"{arg.removesuffix('_shape')}.shape.data()")
        elif role == "output":
            loads.append(f'  auto {arg} = emu::Buffer<{ctype}>::load(dir, "{arg}");')
            saves.append(f'  {arg}.save(dir, "{arg}");')
            args.append(f"{arg}.data.data()")
        else:
            args.append(ATTRIBUTE_FROM_THREAD[arg])
    calls = []
    for values in variants:
        fn = f"{function_name(name, values)}<{', '.join(str(v) for _, v in template_args(name, values))}>"
        calls.append(f'  if (variant == "{variant_label(values)}") {{\n'
                     f"    emu::run(emu::dims(argv[2]), emu::dims(argv[3]), [&](const emu::Thread& t) {{\n"
                     f"      {fn}({', '.join(args)});\n    }});\n    ran = true;\n  }}")
    return (text + "\nint main(int argc, char** argv) {\n  if (argc != 5) return 2;\n"
            + "  const std::string dir = argv[1];\n  const std::string variant = argv[4];\n  bool ran = false;\n"
            + "\n".join(loads) + "\n" + "\n".join(calls) + "\n  if (!ran) return 4;\n"
            + "\n".join(saves) + "\n  return 0;\n}\n")


def build(name: str, variants: tuple[tuple[int, ...], ...] | None = None, sanitizer: str = "address",
          source: str | None = None) -> Path:
    """The emulator binary for a kernel's variants (all of them by default), cached by the hash of its program."""
    compiler = clang()
    if compiler is None:
        raise FileNotFoundError("clang++ is not installed (Debian: apt-get install clang; `make proof-tools`)")
    text = program(name, variants or KERNELS[name].variants, source)
    headers = "".join(path.read_text() for path in (METAL_DIR / "proof" / "emulator.h", HALF))
    key = hashlib.sha256((text + sanitizer + headers).encode()).hexdigest()
    binary = BUILD_DIR / f"{name}-{sanitizer}-{key[:16]}"
    if binary.exists():
        return binary
    BUILD_DIR.mkdir(parents=True, exist_ok=True)
    cpp = binary.with_suffix(".cpp")
    cpp.write_text(text)
    done = subprocess.run([compiler, "-std=c++20", "-O1", "-g", "-fno-omit-frame-pointer", "-pthread",
                           *SANITIZERS[sanitizer], "-Wno-unknown-attributes", "-I", str(INCLUDE), str(cpp),
                           "-o", str(binary)], capture_output=True, text=True)
    if done.returncode != 0:
        raise EmulatorError(f"the emulator program does not compile:\n{done.stderr}")
    return binary


def poisoned(shape: tuple[int, ...], dtype) -> np.ndarray:
    """An output buffer as Metal leaves it: not zeroed. NaN for floats, a sentinel for integers, so that an
    element the kernel does not write shows."""
    return np.full(shape, np.nan if np.dtype(dtype).kind == "f" else POISON, dtype=dtype)


def run(binary: Path, variant: tuple[int, ...], inputs: dict[str, np.ndarray],
        outputs: dict[str, tuple[tuple[int, ...], type]], grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int], timeout: float = 120) -> dict:
    """The outputs of one dispatch: `outputs` maps a name to (shape, dtype), poisoned before the run."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        arrays = {**inputs, **{k: poisoned(shape, dtype) for k, (shape, dtype) in outputs.items()}}
        for arg, array in arrays.items():
            np.ascontiguousarray(array).tofile(folder / f"{arg}.bin")
            (folder / f"{arg}.shape").write_text(" ".join(map(str, array.shape)))
        done = subprocess.run([str(binary), tmp, ",".join(map(str, grid)), ",".join(map(str, threadgroup)),
                               variant_label(variant)], capture_output=True, text=True, timeout=timeout,
                              env={"ASAN_OPTIONS": "detect_leaks=0", "TSAN_OPTIONS": "halt_on_error=1"})
        if done.returncode != 0:
            raise EmulatorError(done.stderr.strip() or f"exit status {done.returncode}")
        return {k: np.fromfile(folder / f"{k}.out", dtype).reshape(shape) for k, (shape, dtype) in outputs.items()}


class Ops:
    """The Metal kernels' calls (lsparse.kernels.metal's signatures, on MLX arrays) answered by the emulator:
    the exact Metal source, built under ASan and UBSan, dispatched with the grid Metal would get."""

    @staticmethod
    def _dispatch(name, values, inputs, outputs, n, d=0, bits=4):
        import mlx.core as mx
        grid, threadgroup = launch(name, n, d, bits)
        got = run(build(name), values, {k: np.array(v) for k, v in inputs.items()}, outputs, grid, threadgroup)
        return [mx.array(got[k]) for k in outputs]

    def gather_mv(self, w, slots, x, bits, group):
        n = slots.shape[0]
        if n == 0:
            return metal.gather_mv(w, slots, x, bits, group)
        return self._dispatch("gather_mv", (bits, group), {"w": w, "slots": slots, "x": x},
                              {"y": ((n,), np.float32)}, n)[0]

    def gather_gate_up(self, gate_w, up_w, slots, x, threshold, bits, group, skip):
        n = slots.shape[0]
        if n == 0:
            return metal.gather_gate_up(gate_w, up_w, slots, x, threshold, bits, group, skip)
        return tuple(self._dispatch("gather_gate_up", (bits, group, int(skip)),
                                    {"gate_w": gate_w, "up_w": up_w, "slots": slots, "x": x, "threshold": threshold},
                                    {"gate": ((n,), np.float32), "up": ((n,), np.float32)}, n))

    def gather_down(self, w, slots, a, bits, group, d):
        n = slots.shape[0]
        if n == 0:
            return metal.gather_down(w, slots, a, bits, group, d)
        partial = self._dispatch("gather_down", (bits, group), {"w": w, "slots": slots, "a": a},
                                 {"partial": ((metal.down_splits(n), d), np.float32)}, n, d, bits)[0]
        return partial.sum(axis=0)

    def compact_active(self, pre, threshold, cats):
        n = pre.shape[0]
        return self._dispatch("compact_active", (int(cats),), {"pre": pre, "threshold": threshold},
                              {"indices": ((n,), np.int32), "count": ((1,), np.int32)}, n)
