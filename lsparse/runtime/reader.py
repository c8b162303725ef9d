"""Reading spans of a file from flash: direct I/O where the OS allows it, whole aligned blocks into one buffer of
a fixed size (the memory plan's), a pool of threads taking reads in turn (in one C call each where
lsparse/kernels/native.py can build it)."""

from __future__ import annotations

import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from lsparse.kernels.native import read_shared

ALIGN = 4096
F_NOCACHE = 48  # macOS fcntl: bypass the unified buffer cache
# 16 in flight: at 7B geometry (reads of 20-40 KB) 2.5 tok/s against 2.1 with 4 (docs/BENCHMARKS.md); a call
# never starts more threads than it has reads
DEFAULT_READERS = 16
DEFAULT_GAP_BYTES = 16384  # ~12 us per request at 16 in flight x ~1.3 GB/s, this machine's measured SSD


class FlashReader:
    def __init__(self, path, workers: int = DEFAULT_READERS, direct: bool = True, native: bool = True,
                 buffer_bytes: int = 1 << 20):
        self.direct = False
        if direct and hasattr(os, "O_DIRECT"):
            try:
                self.fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
                self.direct = True
            except OSError:
                pass
        if not self.direct:
            self.fd = os.open(path, os.O_RDONLY)
            if sys.platform == "darwin" and direct:
                import fcntl
                fcntl.fcntl(self.fd, F_NOCACHE, 1)
                self.direct = True
            elif hasattr(os, "posix_fadvise"):
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
        self.size = os.fstat(self.fd).st_size
        self.workers = workers
        self.pool = ThreadPoolExecutor(workers) if workers > 1 else None
        self.buffer = mmap.mmap(-1, -(-buffer_bytes // ALIGN) * ALIGN)  # one call's reads, each at its own place
        self.native = read_shared() if native else None

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown()
        os.close(self.fd)

    def _read_share(self, work: np.ndarray) -> None:
        """Each row of work, (block start, block bytes, place in the buffer, bytes that must arrive), in turn."""
        view, fd, preadv = memoryview(self.buffer), self.fd, os.preadv
        for start, size, at, needed in work.tolist():
            if preadv(fd, [view[at:at + size]], start) < needed:
                raise OSError(f"short read at byte {start}: the neuron file is truncated")

    def _read_native(self, buffer: np.ndarray, work: np.ndarray, n_workers: int) -> None:
        shared = np.array([0, -1], dtype=np.int64)  # the next read to take; the first failure
        args = (self.fd, buffer.ctypes.data, *(c.ctypes.data for c in work), work.shape[1], shared.ctypes.data,
                shared[1:].ctypes.data)
        if n_workers == 1:
            self.native(*args)
        else:
            list(self.pool.map(lambda _: self.native(*args), range(n_workers)))
        failed = int(shared[1])
        if failed <= -2:
            raise OSError(-2 - failed, os.strerror(-2 - failed))
        if failed >= 0:
            raise OSError(f"short read at byte {work[0, failed]}: the neuron file is truncated")

    def aligned(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(block starts, block bytes): the whole aligned blocks each span is read as."""
        starts = offsets // ALIGN * ALIGN
        ends = np.minimum(-(-(offsets + lengths) // ALIGN) * ALIGN, -(-self.size // ALIGN) * ALIGN)
        return starts, ends - starts

    def batches(self, sizes: np.ndarray, cuts: np.ndarray | None = None) -> list[tuple[int, int]]:
        """[start, stop) ranges of spans whose aligned `sizes` fit the buffer together, cut only where `cuts`
        is True (None: anywhere). A span larger than the buffer is a caller's error."""
        if int(sizes.sum()) <= len(self.buffer):  # the usual case: one batch
            return [(0, len(sizes))] if len(sizes) else []
        if int(sizes.max()) > len(self.buffer):
            raise ValueError(f"a span of {int(sizes.max())} bytes does not fit a buffer of {len(self.buffer)}")
        allowed = np.flatnonzero(cuts if cuts is not None else np.ones(len(sizes), bool))
        ends = np.cumsum(sizes)
        out, start = [], 0
        while start < len(sizes):
            base = ends[start - 1] if start else 0
            # the furthest allowed cut whose spans since `start` fit
            fit = int(np.searchsorted(ends, base + len(self.buffer), side="right"))
            stop = allowed[np.searchsorted(allowed, fit, side="right") - 1] if fit < len(sizes) else len(sizes)
            if stop <= start:
                raise ValueError("the spans between two allowed cuts do not fit the buffer")
            out.append((start, int(stop)))
            start = int(stop)
        return out

    def read_all(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[int, float]:
        """Read these spans in batches that fit the buffer, for their time alone: (bytes transferred, seconds)."""
        offsets, lengths = np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        _, sizes = self.aligned(offsets, lengths)
        transferred, seconds = 0, 0.0
        for a, b in self.batches(sizes):
            _, _, n, s = self.read_into(offsets[a:b], lengths[a:b])
            transferred, seconds = transferred + n, seconds + s
        return transferred, seconds

    def read_into(self, offsets: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, float]:
        """The spans at these file offsets, of these lengths, read into the buffer (valid until the next call):
        the buffer, where each span starts in it, the bytes transferred (whole aligned blocks) and the
        seconds taken. They must fit the buffer (batches() cuts a list that does not)."""
        start_time = time.perf_counter()
        offsets, lengths = np.asarray(offsets, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
        starts, sizes = self.aligned(offsets, lengths)
        at = np.cumsum(sizes) - sizes
        if int(sizes.sum()) > len(self.buffer):
            raise ValueError(f"{int(sizes.sum())} bytes of reads do not fit a buffer of {len(self.buffer)}")
        buffer = np.frombuffer(self.buffer, dtype=np.uint8)
        work = np.stack([starts, sizes, at, offsets - starts + lengths])  # C-contiguous rows, one per field
        n_workers = max(1, min(self.workers, len(offsets)))
        if self.native is not None:
            self._read_native(buffer, work, n_workers)
        elif n_workers == 1:
            self._read_share(work.T)
        else:
            list(self.pool.map(self._read_share, [work.T[w::n_workers] for w in range(n_workers)]))
        return buffer, at + offsets - starts, int(sizes.sum()), time.perf_counter() - start_time
