"""Reading neuron bundles from flash: direct I/O where the OS allows it, page-aligned buffers, a pool of
threads each taking a batch of reads, and neighbouring bundles coalesced into one request."""

from __future__ import annotations

import mmap
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

ALIGN = 4096
F_NOCACHE = 48  # macOS fcntl: bypass the unified buffer cache
DEFAULT_GAP_BYTES = 16384  # ~12 us per request at 16 in flight x ~1.3 GB/s, this machine's measured SSD


def coalesce(positions: np.ndarray, stride: int, base: int, gap_bytes: int) -> list[tuple[int, int, np.ndarray]]:
    """Runs of bundle positions read as one request when the gap between them costs less than a new request.
    Returns (offset, length, positions in the run)."""
    if len(positions) == 0:
        return []
    p = np.sort(positions)
    max_gap = gap_bytes // stride
    breaks = np.flatnonzero(np.diff(p) > max_gap + 1) + 1
    runs = []
    for run in np.split(p, breaks):
        runs.append((base + int(run[0]) * stride, (int(run[-1]) - int(run[0]) + 1) * stride, run))
    return runs


class FlashReader:
    def __init__(self, path, workers: int = 4, direct: bool = True):
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
        self.buffers = [mmap.mmap(-1, 1 << 20) for _ in range(workers)]

    def close(self) -> None:
        if self.pool:
            self.pool.shutdown()
        os.close(self.fd)

    def _read_batch(self, worker: int, work: list[tuple[int, int, int, int]]) -> None:
        """Each (block start, block bytes, place in this worker's buffer, bytes that must arrive) in turn."""
        view, fd, preadv = memoryview(self.buffers[worker]), self.fd, os.preadv
        for start, size, at, needed in work:
            if preadv(fd, [view[at:at + size]], start) < needed:
                raise OSError(f"short read at byte {start}: the neuron file is truncated")

    def read(self, spans: list[tuple[int, int]]) -> tuple[list[np.ndarray], int, float]:
        """The bytes of each (offset, length) span, as views valid until the next call; also the bytes
        transferred (whole aligned blocks) and the seconds taken."""
        start_time = time.perf_counter()
        offsets = np.array([o for o, _ in spans], dtype=np.int64)
        lengths = np.array([n for _, n in spans], dtype=np.int64)
        starts = offsets // ALIGN * ALIGN
        ends = np.minimum(-(-(offsets + lengths) // ALIGN) * ALIGN, -(-self.size // ALIGN) * ALIGN)
        sizes = ends - starts
        n_workers = max(1, min(self.workers, len(spans)))
        worker = np.arange(len(spans)) % n_workers
        at = np.zeros(len(spans), dtype=np.int64)
        work = []
        for w in range(n_workers):
            mine = np.flatnonzero(worker == w)
            at[mine] = np.concatenate([[0], np.cumsum(sizes[mine])[:-1]])
            need = int(sizes[mine].sum())
            if need > len(self.buffers[w]):
                self.buffers[w] = mmap.mmap(-1, -(-need // ALIGN) * ALIGN)
            work.append(list(zip(starts[mine].tolist(), sizes[mine].tolist(), at[mine].tolist(),
                                 (offsets[mine] - starts[mine] + lengths[mine]).tolist(), strict=True)))
        if n_workers == 1:
            self._read_batch(0, work[0])
        else:
            list(self.pool.map(self._read_batch, range(n_workers), work))
        views = [np.frombuffer(self.buffers[w], dtype=np.uint8, count=int(n), offset=int(a + o - s))
                 for w, a, o, s, n in zip(worker, at, offsets, starts, lengths, strict=True)]
        return views, int(sizes.sum()), time.perf_counter() - start_time
