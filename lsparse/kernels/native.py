"""The CPU path's gathered products and the flash reader's batch of reads in C (lsparse/kernels/native/),
compiled on first use with the system's C compiler for this machine (-march=native) into
~/.cache/lsparse/native/, and called through ctypes, which releases the GIL while they run. Without a
compiler, `load` and `read_shared` return None: the CPU path gathers with numpy (slower: it copies the rows
first) and the reader calls os.preadv from Python (slower below 32 KiB a read)."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

NATIVE = Path(__file__).parent / "native"
SOURCES = (NATIVE / "gather.c", NATIVE / "read.c")
# -ffast-math lets the compiler reorder the float sums, which vectorizing them needs
FLAGS = ("-O3", "-march=native", "-ffast-math", "-shared", "-fPIC")
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "lsparse" / "native"

_loaded: dict = {}


def compiler() -> str | None:
    return next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)


def library() -> ctypes.CDLL | None:
    if "lib" not in _loaded:
        _loaded["lib"] = _build()
    return _loaded["lib"]


def load():
    """The gathered products (a GatheredProducts), or None where the library cannot be built."""
    lib = library()
    return GatheredProducts(lib) if lib is not None else None


def read_shared():
    """lsparse_read_shared(fd, buffer, starts, sizes, at, needed, n, next, failed) (native/read.c), or None."""
    lib = library()
    if lib is None:
        return None
    fn = lib.lsparse_read_shared
    fn.argtypes = [ctypes.c_int, *[ctypes.c_void_p] * 5, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = None
    return fn


def _build():
    cc = compiler()
    if cc is None or os.environ.get("LSPARSE_NO_NATIVE"):
        return None
    sources = b"".join(f.read_bytes() for f in (*SOURCES, NATIVE / "half.h"))
    key = hashlib.sha256(sources + " ".join((cc, *FLAGS, platform.machine())).encode()).hexdigest()
    path = CACHE / f"native-{key[:16]}.so"
    try:
        if not path.exists():
            CACHE.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=CACHE) as tmp:  # built aside, renamed: processes may race here
                out = Path(tmp) / path.name
                done = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", str(out)], capture_output=True,
                                      text=True)
                if done.returncode != 0:
                    return None
                os.replace(out, path)
        return ctypes.CDLL(str(path))
    except OSError:  # an unwritable cache or a library that will not load: numpy does the work
        return None


class GatheredProducts:
    """mv and vm over rows at int64 slots: of a C-contiguous fp32 (count, d) array, or (the _q forms) of a
    uint8 (count, row bytes) array of 4- or 8-bit rows."""

    def __init__(self, lib):
        pointer, size, small = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        for fn in (lib.lsparse_gather_mv, lib.lsparse_gather_vm):
            fn.argtypes = [pointer, size, pointer, size, pointer, pointer]
            fn.restype = None
        for fn in (lib.lsparse_gather_mv_q, lib.lsparse_gather_vm_q):
            fn.argtypes = [pointer, size, size, small, small, pointer, size, pointer, pointer, pointer]
            fn.restype = None
        self.lib = lib

    @staticmethod
    def _args(rows, slots, vector):
        assert rows.dtype == np.float32 and rows.flags.c_contiguous and vector.dtype == np.float32
        return rows.ctypes.data, rows.shape[1], slots.ctypes.data, len(slots), vector.ctypes.data

    def mv(self, rows: np.ndarray, slots: np.ndarray, x: np.ndarray) -> np.ndarray:
        """x (d,) -> (len(slots),)."""
        slots, x = np.ascontiguousarray(slots, dtype=np.int64), np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty(len(slots), dtype=np.float32)
        self.lib.lsparse_gather_mv(*self._args(rows, slots, x), y.ctypes.data)
        return y

    def vm(self, rows: np.ndarray, slots: np.ndarray, a: np.ndarray) -> np.ndarray:
        """a (len(slots),) -> (d,); rows whose coefficient is 0 are not read."""
        a = np.asarray(a, dtype=np.float32)
        keep = a != 0
        slots, a = np.ascontiguousarray(slots[keep], dtype=np.int64), np.ascontiguousarray(a[keep])
        out = np.empty(rows.shape[1], dtype=np.float32)
        self.lib.lsparse_gather_vm(*self._args(rows, slots, a), out.ctypes.data)
        return out

    @staticmethod
    def _quantized(rows, slots, vector, d):
        assert rows.dtype == np.uint8 and rows.flags.c_contiguous and vector.dtype == np.float32
        return rows.ctypes.data, rows.shape[1], d

    def mv_q(self, rows: np.ndarray, slots: np.ndarray, x: np.ndarray, bits: int, group: int) -> np.ndarray:
        """x (d,) -> (len(slots),) over 4/8-bit rows."""
        slots, x = np.ascontiguousarray(slots, dtype=np.int64), np.ascontiguousarray(x, dtype=np.float32)
        d = len(x)
        y = np.empty(len(slots), dtype=np.float32)
        scratch = np.empty(2 * d + d // group, dtype=np.float32)
        self.lib.lsparse_gather_mv_q(*self._quantized(rows, slots, x, d), bits, group, slots.ctypes.data,
                                     len(slots), x.ctypes.data, y.ctypes.data, scratch.ctypes.data)
        return y

    def vm_q(self, rows: np.ndarray, slots: np.ndarray, a: np.ndarray, d: int, bits: int, group: int) -> np.ndarray:
        """a (len(slots),) -> (d,) over 4/8-bit rows; rows whose coefficient is 0 are not read."""
        a = np.asarray(a, dtype=np.float32)
        keep = a != 0
        slots, a = np.ascontiguousarray(slots[keep], dtype=np.int64), np.ascontiguousarray(a[keep])
        out = np.empty(d, dtype=np.float32)
        scratch = np.empty(d, dtype=np.float32)
        self.lib.lsparse_gather_vm_q(*self._quantized(rows, slots, a, d), bits, group, slots.ctypes.data,
                                     len(slots), a.ctypes.data, out.ctypes.data, scratch.ctypes.data)
        return out
