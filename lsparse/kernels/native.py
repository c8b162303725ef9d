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
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

NATIVE = Path(__file__).parent / "native"
SOURCES = (NATIVE / "gather.c", NATIVE / "q.c", NATIVE / "read.c", NATIVE / "sums.c")
# -ffast-math lets the compiler reorder the float sums, which vectorizing them needs; OpenMP splits the large
# products over the cores (built without it where the compiler has none: one core)
FLAGS = ("-O3", "-ffast-math", "-shared", "-fPIC")
# Tuned for this CPU: -march=native where the compiler takes it; Apple's older clang refuses it on arm64 and
# takes -mcpu=native; else the compiler's default target
ARCH_FLAGS = (("-march=native",), ("-mcpu=native",), ())
OPENMP = ("-fopenmp",)
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


def target(cc: str) -> tuple[tuple[str, ...], bytes]:
    """(the first ARCH_FLAGS the compiler takes, what they mean on this CPU: its predefined macros under them,
    __AVX2__ and so on). A library built for one CPU must not load on another that lacks its instructions
    (SIGILL), even when the two share a home directory."""
    for arch in ARCH_FLAGS:
        done = subprocess.run([cc, "-O3", *arch, "-E", "-dM", "-x", "c", os.devnull], capture_output=True)
        if done.returncode == 0:
            return arch, done.stdout
    return (), platform.machine().encode()


def private(path: Path) -> bool:
    """Whether only this user can have written `path`: owned by us, not writable by group or others. A
    library planted where lsparse looks would otherwise run inside it."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def row_sums(rows: np.ndarray) -> np.ndarray:
    """rows (n, k, row bytes) uint8 -> (n, k) uint64 checksums (lsparse/image/bundles.py row_sums, in C)."""
    from lsparse.image.bundles import row_sums as numpy_row_sums
    lib = library()
    if lib is None:
        return numpy_row_sums(rows)
    rows = np.ascontiguousarray(rows)
    out = np.empty(rows.shape[:-1], dtype=np.uint64)
    fn = lib.lsparse_row_sums
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    fn.restype = None
    fn(rows.ctypes.data, out.size, rows.shape[-1], out.ctypes.data)
    return out


def _build():
    cc = compiler()
    if cc is None or os.environ.get("LSPARSE_NO_NATIVE"):
        return None
    sources = b"".join(f.read_bytes() for f in (*SOURCES, NATIVE / "half.h"))
    arch, macros = target(cc)
    flags = (*FLAGS, *arch)
    key = hashlib.sha256(sources + " ".join((cc, *flags, *OPENMP)).encode() + macros).hexdigest()
    try:
        CACHE.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder = CACHE if private(CACHE) else Path(tempfile.mkdtemp(prefix="lsparse-native-"))
        path = folder / f"native-{key[:16]}.so"
        if not path.exists():
            with tempfile.TemporaryDirectory(dir=folder) as tmp:  # built aside, renamed: processes may race here
                out = Path(tmp) / path.name
                for extra in (OPENMP, ()):
                    done = subprocess.run([cc, *flags, *extra, *map(str, SOURCES), "-o", str(out)],
                                          capture_output=True, text=True)
                    if done.returncode == 0:
                        break
                else:  # said once, not silently: numpy computing instead is several times slower
                    first = next((line for line in done.stderr.splitlines() if "error" in line), done.stderr.strip())
                    print(f"lsparse: the C kernels did not build ({cc}: {first[:200]}); numpy computes instead",
                          file=sys.stderr)
                    return None
                os.chmod(out, 0o700)
                os.replace(out, path)
        return ctypes.CDLL(str(path)) if private(path) else None
    except OSError:  # an unwritable cache or a library that will not load: numpy does the work
        return None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# A product of this many weights or more is split over threads by its rows (slots). The C kernels run on one
# core and the calls drop the GIL, so two threads take a 7B layer's gate product at 20% active from 1.7 to
# 1.4 ms and a whole store's from 8.1 to 4.4 ms on these 2 cores (2026-11-30); below about a million
# weights handing the work to a thread costs more than it saves.
SPLIT_MIN_WEIGHTS = 1 << 20
THREADS = int(os.environ.get("LSPARSE_THREADS", 0)) or min(_cores(), 8)
_pool: dict = {}


def _split(n: int, d: int, run) -> list:
    """run(start, stop) over parts of range(n), on THREADS threads when the product is large enough."""
    parts = max(1, min(THREADS, n * d // SPLIT_MIN_WEIGHTS))
    if parts == 1:
        return [run(0, n)]
    if "pool" not in _pool:
        _pool["pool"] = ThreadPoolExecutor(THREADS)
    bounds = np.linspace(0, n, parts + 1).astype(int)
    return list(_pool["pool"].map(run, bounds[:-1], bounds[1:]))


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
        lib.lsparse_quantize_x.argtypes = [pointer, size, small, small, pointer, pointer, pointer]
        lib.lsparse_mv_q8x.argtypes = [pointer, size, size, small, small, pointer, size, pointer, pointer, pointer,
                                       pointer, small]
        lib.lsparse_vm_q.argtypes = [pointer, size, size, small, small, pointer, size, pointer, pointer, pointer, small]
        for fn in (lib.lsparse_quantize_x, lib.lsparse_mv_q8x, lib.lsparse_vm_q):
            fn.restype = None
        self.lib = lib

    def mv(self, rows: np.ndarray, slots: np.ndarray, x: np.ndarray) -> np.ndarray:
        """x (d,) -> (len(slots),)."""
        assert rows.dtype == np.float32 and rows.flags.c_contiguous
        slots, x = np.ascontiguousarray(slots, dtype=np.int64), np.ascontiguousarray(x, dtype=np.float32)
        y = np.empty(len(slots), dtype=np.float32)

        def run(a, b):
            self.lib.lsparse_gather_mv(rows.ctypes.data, rows.shape[1], slots[a:].ctypes.data, b - a,
                                       x.ctypes.data, y[a:].ctypes.data)

        _split(len(slots), rows.shape[1], run)
        return y

    def vm(self, rows: np.ndarray, slots: np.ndarray, a: np.ndarray) -> np.ndarray:
        """a (len(slots),) -> (d,); rows whose coefficient is 0 are not read."""
        assert rows.dtype == np.float32 and rows.flags.c_contiguous
        slots, a = _nonzero(slots, a)

        def run(start, stop):
            out = np.empty(rows.shape[1], dtype=np.float32)
            self.lib.lsparse_gather_vm(rows.ctypes.data, rows.shape[1], slots[start:].ctypes.data, stop - start,
                                       a[start:].ctypes.data, out.ctypes.data)
            return out

        return sum(_split(len(slots), rows.shape[1], run))

    def mv_q(self, rows: np.ndarray, slots: np.ndarray, x: np.ndarray, bits: int, group: int) -> np.ndarray:
        """x (d,) -> (len(slots),) over 4/8-bit rows. Where d is a multiple of 64, x is quantized to 8 bits per
        group first (int8_x: as llama.cpp's Q8 activations; about 1% of the largest output) and each group's
        sum is exact in integers (lsparse/kernels/native/q.c)."""
        assert rows.dtype == np.uint8 and rows.flags.c_contiguous
        x = np.ascontiguousarray(x, dtype=np.float32)
        d = len(x)
        if slots is None and int8_x(d):  # every row, in order: no list of slots to make or follow
            return self._mv_q8x(rows, None, len(rows), x, bits, group)
        slots = np.ascontiguousarray(np.arange(len(rows)) if slots is None else slots, dtype=np.int64)
        y = np.empty(len(slots), dtype=np.float32)
        if int8_x(d):
            return self._mv_q8x(rows, slots, len(slots), x, bits, group)

        def run(a, b):
            scratch = np.empty(2 * d + d // group, dtype=np.float32)
            self.lib.lsparse_gather_mv_q(rows.ctypes.data, rows.shape[1], d, bits, group, slots[a:].ctypes.data,
                                         b - a, x.ctypes.data, y[a:].ctypes.data, scratch.ctypes.data)

        _split(len(slots), d, run)
        return y

    def _mv_q8x(self, rows: np.ndarray, slots: np.ndarray | None, n: int, x: np.ndarray, bits: int,
                group: int) -> np.ndarray:
        """q.c's product: x to 8 bits per group, then the rows at slots (None: rows 0..n-1)."""
        d, groups = len(x), len(x) // group
        xq, scale, xsum = np.empty(d, np.int8), np.empty(groups, np.float32), np.empty(groups, np.float32)
        self.lib.lsparse_quantize_x(x.ctypes.data, d, group, bits, xq.ctypes.data, scale.ctypes.data,
                                    xsum.ctypes.data)
        y = np.empty(n, dtype=np.float32)
        self.lib.lsparse_mv_q8x(rows.ctypes.data, rows.shape[1], d, bits, group,
                                None if slots is None else slots.ctypes.data, n, xq.ctypes.data, scale.ctypes.data,
                                xsum.ctypes.data, y.ctypes.data, THREADS)
        return y

    def vm_q(self, rows: np.ndarray, slots: np.ndarray, a: np.ndarray, d: int, bits: int, group: int) -> np.ndarray:
        """a (len(slots),) -> (d,) over 4/8-bit rows (slots None: every row); rows whose coefficient is 0 are not
        read."""
        assert rows.dtype == np.uint8 and rows.flags.c_contiguous
        slots, a = _nonzero(np.arange(len(rows)) if slots is None else slots, a)
        if int8_x(d):  # d a multiple of 64: q.c's tiled product (x plays no part here)
            out, scratch = np.empty(d, np.float32), np.empty(len(slots) * (d // group) + THREADS * d, np.float32)
            self.lib.lsparse_vm_q(rows.ctypes.data, rows.shape[1], d, bits, group, slots.ctypes.data, len(slots),
                                  a.ctypes.data, out.ctypes.data, scratch.ctypes.data, THREADS)
            return out

        def run(start, stop):
            out, scratch = np.empty(d, dtype=np.float32), np.empty(d, dtype=np.float32)
            self.lib.lsparse_gather_vm_q(rows.ctypes.data, rows.shape[1], d, bits, group,
                                         slots[start:].ctypes.data, stop - start, a[start:].ctypes.data,
                                         out.ctypes.data, scratch.ctypes.data)
            return out

        return sum(_split(len(slots), d, run))


def limit_blas_threads(n: int) -> bool:
    """Run numpy's OpenBLAS on n threads from now on (as threadpoolctl would): the C kernels' OpenMP threads
    and OpenBLAS's busy-waiting threads on the same two cores halved the 7B decode's compute (137 against
    68 ms a token). Returns whether an OpenBLAS was found."""
    import re
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    found = False
    for path in sorted(set(re.findall(r"\S*openblas\S*\.(?:so|dylib)\S*", maps))):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("openblas_set_num_threads", "scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn(ctypes.c_int(n))
                found = True
                break
    return found


def int8_x(d: int) -> bool:
    """Whether products over 4/8-bit rows of d weights take x quantized to 8 bits (q.c needs chunks of 64)."""
    return d % 64 == 0


def _nonzero(slots: np.ndarray, a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The slots and coefficients of a vector-matrix product, less the zero coefficients (rows not read)."""
    a = np.asarray(a, dtype=np.float32)
    keep = a != 0
    return np.ascontiguousarray(slots[keep], dtype=np.int64), np.ascontiguousarray(a[keep])
