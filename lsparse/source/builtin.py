"""Models that ship inside the lsparse package, in Hugging Face layout under lsparse/builtin/NAME."""

from __future__ import annotations

from pathlib import Path

from lsparse.errors import LsparseError

BUILTIN_DIR = Path(__file__).resolve().parent.parent / "builtin"


def builtin_names() -> list[str]:
    if not BUILTIN_DIR.is_dir():
        return []
    return sorted(p.name for p in BUILTIN_DIR.iterdir() if (p / "config.json").exists())


def builtin_folder(name: str) -> Path:
    if name not in builtin_names():
        known = ", ".join(builtin_names()) or "none yet"
        raise LsparseError(f"no built-in model {name!r} (built-in models: {known})")
    return BUILTIN_DIR / name
