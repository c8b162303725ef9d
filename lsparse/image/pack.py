"""One file to ship an image in: a tar stream of the image directory, compressed with zstandard. Only the
packed file is compressed; an unpacked image's neuron file is plain again, since it is read at random.

Unpacking writes to a temporary sibling, verifies every checksum and renames: a damaged or cut-short pack
never leaves anything that looks like an image.
"""

from __future__ import annotations

import errno
import os
import tarfile
from pathlib import Path

from lsparse.errors import LsparseError
from lsparse.image.image import Image
from lsparse.image.manifest import MANIFEST
from lsparse.image.writer import staging_directory

SUFFIX = ".lsimg.zst"


def pack(image, out, level: int = 3) -> dict:
    """Write `image` to `out`; returns the sizes before and after."""
    import zstandard
    image, out = Path(image), Path(out)
    manifest = Image.open(image).manifest
    names = [MANIFEST, *sorted(manifest.files)]  # the manifest first: a reader learns what follows
    missing = [n for n in names if not (image / n).is_file()]
    if missing:
        raise LsparseError(f"{image}: {', '.join(missing)} missing; the image is damaged (lsparse verify tells more)")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        with open(tmp, "wb") as raw:
            with zstandard.ZstdCompressor(level=level, threads=-1).stream_writer(raw, closefd=False) as z:
                with tarfile.open(fileobj=z, mode="w|") as tar:
                    for name in names:
                        tar.add(image / name, arcname=name, recursive=False)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, out)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        if e.errno == errno.ENOSPC:
            raise LsparseError(f"the disk is full while writing {out}; nothing was written") from None
        raise LsparseError(f"cannot write {out}: {e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    unpacked = sum(entry.size for entry in manifest.files.values()) + (image / MANIFEST).stat().st_size
    return {"image": str(image), "packed": str(out), "image_bytes": unpacked, "packed_bytes": out.stat().st_size}


def unpack(packed, out, force: bool = False) -> dict:
    """Extract a pack into the image directory `out`, verified; returns its manifest."""
    import zstandard
    packed, out = Path(packed), Path(out)
    if out.exists() and not force:
        raise LsparseError(f"{out} already exists (pass --force to replace it)")
    if not packed.is_file():
        raise LsparseError(f"{packed}: no such file")
    with staging_directory(out) as tmp:
        try:
            with open(packed, "rb") as raw, zstandard.ZstdDecompressor().stream_reader(raw) as z:
                with tarfile.open(fileobj=z, mode="r|") as tar:
                    for member in tar:
                        if not member.isfile():
                            raise LsparseError(f"{packed}: {member.name} is not a plain file; not an lsparse pack")
                        tar.extract(member, tmp, filter="data")  # refuses absolute paths and ../
        except (zstandard.ZstdError, tarfile.TarError, EOFError) as e:
            raise LsparseError(f"{packed}: not a complete lsparse pack ({e})") from None
        unpacked = Image.open(tmp)
        problems = unpacked.verify()
        if problems:
            raise LsparseError(f"{packed} is damaged: " + "; ".join(problems))
        extra = {str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file()} - {MANIFEST} \
            - set(unpacked.manifest.files)
        if extra:
            raise LsparseError(f"{packed}: files the manifest does not list: {', '.join(sorted(extra))}")
    return Image.open(out).manifest
