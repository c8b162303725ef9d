"""The one way an image is written (compile, synthetic images, unpack): into a staging folder beside the
output, manifest last, then renamed into place, so that nothing half-written ever looks like an image."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from lsparse.errors import LsparseError
from lsparse.image.bundles import ALIGN_REGION
from lsparse.image.image import sha256_file
from lsparse.image.manifest import MANIFEST, NEURONS, FileEntry, Manifest, Region
from lsparse.image.replace import check_target, commit, locked, remove_stale


class ImageWriter:
    """Files of an image being written into `root` (a staging folder)."""

    def __init__(self, root: Path):
        self.root = root
        (root / "resident").mkdir()
        self._neurons = None
        self._known_sha256 = {}  # files whose checksum the writer already has

    def path(self, name: str) -> Path:
        return self.root / name

    def save_resident(self, name: str, tensors: dict[str, np.ndarray]) -> None:
        from safetensors import SafetensorError
        from safetensors.numpy import save_file
        path = self.root / "resident" / f"{name}.safetensors"
        try:
            save_file(tensors, str(path))
        except SafetensorError as e:  # its I/O failures are not OSErrors: a full disk, told as one
            full = "StorageFull" in str(e) or "No space left" in str(e)
            raise OSError(errno.ENOSPC if full else errno.EIO, "No space left on device" if full else str(e),
                          str(path)) from None

    def append_region(self, bundles: np.ndarray) -> Region:
        """A layer's cold bundles (count, stride) uint8, in file order, appended to neurons.bin at the next
        aligned offset."""
        if self._neurons is None:
            self._neurons = open(self.root / NEURONS, "wb")
        data = np.ascontiguousarray(bundles).tobytes()
        offset = -(-self._neurons.tell() // ALIGN_REGION) * ALIGN_REGION
        self._neurons.write(b"\0" * (offset - self._neurons.tell()))
        self._neurons.write(data)
        return Region(offset=offset, count=len(bundles), size=len(data), sha256=hashlib.sha256(data).hexdigest())

    def link_neurons(self, path: Path, sha256: str) -> None:
        """A neuron file written once and shared (synthetic images' variants): hard-linked in, or copied."""
        try:
            os.link(path, self.root / NEURONS)
        except OSError:  # another file system
            shutil.copyfile(path, self.root / NEURONS)
        self._known_sha256[NEURONS] = sha256

    def finish(self, **fields) -> Manifest:
        """The manifest of every file written, checked by reading it back as any reader would, then saved."""
        if self._neurons is not None:
            self._neurons.flush()
            os.fsync(self._neurons.fileno())
            self._neurons.close()
        names = [str(p.relative_to(self.root)) for p in sorted(self.root.rglob("*")) if p.is_file()]
        files = {name: FileEntry(size=self.path(name).stat().st_size,
                                 sha256=self._known_sha256.get(name) or sha256_file(self.path(name)))
                 for name in names}
        return self.rewrite(Manifest(files=files, **fields))

    def rewrite(self, manifest: Manifest) -> Manifest:
        """Save `manifest` (the image's, with fields changed by a step that read the image written so far),
        checked by reading it back as any reader would."""
        text = manifest.to_json()
        checked = Manifest.from_json(text, "the manifest being written")
        (self.root / MANIFEST).write_text(text, encoding="utf-8")
        return checked


@contextmanager
def writing(out, force: bool = False):
    """An ImageWriter whose image appears at `out` when the block completes; with `force`, in place of the
    lsparse image that was there."""
    with staging(out, force) as tmp:
        writer = ImageWriter(tmp)
        try:
            yield writer
        finally:
            if writer._neurons is not None and not writer._neurons.closed:
                writer._neurons.close()


@contextmanager
def staging(out, force: bool, kind: str = "image"):
    """A temporary sibling of `out` to write into (a folder for an image; for a pack, a path to write a file
    at); it takes `out`'s place atomically when the block completes and is removed on any failure. Only an
    lsparse image (a pack) is ever replaced, and only with `force`; one writer per path at a time."""
    out = Path(out).absolute()
    check_target(out, force, kind)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LsparseError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        with locked(out):
            remove_stale(out)
            check_target(out, force, kind)
            tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
            if kind == "image":
                tmp.mkdir()
            try:
                yield tmp
                check_target(out, force, kind)
                commit(tmp, out)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True) if tmp.is_dir() else tmp.unlink(missing_ok=True)
                raise
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise LsparseError(f"the disk is full while writing {out}; nothing was written") from None
        raise LsparseError(f"cannot write {out}: {e.strerror or e}") from None
