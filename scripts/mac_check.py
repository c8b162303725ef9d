"""`make mac-check`: the first measurements of lsparse's Metal path, on an Apple-silicon Mac, in one report.

    python scripts/mac_check.py [--out out/mac-check]

Runs, in order, each step's output kept: `make test-metal` (every kernel variant on Metal against MLX's
dequantize) and the one-evaluation-per-layer checks; `lsparse bench kernels` (metal, mlx and cpu side by
side) and its performance model (what the kernels were predicted to cost, to set beside what they did); the
built-in model compiled 4-bit and decoded in every mode on the metal and cpu backends (the tokens must
agree); a short run at Llama-2-7B's geometry (4 layers); the storage device measured on that image's neuron
file, its cached pages dropped first. Writes OUT/report.json and OUT/report.md, to attach to an issue.
Elsewhere (no Metal) it prints what it would run and exits with status 1; `--stand-in reference` runs every
step there with the reference backend in the metal backend's place, to check the script itself.
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
LSPARSE = str(BIN / "lsparse")
MODES = (("exact", ["--mode", "exact"]), ("predicted", ["--mode", "predicted"]), ("hybrid", ["--mode", "hybrid"]),
         ("dense", ["--dense"]))


def steps(out: Path, metal: str = "metal") -> list[tuple[str, list[str]]]:
    """(name, command) of every step; `metal`: the backend that stands for metal (reference: a check here)."""
    image = str(out / "builtin-q4")
    runs = [(f"run {mode} {kernels}", [LSPARSE, "run", image, *flags, "--kernels", name, "-p", "Once upon a time",
                                       "-m", "64", "--json"])
            for mode, flags in MODES for kernels, name in (("metal", metal), ("cpu", "cpu"))]
    return [
        ("make test-metal", ["make", "test-metal"] if metal == "metal" else ["true"]),
        ("one evaluation per layer", [sys.executable, "-m", "pytest", "-q", "-rs", "tests/test_metal.py", "-k",
                                      "lazy or graph or performance"]),
        ("bench kernels", [LSPARSE, "bench", "kernels", "--json"]),
        ("bench kernels --model", [LSPARSE, "bench", "kernels", "--model", "--json"]),
        ("compile builtin 4-bit", [LSPARSE, "compile", "builtin:tinystories-reglu", "-o", image, "--bits", "4",
                                   "--force"]),
        *runs,
        # the full system's rung (the metal backend) and the packed cache's (MLX's quantized kernel) only
        ("7b geometry, 4 layers", [LSPARSE, "bench", "synthetic:llama-2-7b", "--layers", "4", "--rungs",
                                   "+4-bit,+packed cache", "--prompts", "1", "--prompt-tokens", "4",
                                   "--gen-tokens", "16", "--budgets", "", "--variants", str(out / "synthetic"),
                                   "--json"]),
        ("storage device", [sys.executable, __file__, "--device", str(out / "synthetic")]),
    ]


def machine() -> dict:
    def sysctl(key):
        done = subprocess.run(["sysctl", "-n", key], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else None
    import mlx.core as mx
    return {"platform": platform.platform(), "chip": sysctl("machdep.cpu.brand_string"),
            "memory_bytes": sysctl("hw.memsize"), "mlx": mx.__version__, "metal": mx.metal.is_available(),
            "python": sys.version.split()[0], "date": time.strftime("%Y-%m-%d %H:%M")}


def run_step(name: str, argv: list[str]) -> dict:
    start = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True)
    step = {"step": name, "command": " ".join(argv), "status": done.returncode,
            "seconds": round(time.perf_counter() - start, 1), "stderr_tail": done.stderr[-3000:]}
    try:
        step["result"] = json.loads(done.stdout)
    except ValueError:
        step["stdout_tail"] = done.stdout[-3000:]
    return step


def agreement(report: list[dict]) -> list[str]:
    """Per mode: whether metal and cpu decoded the same tokens."""
    lines = []
    by = {s["step"]: s.get("result") for s in report}
    for mode, _ in MODES:
        metal, cpu = by.get(f"run {mode} metal"), by.get(f"run {mode} cpu")
        if metal and cpu:
            same = metal["tokens"] == cpu["tokens"]
            lines.append(f"- {mode}: metal {metal['generation_tps']:.1f} tok/s, cpu {cpu['generation_tps']:.1f} "
                         f"tok/s, tokens {'identical' if same else 'DIFFER'}")
    return lines


def markdown(info: dict, report: list[dict]) -> str:
    rows = "\n".join(f"| {s['step']} | {s['status']} | {s['seconds']} |" for s in report)
    return (f"# lsparse mac-check, {info['date']}\n\n{info['chip']}, {info['platform']}, MLX {info['mlx']}, "
            f"Metal {info['metal']}\n\n| step | exit status | seconds |\n|---|---|---|\n{rows}\n\n"
            "## metal against cpu, built-in model 4-bit, 64 tokens\n\n" + "\n".join(agreement(report)) +
            "\n\nEverything measured is in report.json (each step's command, output and status).\n")


def device(folder: Path) -> None:
    """The storage device under the largest neuron file there, its cached pages dropped first."""
    from lsparse.runtime.device import measure
    from lsparse.runtime.reader import FlashReader
    path = max(folder.rglob("neurons.bin"), key=lambda p: p.stat().st_size)
    reader = FlashReader(path, workers=4, direct=True, buffer_bytes=16 << 20)
    try:
        print(json.dumps({"file": str(path), **measure(reader)}))
    finally:
        reader.close()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--device"]:
        device(Path(argv[1]))
        return 0
    out = Path(argv[argv.index("--out") + 1] if "--out" in argv else "out/mac-check")
    stand_in = argv[argv.index("--stand-in") + 1] if "--stand-in" in argv else None
    plan = steps(out, stand_in or "metal")
    import mlx.core as mx
    if stand_in is None and (sys.platform != "darwin" or not mx.metal.is_available()):
        print("make mac-check runs on an Apple-silicon Mac with Metal; here it would run:")
        for name, command in plan:
            print(f"  {name}: {' '.join(command)}")
        print(f"and write {out}/report.json and {out}/report.md")
        return 1
    out.mkdir(parents=True, exist_ok=True)
    info, report = machine(), []
    for name, command in plan:
        print(f"{name} ...", flush=True)
        report.append(run_step(name, command))
        print(f"  exit status {report[-1]['status']} in {report[-1]['seconds']} s", flush=True)
    (out / "report.json").write_text(json.dumps({"machine": info, "steps": report}, indent=1))
    (out / "report.md").write_text(markdown(info, report))
    print(f"wrote {out}/report.json and {out}/report.md: attach both to an issue")
    return 0 if all(s["status"] == 0 for s in report) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
