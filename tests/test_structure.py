"""The package's shape: stages import in one direction only, and a wheel carries everything lsparse reads."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "lsparse"
# The stages in data-flow order; a module may import its own stage and lower ones, never a higher one. The
# shared helpers (errors, sizes, text) sit below every stage; the public entry points (the Python API, cli, the
# package's __init__) above them all.
STAGES = ["errors", "sizes", "text", "source", "model", "calibrate", "image", "kernels", "runtime", "bench",
          "api", "cli", "__init__"]
DATA_ONLY = {"builtin", "presets"}


def stage(parts: tuple[str, ...]) -> str:
    """The stage of a module given by its path inside lsparse/ (or its dotted name's parts after lsparse)."""
    return parts[0].removesuffix(".py")


def imported_stages(path: Path):
    """(line, stage) for every lsparse module a file imports, at its top or inside a function."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names] if node.module == "lsparse" \
                else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "lsparse" and len(parts) > 1:
                yield node.lineno, parts[1]


def test_stages_import_in_one_direction():
    rank = {name: i for i, name in enumerate(STAGES)}
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        here = stage(path.relative_to(PACKAGE).parts)
        assert here in rank or here in DATA_ONLY, f"{path}: a module outside every stage; add it to STAGES"
        for line, there in imported_stages(path):
            if there in rank and rank[there] > rank[here]:
                wrong.append(f"{path.relative_to(REPO)}:{line} ({here}) imports lsparse.{there}")
    assert not wrong, "lower stages import higher ones:\n" + "\n".join(wrong)


def test_the_direction_test_sees_a_wrong_import(tmp_path):
    """The check above must be able to fail: a calibrate module importing the runtime is caught."""
    bad = tmp_path / "layout.py"
    bad.write_text("def f():\n    from lsparse.runtime.reader import FlashReader\n    return FlashReader\n")
    assert list(imported_stages(bad)) == [(2, "runtime")]


def run(command: list, cwd: Path, timeout: int = 300) -> str:
    done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(map(str, command))}:\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_a_wheel_installs_whole(tmp_path):
    """A wheel (how a Mac user installs) carries the Metal sources, the presets and the memory cap: installed
    into a fresh virtualenv and run from outside the repository, it compiles with --config and decodes through
    the Metal backend (its kernel calls answered on Linux by the emulator or the numpy reference)."""
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path / "dist"), str(REPO)], tmp_path)
    wheel = next((tmp_path / "dist").glob("lsparse-*.whl"))
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], tmp_path)
    python = venv / "bin" / "python"
    run([str(python), "-m", "pip", "install", "--quiet", "--no-deps", "--no-index", str(wheel)], tmp_path)
    # lsparse's dependencies from this environment, after the wheel's own files
    purelib = Path(run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                       tmp_path).strip())
    (purelib / "zz-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    where = run([str(python), "-c", "import lsparse; print(lsparse.__file__)"], tmp_path)
    assert where.startswith(str(purelib)), f"lsparse came from {where}, not the wheel"

    work = tmp_path / "outside"
    work.mkdir()
    lsparse = str(venv / "bin" / "lsparse")
    run([lsparse, "compile", "builtin:tinystories-reglu", "-o", "image", "--config", "reglu-llama",
         "--predictor", "svd", "--calib-tokens", "1024"], work)
    from lsparse.kernels.proof import clang
    kernels = "emulated" if clang() else "reference"
    out = run([lsparse, "run", "image", "-p", "Once", "-m", "1", "--kernels", kernels, "--mode", "predicted"], work)
    assert "Generation: 1 tokens" in out
    cap = subprocess.run([str(python), "-m", "lsparse.bench.memcap", "1G", "--", lsparse, "inspect", "image"],
                         cwd=work, capture_output=True, text=True, timeout=120)
    if os.geteuid() == 0 and Path("/sys/fs/cgroup/memory").is_dir():
        assert cap.returncode == 0 and '"peak_bytes"' in cap.stderr, cap.stderr
    else:
        assert "cannot make a memory cgroup" in cap.stderr, cap.stderr


@pytest.mark.parametrize("name", ["opt", "reglu-llama", "drelu", "swiglu-threshold", str(REPO / "configs" /
                                                                                      "example.toml")])
def test_presets_load_from_the_package_and_from_a_file(name):
    from lsparse.image.compile import CompileOptions, load_preset
    assert CompileOptions(**load_preset(name)).bits in (4, 8, 16)


def test_modules_read_in_one_sitting_and_functions_fit_a_screen():
    """No module of lsparse/ over 300 lines, no function over 60 (the brief's 'small units')."""
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        if len(text.splitlines()) > 300:
            long.append(f"{path.relative_to(REPO)}: {len(text.splitlines())} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: "
                            f"{node.end_lineno - node.lineno + 1} lines")
    assert not long, "\n".join(long)
