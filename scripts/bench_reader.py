"""lsparse's flash reader against fio on the same file: random reads of one size, the same number in flight,
page cache bypassed (O_DIRECT). Prints a Markdown table row per configuration.

    python scripts/bench_reader.py --file /tmp/lsparse-reader.bin --size-mb 2048 --seconds 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_file(path: Path, size: int) -> None:
    if path.exists() and path.stat().st_size == size:
        return
    with open(path, "wb") as f:
        chunk = np.random.default_rng(0).integers(0, 256, 1 << 24, dtype=np.uint8).tobytes()
        for _ in range(size // len(chunk)):
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def lsparse_reader(path: Path, block: int, in_flight: int, seconds: float) -> float:
    from lsparse.runtime.reader import FlashReader
    reader = FlashReader(path, workers=in_flight, direct=True, buffer_bytes=64 * in_flight * block)
    assert reader.direct, "O_DIRECT was refused on this file system"
    rng = np.random.default_rng(1)
    blocks = reader.size // block
    done, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        offsets = rng.integers(0, blocks, 64 * in_flight) * block  # one batch per worker per call
        transferred, _ = reader.read_all(offsets, np.full(len(offsets), block))
        done += transferred
    elapsed = time.perf_counter() - start
    reader.close()
    return done / elapsed


def fio(path: Path, block: int, in_flight: int, seconds: float) -> float | None:
    if shutil.which("fio") is None:
        return None
    out = subprocess.run(["fio", "--name=randread", f"--filename={path}", "--direct=1", "--rw=randread",
                          f"--bs={block}", "--ioengine=psync", f"--numjobs={in_flight}", "--group_reporting",
                          f"--runtime={seconds}", "--time_based", "--output-format=json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)["jobs"][0]["read"]["bw_bytes"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--file", type=Path, default=Path("/tmp/lsparse-reader.bin"))
    p.add_argument("--size-mb", type=int, default=2048)
    p.add_argument("--seconds", type=float, default=8)
    args = p.parse_args()
    make_file(args.file, args.size_mb << 20)
    if shutil.which("fio") is None:
        print("note: fio is not installed (Debian: apt-get install fio); its column stays empty", file=sys.stderr)
    print(f"Random reads, O_DIRECT, {args.size_mb} MB file, {args.seconds:.0f} s each, {time.strftime('%Y-%m-%d')}\n")
    print("| read size | in flight | lsparse reader GB/s | fio (psync, numjobs) GB/s | ratio |")
    print("|---|---|---|---|---|")
    for block, in_flight in ((32768, 16), (4096, 16), (131072, 16), (32768, 32)):
        ours = lsparse_reader(args.file, block, in_flight, args.seconds)
        theirs = fio(args.file, block, in_flight, args.seconds)
        ratio = f"{ours / theirs:.2f}" if theirs else "n/a"
        print(f"| {block // 1024} KiB | {in_flight} | {ours / 1e9:.2f} | "
              f"{f'{theirs / 1e9:.2f}' if theirs else 'no fio'} | {ratio} |", flush=True)


if __name__ == "__main__":
    main()
