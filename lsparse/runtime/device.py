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

MIN_FILE_BYTES = 64 << 20  # smaller files sit in the device's own cache and would flatter it
SMALL, LARGE = 4096, 1 << 20


def cache_path() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "lsparse" / "devices.json"


def large_reads(reader: FlashReader) -> int:
    """The size of the bandwidth probe's reads: 1 MiB, or less where the buffer cannot hold one per thread."""
    return max(16 * ALIGN, min(LARGE, len(reader.buffer) // reader.workers // ALIGN * ALIGN))


def measure(reader: FlashReader, seconds: float = 0.5) -> dict:
    """Requests per second of 4 KiB direct reads and bandwidth of large ones, with the reader's threads in
    flight, on random offsets of its file, and the gap rule they give."""
    if not reader.direct:
        raise OSError("direct I/O is refused on this file system")
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
            "date": time.strftime("%Y-%m-%d")}


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
