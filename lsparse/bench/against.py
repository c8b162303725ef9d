"""`lsparse bench synthetic:NAME --against llama.cpp`: lsparse and llama.cpp side by side on one geometry, each
run in its own process under the same hard memory cap (cgroup v1), the page cache of both models dropped
before every run, interleaved, for several rounds.

llama.cpp runs through llama-cpp-python as its users run it under a cap: weights left in the mmap
(`use_mmap=True`, `use_extra_bufts=False`: its default repacks Q4_0 weights into anonymous memory, which a cap
kills for that copy, not for paging); uncapped it also runs with its defaults, its best speed. Its bytes read
come from the kernel's count for its process (/proc/self/io read_bytes), and so do lsparse's (its reader's
direct reads and, under a budget that maps matrices from the image, their page faults).
A row whose cgroup peak stays well below its cap was not bound by it and says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from lsparse.bench.peer import LLAMA_CHILD, PROMPT, llama_cpp_params_supported, write_gguf
from lsparse.errors import LsparseError
from lsparse.runtime.device import drop_cached_pages

BOUND = 0.9  # a run is bound by its cap when its cgroup peak reached this share of it


@dataclass
class Against:
    image: Path
    gguf: Path
    budgets: tuple = (1.0, 0.5, 0.35)  # shares of the model as stored (the GGUF's size) for the caps
    tokens: int = 16
    rounds: int = 2
    llama_python: str = sys.executable
    kernels: str = "cpu"


def drop_cache(paths) -> None:
    """Drop the files' pages from the page cache: pages cached by another process escape a cgroup's cap."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            drop_cached_pages(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)


def capped(cap: int | None, command: list[str], timeout: float = 3600) -> tuple[dict | None, dict | None, str]:
    """(the command's last JSON line or None, the cgroup report or None, the error if it failed)."""
    full = [sys.executable, "-m", "lsparse.bench.memcap", str(cap), "--", *command] if cap else command
    done = subprocess.run(full, capture_output=True, text=True, timeout=timeout)
    lines = done.stderr.strip().splitlines()
    report = json.loads(lines[-1]) if cap and lines and lines[-1].startswith("{") else None
    if done.returncode == 0:
        return json.loads(done.stdout.strip().splitlines()[-1]), report, ""
    why = "killed at its memory cap" if report and report.get("oom_killed") else \
        next((line for line in reversed(lines) if not line.startswith("{")), "failed")
    return None, report, why


def _files(image: Path) -> list[Path]:
    return [p for p in image.rglob("*") if p.is_file()]


def _row(engine: str, share, cap, out: dict | None, report: dict | None, why: str, round_: int) -> dict:
    bound = report is not None and (report["cap_hit"] or report["peak_bytes"] >= BOUND * report["cap_bytes"])
    return {"engine": engine, "round": round_, "budget_share": share, "cap_bytes": cap,
            "tokens_per_second": out and out.get("tokens_per_second"),
            "bytes_read_per_token": out and out.get("bytes_read_per_token"),
            "neuron_bytes_per_token": out and out.get("neuron_bytes_per_token"),
            "io_ms": out and out.get("io_ms"), "mem_ms": out and out.get("mem_ms"),
            "compute_ms": out and out.get("compute_ms"), "peak_bytes": report and report["peak_bytes"],
            "bound_by_cap": bound if cap else None, "failed": why or None}


def _lsparse(a: Against, cap: int | None) -> tuple[dict | None, dict | None, str]:
    command = [str(Path(sys.executable).with_name("lsparse")), "run", str(a.image), "--mode", "predicted",
               "--kernels", a.kernels, "-m", str(a.tokens), "--json", "--ignore-chat-template",
               "-p", PROMPT, *(["--ram-budget", str(cap)] if cap else [])]
    out, report, why = capped(cap, command)
    if out is not None:
        f = out["flash"]
        # bytes as the kernel counts them, as for llama.cpp: the neuron reads and mapped matrices' page faults
        read = out["storage_bytes_per_token"]
        out = {"tokens_per_second": out["generation_tps"],
               "bytes_read_per_token": f["bytes_read_per_token"] if read is None else read,
               "neuron_bytes_per_token": f["bytes_read_per_token"],
               "io_ms": f["io_ms_per_token"], "mem_ms": f["mem_ms_per_token"], "compute_ms": f["compute_ms_per_token"]}
    return out, report, why


def compare(a: Against, progress=print) -> dict:
    """Rows of tok/s, bytes per token, cgroup peak and whether the cap bound, for every engine, budget and
    round, interleaved; llama.cpp's defaults uncapped once per round."""
    from lsparse.bench import memcap
    if a.budgets and not memcap.available():
        raise LsparseError("hard memory caps need root and the cgroup v1 memory controller; pass --budgets '' for "
                           "uncapped runs only")
    if not llama_cpp_params_supported(a.llama_python):
        raise LsparseError(f"{a.llama_python} has no llama-cpp-python that can keep weights in the mmap "
                           "(pip install 'lsparse[peer]', or pass --llama-python PATH)")
    if not a.gguf.exists():
        from lsparse.image.image import Image
        progress(f"writing {a.gguf}")
        write_gguf(a.gguf, Image.open(a.image).manifest.config)
    size = a.gguf.stat().st_size
    llama = [a.llama_python, "-c", LLAMA_CHILD, str(a.gguf), str(a.tokens)]
    rows = []
    for round_ in range(a.rounds):
        drop_cache([a.gguf])
        progress(f"round {round_ + 1}: llama.cpp, its defaults, uncapped")
        rows.append(_row("llama.cpp (defaults)", None, None, *capped(None, [*llama, "defaults"]), round_))
        for share in a.budgets:
            cap = int(share * size)
            for engine in ("llama.cpp (mmap)", "lsparse"):
                drop_cache([a.gguf, *_files(a.image)])
                progress(f"round {round_ + 1}: {engine} under a cap of {share:.0%}")
                result = capped(cap, [*llama, "mmap"]) if engine != "lsparse" else _lsparse(a, cap)
                rows.append(_row(engine, share, cap, *result, round_))
    result = {"date": time.strftime("%Y-%m-%d"), "image": str(a.image), "gguf": str(a.gguf), "gguf_bytes": size,
              "tokens": a.tokens, "rounds": a.rounds, "rows": rows}
    result["summary"] = summary(result)
    return result


def summary(result: dict) -> list[dict]:
    """Per engine and budget: the median over rounds, and lsparse's ratio to llama.cpp under the same cap (and,
    uncapped, to llama.cpp's defaults: its best)."""
    import numpy as np
    groups: dict = {}
    for r in result["rows"]:
        groups.setdefault((r["engine"], r["budget_share"]), []).append(r)
    out = []
    for (engine, share), rows in groups.items():
        speeds = [r["tokens_per_second"] for r in rows if r["tokens_per_second"] is not None]
        read = [r["bytes_read_per_token"] for r in rows if r["bytes_read_per_token"] is not None]
        out.append({"engine": engine, "budget_share": share, "runs": len(rows), "finished": len(speeds),
                    "tokens_per_second": float(np.median(speeds)) if speeds else None,
                    "bytes_read_per_token": float(np.median(read)) if read else None,
                    "peak_bytes": max((r["peak_bytes"] or 0) for r in rows) or None,
                    "bound_by_cap": all(r["bound_by_cap"] for r in rows) if share is not None else None,
                    "failed": next((r["failed"] for r in rows if r["failed"]), None)})
    speed = {(s["engine"], s["budget_share"]): s["tokens_per_second"] for s in out}
    best = speed.get(("llama.cpp (defaults)", None))
    for s in out:
        if s["engine"] == "lsparse" and s["tokens_per_second"]:
            peer = speed.get(("llama.cpp (mmap)", s["budget_share"]))
            s["vs_llama_cpp_same_cap"] = s["tokens_per_second"] / peer if peer else None
            s["vs_llama_cpp_best"] = s["tokens_per_second"] / best if best else None
    return out


def print_summary(result: dict, console=None) -> None:
    from rich.console import Console
    from rich.table import Table
    console = console or Console(width=None if sys.stdout.isatty() else 150)
    table = Table(title=f"lsparse against llama.cpp: {Path(result['image']).name} and {Path(result['gguf']).name} "
                        f"({result['gguf_bytes'] / 1e9:.2f} GB), {result['tokens']} tokens, {result['rounds']} rounds "
                        f"(medians), {result['date']}")
    for col in ("engine", "cap", "tok/s", "MB read/token", "cgroup peak MB", "bound", "x llama.cpp same cap",
                "x llama.cpp best", "failed"):
        table.add_column(col, justify="left" if col in ("engine", "failed") else "right")

    def fmt(v, spec):
        return "-" if v is None else format(v, spec)

    for s in result["summary"]:
        table.add_row(s["engine"], "none" if s["budget_share"] is None else f"{s['budget_share']:.0%}",
                      fmt(s["tokens_per_second"], ".2f"), fmt(s["bytes_read_per_token"] and
                                                             s["bytes_read_per_token"] / 1e6, ".1f"),
                      fmt(s["peak_bytes"] and s["peak_bytes"] / 1e6, ".0f"),
                      "-" if s["bound_by_cap"] is None else ("yes" if s["bound_by_cap"] else "NOT bound"),
                      fmt(s.get("vs_llama_cpp_same_cap"), ".2f"), fmt(s.get("vs_llama_cpp_best"), ".2f"),
                      s["failed"] or "")
    console.print(table)


def write_csv(result: dict, path) -> None:
    import csv
    columns = ("engine", "round", "budget_share", "cap_bytes", "tokens_per_second", "bytes_read_per_token",
               "neuron_bytes_per_token", "io_ms", "mem_ms", "compute_ms", "peak_bytes", "bound_by_cap", "failed")
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in result["rows"]:
            w.writerow([r[c] for c in columns])


def plot(result: dict, path) -> None:
    """tok/s against the cap (a share of the model as stored), one line per engine; llama.cpp's best dashed."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lsparse.bench.report import save_plot
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for engine in ("lsparse", "llama.cpp (mmap)"):
        points = sorted((s["budget_share"], s["tokens_per_second"]) for s in result["summary"]
                        if s["engine"] == engine and s["budget_share"] is not None and s["tokens_per_second"])
        if points:
            ax.plot([100 * p for p, _ in points], [t for _, t in points], "o-", label=engine)
    best = next((s["tokens_per_second"] for s in result["summary"] if s["engine"] == "llama.cpp (defaults)"), None)
    if best:
        ax.axhline(best, ls="--", color="gray", label="llama.cpp defaults, uncapped")
    save_plot(fig, ax, "hard memory cap, % of the model as stored", "tokens per second",
              f"{Path(result['image']).parent.name}: decode speed under a memory cap", path)
