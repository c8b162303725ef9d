"""The read-through gap, from the storage device's own latency and bandwidth (LLM in a Flash's rule: read
through a gap when reading it costs less than issuing one more request).

A request costs about 1 / (requests per second) at the reader's concurrency; a byte costs 1 / bandwidth. So
two runs of bundles are read as one when the gap between them is under (1 / IOPS) x bandwidth. Both are
measured with direct reads on a file of the device, once, and kept per device, reader width and read size in
the user's cache folder. The measurement reads through the decoder's own reader, into its planned buffer.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from lsparse.runtime.reader import ALIGN, DEFAULT_GAP_BYTES, FlashReader

MS_INVALIDATE = 2  # <sys/mman.h>, on macOS and Linux alike
MIN_FILE_BYTES = 64 << 20  # smaller files sit in the device's own cache and would flatter it
SMALL, LARGE = 4096, 1 << 20


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lsparse" / "devices.json"


def large_reads(reader: FlashReader) -> int:
    """The size of the bandwidth probe's reads: 1 MiB, or less where the buffer cannot hold one per thread."""
    return max(16 * ALIGN, min(LARGE, len(reader.buffer) // reader.workers // ALIGN * ALIGN))


def drop_cached_pages(fd: int, size: int) -> str:
    """Evict a file's pages from the OS's cache, so that the next reads come from the device; returns how.
    Linux: posix_fadvise(DONTNEED). macOS has no fadvise, and F_NOCACHE only stops new pages from being
    cached, so a file just written (an image right after compile) would be read from RAM: msync with
    MS_INVALIDATE over a shared mapping of the whole file drops its cached pages."""
    os.fsync(fd)  # dirty pages cannot be dropped
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return "posix_fadvise(DONTNEED)"
    return _msync_invalidate(fd, size)


def _msync_invalidate(fd: int, size: int) -> str:
    import ctypes
    import ctypes.util
    import mmap
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_int64]
    libc.msync.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if address in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap failed: cannot drop the file's cached pages")
    try:
        if libc.msync(address, size, MS_INVALIDATE) != 0:
            raise OSError(ctypes.get_errno(), "msync(MS_INVALIDATE) failed")
    finally:
        libc.munmap(address, size)
    return "msync(MS_INVALIDATE)"


def measure(reader: FlashReader, seconds: float = 0.5) -> dict:
    """Requests per second of 4 KiB direct reads and bandwidth of large ones, with the reader's threads in
    flight, on random offsets of its file, and the gap rule they give. The file's cached pages are dropped
    first (and how is recorded): direct reads of pages still cached would measure RAM."""
    if not reader.direct:
        raise OSError("direct I/O is refused on this file system")
    dropped = drop_cached_pages(reader.fd, reader.size)
    rng = np.random.default_rng(0)

    def rate(size):
        per_call = max(1, min(32 * reader.workers, len(reader.buffer) // size))
        count, done, start = 0, 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            offsets = rng.integers(0, (reader.size - size) // ALIGN, per_call) * ALIGN
            transferred, _ = reader.read_all(offsets, np.full(per_call, size))
            count, done = count + per_call, done + transferred
        elapsed = time.perf_counter() - start
        return count / elapsed, done / elapsed

    iops, _ = rate(SMALL)
    _, bandwidth = rate(large_reads(reader))
    return {"requests_per_second": iops, "bandwidth_bytes_per_second": bandwidth,
            "gap_bytes": int(bandwidth / iops), "workers": reader.workers, "read_bytes": large_reads(reader),
            "cache_dropped": dropped, "date": time.strftime("%Y-%m-%d")}


def gap_for(reader: FlashReader) -> tuple[int, str]:
    """(gap bytes, how it was found) for reads through `reader`: this device's cached measurement, a new one
    when the file is large enough to measure on, else the default."""
    st = os.fstat(reader.fd)
    device = f"{st.st_dev}:{reader.workers}:{large_reads(reader)}"  # the rate depends on what is in flight
    store = cache_path()
    try:
        known = json.loads(store.read_text())
    except (OSError, ValueError):
        known = {}
    if device in known:
        return int(known[device]["gap_bytes"]), "measured"
    if st.st_size < MIN_FILE_BYTES or not reader.direct:
        return DEFAULT_GAP_BYTES, "default"
    try:
        known[device] = measure(reader)
    except OSError:
        return DEFAULT_GAP_BYTES, "default"
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        tmp = store.with_suffix(f".tmp-{os.getpid()}")
        tmp.write_text(json.dumps(known, indent=1))
        os.replace(tmp, store)
    except OSError:
        pass  # a read-only home: measure again next time
    return int(known[device]["gap_bytes"]), "measured"
