"""The read-through gap: measured on the device through the decoder's own reader and buffer, kept per device,
the default only where it cannot be measured."""

from __future__ import annotations

import json
import os

import pytest

from lsparse.runtime import device
from lsparse.runtime.reader import DEFAULT_GAP_BYTES, FlashReader


def test_gap_is_measured_once_per_device_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    small = tmp_path / "small.bin"
    small.write_bytes(os.urandom(1 << 20))
    assert device.gap_for(FlashReader(small, workers=4)) == (DEFAULT_GAP_BYTES, "default")  # too small to be honest

    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(device.MIN_FILE_BYTES)
    reader = FlashReader(big, workers=4, buffer_bytes=4 << 20)
    gap, rule = device.gap_for(reader)
    if rule == "default":
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT: nothing to measure")
    assert len(reader.buffer) == 4 << 20  # the measurement stayed inside the reader's planned buffer
    stored = json.loads(device.cache_path().read_text())
    entry = stored[f"{os.stat(big).st_dev}:4:{1 << 20}"]
    assert rule == "measured" and gap == entry["gap_bytes"] > 0
    assert entry["gap_bytes"] == int(entry["bandwidth_bytes_per_second"] / entry["requests_per_second"])
    # the next file on the same device reuses the measurement, even a small one
    assert device.gap_for(FlashReader(small, workers=4, buffer_bytes=4 << 20)) == (gap, "measured")


def test_a_small_buffer_measures_with_smaller_reads(tmp_path):
    (tmp_path / "f").write_bytes(b"")
    reader = FlashReader(tmp_path / "f", workers=16, buffer_bytes=1 << 20)
    assert device.large_reads(reader) == 64 * 1024 and 16 * device.large_reads(reader) <= len(reader.buffer)
