"""Putting a newly written image (or pack) where the user asked, without ever losing anything: only what lsparse
wrote is replaced, the swap is atomic (the new image is at the path, or the old one still is), one writer at a
time per path, and the staging folders a killed writer left are removed by the next."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from lsparse.errors import LsparseError

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"


def is_lsparse_image(path: Path) -> bool:
    """A folder whose manifest says it is an lsparse image (of any version, damaged or not)."""
    try:
        with open(path / "manifest.json", "rb") as f:
            head = f.read(1 << 16)
        return b'"format": "lsparse-image"' in head or json.loads(head).get("format") == "lsparse-image"
    except (OSError, ValueError, AttributeError):
        return False


def is_lsparse_pack(path: Path) -> bool:
    """A file that starts as lsparse pack writes one: a zstandard frame whose first tar member is manifest.json."""
    try:
        import tarfile

        import zstandard
        with open(path, "rb") as raw:
            if raw.read(4) != ZSTD_MAGIC:
                return False
            raw.seek(0)
            with zstandard.ZstdDecompressor().stream_reader(raw) as z, tarfile.open(fileobj=z, mode="r|") as tar:
                return next(iter(tar)).name == "manifest.json"
    except Exception:  # a damaged frame or archive: zstandard and tarfile raise their own error types
        return False


def check_target(out: Path, force: bool, kind: str) -> None:
    """Refuse to write over anything but what lsparse wrote, and over that without --force."""
    folder = next((p for p in out.parents if p.exists()), None)
    if folder is not None and not folder.is_dir():
        raise LsparseError(f"cannot write {out}: {folder} is a file, not a folder")
    if not out.exists() and not out.is_symlink():
        return
    ours = is_lsparse_pack(out) if kind == "pack" else is_lsparse_image(out)
    if not ours:
        what = "an lsparse pack" if kind == "pack" else "an lsparse image"
        raise LsparseError(f"{out} exists and is not {what}; lsparse replaces only what it wrote (choose another "
                           "output path)")
    if not force:
        raise LsparseError(f"{out} already exists (pass --force to replace it)")


@contextmanager
def locked(out: Path):
    """One lsparse writer per output path at a time: a lock file beside it, held while writing."""
    import fcntl
    lock_path = out.parent / f".{out.name}.lock"
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise LsparseError(f"another lsparse process is writing {out}; wait for it to finish") from None
        try:  # the lock file may have been removed by its last holder between our open and our lock
            if os.stat(lock_path).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        yield
    finally:
        try:
            os.unlink(lock_path)
        finally:
            os.close(fd)


def remove_stale(out: Path) -> None:
    """Staging folders and files a killed writer left beside `out` (under the lock, no writer is alive)."""
    for p in out.parent.glob(f".{out.name}.partial-*"):
        _remove(p)
    for p in out.parent.glob(f".{out.name}.old-*"):
        _remove(p)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2, macOS renamex_np); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if sys.platform == "darwin":
            rc = libc.renamex_np(os.fsencode(a), os.fsencode(b), 0x2)  # RENAME_SWAP
        else:
            rc = libc.renameat2(-100, os.fsencode(a), -100, os.fsencode(b), 0x2)  # AT_FDCWD, RENAME_EXCHANGE
    except (AttributeError, OSError):
        return False
    if rc == 0:
        return True
    if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()), str(b))


def commit(staged: Path, out: Path) -> None:
    """`staged` takes `out`'s place; whatever was there is removed after. Ctrl-C cannot split the two steps:
    it is ignored while they run (the work is done by then)."""
    import threading
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN) if main else None
    try:
        if not out.exists() and not out.is_symlink():
            os.rename(staged, out)
        elif _exchange(staged, out):
            _remove(staged)  # now the old one
        else:  # no atomic swap here: the old one aside, then the new one in (a kill between leaves both aside)
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            os.rename(out, old)
            os.rename(staged, out)
            _remove(old)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
