"""One file to ship an image in: a tar stream of the image directory, compressed with zstandard. Only the
packed file is compressed; an unpacked image's neuron file is plain again, since it is read at random.

Unpacking writes to a temporary sibling, writes only the files the pack's manifest lists at the sizes it
states, verifies every checksum and renames: a damaged or cut-short pack never leaves anything that looks like
an image, and a crafted one cannot write more than its manifest announced.
"""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

from lsparse.errors import LsparseError
from lsparse.image.image import Image
from lsparse.image.manifest import MANIFEST, MAX_MANIFEST_BYTES, Manifest
from lsparse.image.writer import staging

SUFFIX = ".lsimg.zst"


def pack(image, out, level: int = 3, force: bool = False) -> dict:
    """Write `image` to `out` (an existing pack only with `force`); returns the sizes before and after."""
    import zstandard
    image, out = Path(image), Path(out)
    manifest = Image.open(image).manifest
    names = [MANIFEST, *sorted(manifest.files)]  # the manifest first: a reader learns what follows
    missing = [n for n in names if not (image / n).is_file()]
    if missing:
        raise LsparseError(f"{image}: {', '.join(missing)} missing; the image is damaged (lsparse verify tells more)")
    with staging(out, force, kind="pack") as tmp:
        with open(tmp, "wb") as raw:
            with zstandard.ZstdCompressor(level=level, threads=-1).stream_writer(raw, closefd=False) as z:
                with tarfile.open(fileobj=z, mode="w|") as tar:
                    for name in names:
                        tar.add(image / name, arcname=name, recursive=False)
            raw.flush()
            os.fsync(raw.fileno())
    unpacked = sum(entry.size for entry in manifest.files.values()) + (image / MANIFEST).stat().st_size
    return {"image": str(image), "packed": str(out), "image_bytes": unpacked, "packed_bytes": out.stat().st_size}


def _extract(packed: Path, tar, tmp: Path) -> Manifest:
    """Every member, each a plain file the manifest (the first member) lists, of the size it states: nothing
    is written that the manifest did not announce."""
    manifest, seen = None, set()
    for member in tar:
        if not member.isfile():
            raise LsparseError(f"{packed}: {member.name} is not a plain file; not an lsparse pack")
        if manifest is None:
            if member.name != MANIFEST or member.size > MAX_MANIFEST_BYTES:
                raise LsparseError(f"{packed}: does not start with an image manifest; not an lsparse pack")
            data = tar.extractfile(member).read()
            manifest = Manifest.from_json(data, f"{packed}: {MANIFEST}")
            (tmp / MANIFEST).write_bytes(data)
            continue
        entry = manifest.files.get(member.name)
        if entry is None or member.name in seen or member.size != entry.size:
            raise LsparseError(f"{packed}: {member.name} is not a file of the size its manifest lists; damaged")
        seen.add(member.name)
        tar.extract(member, tmp, filter="data")  # refuses absolute paths and ../
    if manifest is None:
        raise LsparseError(f"{packed}: empty; not an lsparse pack")
    return manifest


def unpack(packed, out, force: bool = False) -> Manifest:
    """Extract a pack into the image directory `out` (an existing image only with `force`), verified; returns
    its manifest."""
    import zstandard
    packed, out = Path(packed), Path(out)
    if not packed.is_file():
        raise LsparseError(f"{packed}: no such file")
    with staging(out, force) as tmp:
        try:
            with open(packed, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as z:
                with tarfile.open(fileobj=z, mode="r|") as tar:
                    _extract(packed, tar, tmp)
        except (zstandard.ZstdError, tarfile.TarError, EOFError) as e:
            raise LsparseError(f"{packed}: not a complete lsparse pack ({e})") from None
        problems = Image.open(tmp).verify()
        if problems:
            raise LsparseError(f"{packed} is damaged: " + "; ".join(problems))
    return Image.open(out).manifest
