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

from lsparse.kernels.metal import GROUP, METAL_DIR, function_name, parameters, render
from lsparse.kernels.proof import checkable, clang

INCLUDE = METAL_DIR / "proof" / "emulator-include"
SANITIZERS = {"address": ("-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"),
              "thread": ("-fsanitize=thread",)}
ATTRIBUTE_FROM_THREAD = {"thread_position_in_grid": "t.position_in_grid",
                         "thread_position_in_threadgroup": "t.position_in_threadgroup",
                         "threadgroup_position_in_grid": "t.threadgroup_position",
                         "threads_per_threadgroup": "t.threads_per_threadgroup",
                         "simdgroup_index_in_threadgroup": "t.simdgroup_index",
                         "thread_index_in_simdgroup": "t.index_in_simdgroup"}
BUILD_DIR = Path(tempfile.gettempdir()) / "lsparse-emulator"


class EmulatorError(RuntimeError):
    """The kernel did something the emulator or a sanitizer caught; the message is their report."""


def program(name: str, bits: int, source: str | None = None) -> str:
    """A C++ program that loads a kernel's inputs from a folder, runs the grid and saves its outputs."""
    source = checkable(source if source is not None else render(name, bits))
    args, loads, saves = [], [], []
    for role, arg, ctype in parameters(name):
        if role == "input":
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
    fn = f"{function_name(name, bits)}<{bits}, {GROUP}>"
    return (source + "\nint main(int argc, char** argv) {\n  if (argc != 4) return 2;\n"
            + "  const std::string dir = argv[1];\n" + "\n".join(loads) + "\n"
            + "  emu::run(emu::dims(argv[2]), emu::dims(argv[3]), [&](const emu::Thread& t) {\n"
            + f"    {fn}({', '.join(args)});\n  }});\n" + "\n".join(saves) + "\n  return 0;\n}\n")


def build(name: str, bits: int, sanitizer: str = "address", source: str | None = None) -> Path:
    """The emulator binary for a kernel (cached by the hash of its program)."""
    compiler = clang()
    if compiler is None:
        raise FileNotFoundError("clang++ is not installed (Debian: apt-get install clang; `make proof-tools`)")
    text = program(name, bits, source)
    key = hashlib.sha256((text + sanitizer + (METAL_DIR / "proof" / "emulator.h").read_text()).encode()).hexdigest()
    binary = BUILD_DIR / f"{name}-{bits}-{sanitizer}-{key[:16]}"
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


def run(binary: Path, inputs: dict[str, np.ndarray], outputs: dict[str, tuple[tuple[int, ...], type]],
        grid: tuple[int, int, int], threadgroup: tuple[int, int, int], timeout: float = 120) -> dict:
    """The outputs of one dispatch: `outputs` maps a name to (shape, dtype), zero-filled before the run."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        arrays = {**inputs, **{k: np.zeros(shape, dtype) for k, (shape, dtype) in outputs.items()}}
        for arg, array in arrays.items():
            np.ascontiguousarray(array).tofile(folder / f"{arg}.bin")
            (folder / f"{arg}.shape").write_text(" ".join(map(str, array.shape)))
        done = subprocess.run([str(binary), tmp, ",".join(map(str, grid)), ",".join(map(str, threadgroup))],
                              capture_output=True, text=True, timeout=timeout,
                              env={"ASAN_OPTIONS": "detect_leaks=0", "TSAN_OPTIONS": "halt_on_error=1"})
        if done.returncode != 0:
            raise EmulatorError(done.stderr.strip() or f"exit status {done.returncode}")
        return {k: np.fromfile(folder / f"{k}.out", dtype).reshape(shape) for k, (shape, dtype) in outputs.items()}
