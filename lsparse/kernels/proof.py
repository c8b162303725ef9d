"""Checks of the Metal sources that run on Linux: clang++ -fsyntax-only over the exact source MLX generates,
with Metal's address spaces mapped onto clang's (metal/proof/metal_shim.h).

    python -m lsparse.kernels.proof      # checks every kernel in every variant; exit status 1 on an error
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from lsparse.kernels.metal import METAL_DIR, SOURCES, render

SHIM_INCLUDE = METAL_DIR / "proof" / "include"
CLANG_FLAGS = ("-fsyntax-only", "-std=c++17", "-x", "c++", "-Wno-unknown-attributes")


def checkable(source: str) -> str:
    """The two rewrites C++ needs (see metal_shim.h): threadgroup arrays declared in the kernel made static,
    and the attribute lists dropped from the explicit instantiation."""
    source = re.sub(r"^(\s*)threadgroup ", r"\1static threadgroup ", source, flags=re.M)
    return re.sub(r'^template \[\[host_name\("[^"]*"\)\]\] \[\[kernel\]\] ', "template ", source, flags=re.M)


def clang() -> str | None:
    return shutil.which("clang++") or shutil.which("clang++-14")


def syntax_check(source: str) -> tuple[bool, str]:
    """(whether clang accepts the source, its diagnostics)."""
    compiler = clang()
    if compiler is None:
        raise FileNotFoundError("clang++ is not installed (Debian: apt-get install clang; `make proof-tools`)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.metal.cpp"
        path.write_text(checkable(source))
        done = subprocess.run([compiler, *CLANG_FLAGS, "-I", str(SHIM_INCLUDE), str(path)], capture_output=True,
                              text=True)
    return done.returncode == 0, done.stderr


if __name__ == "__main__":
    failed = 0
    for name, value in SOURCES:
        ok, errors = syntax_check(render(name, value))
        print(f"{name} {value}: {'ok' if ok else 'ERRORS'}")
        if not ok:
            print(errors)
            failed += 1
    sys.exit(1 if failed else 0)
