"""Reading and checking an image's manifest and files (docs/IMAGE_FORMAT.md)."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

from lsparse.errors import LsparseError

FORMAT = "lsparse-image"
VERSION = 1
MANIFEST = "manifest.json"
NEURONS = "neurons.bin"


def sha256_file(path: Path, start: int = 0, size: int | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = size if size is not None else float("inf")
        while left > 0:
            chunk = f.read(int(min(left, 1 << 22)))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def load_manifest(image: Path) -> dict:
    path = Path(image) / MANIFEST
    if not Path(image).is_dir():
        raise LsparseError(f"{image}: no such image (an image is a directory made by lsparse compile)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LsparseError(f"{image}: not an lsparse image (no {MANIFEST})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LsparseError(f"{path}: malformed manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise LsparseError(f"{image}: not an lsparse image (format is {manifest.get('format')!r})")
    if manifest.get("version") != VERSION:
        raise LsparseError(f"{image}: image format version {manifest.get('version')!r} is not supported "
                           f"(this lsparse reads version {VERSION}); recompile it")
    return manifest


def check_for_run(image: Path, manifest: dict) -> None:
    """What `run` checks before it trusts an image: every file's size, and the checksum of every file but the
    neuron file (whose regions `lsparse verify` checks; hashing gigabytes at every start would cost seconds)."""
    for name, info in manifest["files"].items():
        path = Path(image) / name
        if not path.exists():
            raise LsparseError(f"{image}: {name} is missing; the image is damaged (lsparse verify tells more)")
        if path.stat().st_size != info["size"]:
            raise LsparseError(f"{image}: {name} is {path.stat().st_size} bytes, the manifest says {info['size']}: "
                               "truncated or altered")
        if name != NEURONS and sha256_file(path) != info["sha256"]:
            raise LsparseError(f"{image}: {name} does not match its checksum: altered")


def verify(image: Path) -> list[str]:
    """Every problem found: missing, truncated or altered files and neuron regions. Empty when intact."""
    image = Path(image)
    manifest = load_manifest(image)
    problems = []
    for name, info in manifest["files"].items():
        path = image / name
        if not path.exists():
            problems.append(f"{name}: missing")
        elif path.stat().st_size != info["size"]:
            problems.append(f"{name}: {path.stat().st_size} bytes, expected {info['size']} (truncated or altered)")
        elif sha256_file(path) != info["sha256"]:
            problems.append(f"{name}: checksum mismatch (altered)")
    neurons = image / NEURONS
    if neurons.exists():
        size = neurons.stat().st_size
        for layer in manifest["layers"]:
            r = layer["region"]
            if r["offset"] + r["size"] > size:
                problems.append(f"layer {layer['index']}: neuron region ends past the end of {NEURONS}")
            elif sha256_file(neurons, r["offset"], r["size"]) != r["sha256"]:
                problems.append(f"layer {layer['index']}: neuron region checksum mismatch")
    return problems


@contextmanager
def staging_directory(out: Path):
    """A temporary sibling of `out` to write an image into; it replaces `out` when the block completes and is
    removed on any failure, so that nothing half-written ever looks like an image."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        yield tmp
        if out.exists():
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.errno == errno.ENOSPC:
            raise LsparseError(f"the disk is full while writing {out}; nothing was written") from None
        raise LsparseError(f"cannot write {out}: {e}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
