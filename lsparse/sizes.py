"""Byte sizes as users write them: 512MB, 2GB, 1.5G, 360MiB (binary units: 1K = 1024 bytes)."""

from __future__ import annotations

import re

from lsparse.errors import LsparseError

UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:I?B)?\s*", text.upper())
    if not m:
        raise LsparseError(f"cannot read the size {text!r} (examples: 512MB, 2GB, 1.5G)")
    return int(float(m.group(1)) * UNITS[m.group(2)])
