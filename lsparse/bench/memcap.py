"""Run a command under a hard memory cap (cgroup v1 memory controller, as root) and report its peak.

    python -m lsparse.bench.memcap 300M -- lsparse run out/image -p "Once upon a time"

The page cache the command fills counts against the cap, as the kernel charges it. Prints one JSON line
on stderr: the cap, the peak usage (memory.max_usage_in_bytes), whether the cap was hit (failcnt), the exit
status. Exits with the command's status.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from pathlib import Path

from lsparse.errors import LsparseError
from lsparse.sizes import parse_size

ROOT = Path("/sys/fs/cgroup/memory")


def available() -> bool:
    """Whether a hard memory cap can be set here: root, and the cgroup v1 memory controller."""
    return os.geteuid() == 0 and ROOT.is_dir()


def own_memory_cgroup() -> Path:
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            return ROOT / path.lstrip("/")
    raise SystemExit("memcap: no cgroup v1 memory controller here")


def main() -> None:
    if len(sys.argv) < 4 or sys.argv[2] != "--":
        raise SystemExit(__doc__)
    try:
        cap = parse_size(sys.argv[1])
    except LsparseError as e:
        raise SystemExit(f"memcap: {e}") from None
    command = sys.argv[3:]
    group = own_memory_cgroup() / f"lsparse-memcap-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as e:
        raise SystemExit(f"memcap: cannot make a memory cgroup ({e}); it needs root and cgroup v1") from None
    try:
        (group / "memory.limit_in_bytes").write_text(str(cap))
        pid = os.fork()
        if pid == 0:
            (group / "cgroup.procs").write_text(str(os.getpid()))
            os.execvp(command[0], command)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        report = {"cap_bytes": cap, "peak_bytes": int((group / "memory.max_usage_in_bytes").read_text()),
                  "cap_hit": int((group / "memory.failcnt").read_text()) > 0, "exit_status": code,
                  "oom_killed": code == -9}
        print(json.dumps(report), file=sys.stderr)
    finally:
        try:
            group.rmdir()
        except OSError:
            pass
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
