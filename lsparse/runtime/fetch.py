"""Fetching neuron bundles from the image's neuron file: neighbours coalesced under the gap rule, reads in
batches that fit the reader's planned buffer, in the background while hot neurons compute, and ahead of time
through a second reader of their own (the lookahead)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from lsparse.errors import LsparseError
from lsparse.image.bundles import coalesce
from lsparse.image.manifest import NEURONS
from lsparse.kernels.native import row_sums
from lsparse.runtime.reader import ALIGN, FlashReader


class RowCheck:
    """One layer's cold rows against the checksums compile recorded (a resident tensor, itself checked when
    the run starts), each bundle the first time this run reads it: a damaged or foreign neuron file stops the
    run with one line instead of changing its output."""

    def __init__(self, sums: np.ndarray, rows_read: int, row_bytes: int, layer: int):
        self.sums = np.ascontiguousarray(sums[:, :rows_read])  # (n_cold, rows_read) uint64
        self.rows_read, self.row_bytes, self.layer = rows_read, row_bytes, layer
        self.checked = np.zeros(len(sums), dtype=bool)          # (n_cold,) read and found intact this run

    def __call__(self, positions: np.ndarray, rows: np.ndarray) -> None:
        """rows (n, at least rows_read x row bytes) uint8: the bundles at these positions of the region."""
        new = np.flatnonzero(~self.checked[positions])
        if not len(new):
            return
        got = row_sums(rows[new, : self.rows_read * self.row_bytes].reshape(len(new), self.rows_read, -1))
        bad = (got != self.sums[positions[new]]).any(axis=1)
        if bad.any():
            raise LsparseError(f"{NEURONS}: layer {self.layer}'s bundle {int(positions[new][bad][0])} does not "
                               "match its checksum: the neuron file is damaged or not this image's (lsparse verify "
                               "tells more)")
        self.checked[positions[new]] = True


@dataclass
class Fetched:
    rows: np.ndarray   # (n, prefix) uint8: the first `prefix` bytes of each bundle asked for, in order
    requests: int      # reads issued
    transferred: int   # bytes read from the device (whole aligned blocks, gaps read through included)
    seconds: float     # the reads' own time


class Fetcher:
    """Reads of bundles `stride` bytes apart. `bundled` False reads each row of a neuron apart (an ablation:
    gate rows, up rows and down columns stored in three places)."""

    def __init__(self, path, stride: int, row_bytes: int, gap_bytes: int, bundled: bool, readers: int,
                 direct: bool, buffer_bytes: int, lookahead: bool):
        self.stride, self.row_bytes, self.gap_bytes, self.bundled = stride, row_bytes, gap_bytes, bundled
        self.reader = FlashReader(path, workers=readers, direct=direct, buffer_bytes=buffer_bytes)
        self.ahead = FlashReader(path, workers=readers, direct=direct, buffer_bytes=buffer_bytes) \
            if lookahead else None
        self.max_run = buffer_bytes - ALIGN  # a run of this many bytes, read as whole blocks, fits the buffer
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._views: dict[tuple[int, int], np.ndarray] = {}

    def _requests(self, region: int, positions: np.ndarray, prefix: int):
        """(offsets, lengths, where each position's bytes start relative to its request's offset, the request
        of each position's first row, which requests may start a batch)."""
        if self.bundled:
            offsets, lengths, run = coalesce(positions, self.stride, region, self.gap_bytes, self.max_run)
            cuts = np.ones(len(offsets), bool)
            return offsets, lengths, region + positions * self.stride - offsets[run], run, cuts
        k = prefix // self.row_bytes
        offsets = (region + positions[:, None] * self.stride + np.arange(k) * self.row_bytes).ravel()
        cuts = np.arange(len(offsets)) % k == 0  # a neuron's rows arrive in one batch
        return offsets, np.full(len(offsets), self.row_bytes), np.zeros(len(positions), np.int64), \
            np.arange(len(positions)) * k, cuts

    def read(self, region: int, positions: np.ndarray, prefix: int, reader: FlashReader | None = None) -> Fetched:
        """The first `prefix` bytes of the bundles at these ascending positions of the region at `region`."""
        reader = reader or self.reader
        offsets, lengths, within, first, cuts = self._requests(region, positions, prefix)
        rows = np.empty((len(positions), prefix), dtype=np.uint8)
        transferred, seconds = 0, 0.0
        batches = reader.batches(reader.aligned(offsets, lengths)[1], cuts)
        try:
            for a, b in batches:
                buffer, at, n, s = reader.read_into(offsets[a:b], lengths[a:b])
                # the positions this batch brought
                mine = slice(None) if len(batches) == 1 else np.flatnonzero((first >= a) & (first < b))
                if self.bundled:
                    rows[mine] = self._windows(reader, prefix)[at[first[mine] - a] + within[mine]]
                else:
                    rows[mine] = self._windows(reader, self.row_bytes)[
                        at[(first[mine] - a)[:, None] + np.arange(prefix // self.row_bytes)]].reshape(-1, prefix)
                transferred, seconds = transferred + n, seconds + s
        except OSError as e:
            raise LsparseError(f"reading neuron bundles failed ({e}); run lsparse verify on the image") from None
        return Fetched(rows, len(offsets), transferred, seconds)

    def _windows(self, reader: FlashReader, width: int) -> np.ndarray:
        """The reader's buffer as overlapping windows of `width` bytes, one starting at each byte (a view made
        once: the buffer never moves)."""
        key = (id(reader), width)
        if key not in self._views:
            buffer = np.frombuffer(reader.buffer, dtype=np.uint8)
            self._views[key] = np.lib.stride_tricks.sliding_window_view(buffer, width)
        return self._views[key]

    def read_spans(self, offsets: np.ndarray, lengths: np.ndarray) -> Fetched:
        """The bytes of these spans, one after another (rows: one flat array)."""
        out = np.empty(int(lengths.sum()), dtype=np.uint8)
        places = np.cumsum(lengths) - lengths
        transferred, seconds = 0, 0.0
        try:
            for a, b in self.reader.batches(self.reader.aligned(offsets, lengths)[1]):
                buffer, at, n, s = self.reader.read_into(offsets[a:b], lengths[a:b])
                for p, q, length in zip(places[a:b].tolist(), at.tolist(), lengths[a:b].tolist(), strict=True):
                    out[p:p + length] = buffer[q:q + length]
                transferred, seconds = transferred + n, seconds + s
        except OSError as e:
            raise LsparseError(f"reading neuron bundles failed ({e}); run lsparse verify on the image") from None
        return Fetched(out, len(offsets), transferred, seconds)

    def start(self, region: int, positions: np.ndarray, prefix: int) -> Future:
        """read(), on a thread of its own, while the caller computes (same reader: one read at a time)."""
        return self._pool("background").submit(self.read, region, positions, prefix)

    def start_ahead(self, region: int, positions: np.ndarray, prefix: int, then) -> Future:
        """read() through the lookahead's own reader and buffer, then `then(Fetched)` on the same thread."""
        return self._pool("ahead").submit(lambda: then(self.read(region, positions, prefix, self.ahead)))

    def _pool(self, name: str) -> ThreadPoolExecutor:
        if name not in self._pools:
            self._pools[name] = ThreadPoolExecutor(1)
        return self._pools[name]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.shutdown()
        for reader in (self.reader, self.ahead):
            if reader is not None:
                reader.close()
