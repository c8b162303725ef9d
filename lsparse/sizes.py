"""Byte sizes as users write them: 512MB, 2GB, 1.5G, 360MiB (binary units: 1K = 1024 bytes)."""

from __future__ import annotations

import math
import re

from lsparse.errors import LsparseError

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise LsparseError(f"cannot read the size {text!r} (examples: 512MB, 2GB, 1.5G)")
    return int(float(m.group(1)) * UNITS[m.group(2)])


def parse_share(text: str, option: str) -> float:
    """A share as users write it: 1% or 0.01."""
    body = text.strip()
    try:
        share = float(body[:-1]) / 100 if body.endswith("%") else float(body)
    except ValueError:
        raise LsparseError(f"{option}: cannot read the share {text!r} (examples: 1%, 0.01)") from None
    if not math.isfinite(share):
        raise LsparseError(f"{option}: the share must be a finite number, got {text!r}")
    return share
