from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("LSPARSE_SHARED_DATA", REPO.parent / "shared" / "data"))


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
