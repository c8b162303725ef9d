"""The read-through gap: measured on the device, kept per device, the default only where it cannot be measured."""

from __future__ import annotations

import json
import os

from lsparse.runtime import device
from lsparse.runtime.reader import DEFAULT_GAP_BYTES


def test_gap_is_measured_once_per_device_and_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    small = tmp_path / "small.bin"
    small.write_bytes(os.urandom(1 << 20))
    assert device.gap_for(small) == (DEFAULT_GAP_BYTES, "default")  # too small to measure honestly

    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        f.truncate(device.MIN_FILE_BYTES)
    gap, rule = device.gap_for(big, workers=4)
    if rule == "default":  # this file system refuses O_DIRECT: nothing to measure
        return
    stored = json.loads(device.cache_path().read_text())
    entry = stored[f"{os.stat(big).st_dev}:4"]
    assert rule == "measured" and gap == entry["gap_bytes"] > 0
    assert entry["gap_bytes"] == int(entry["bandwidth_bytes_per_second"] / entry["requests_per_second"])
    # the next file on the same device reuses the measurement, even a small one
    assert device.gap_for(small, workers=4) == (gap, "measured")
