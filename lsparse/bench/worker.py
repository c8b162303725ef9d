"""One rung in a process of its own (so that its peak memory is its own), under a hard memory cap where this
machine can set one: `python -m lsparse.bench.worker` reads the rung's spec as JSON on stdin."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

from lsparse.bench.rungs import Rung
from lsparse.errors import LsparseError


def run_rung(spec: dict) -> dict:
    """One rung, in this process: greedy generation from each prompt, its costs, and (when asked) perplexity."""
    from lsparse.bench.report import second_half
    from lsparse.model.perplexity import perplexities
    from lsparse.runtime.correct import stream_corrected
    from lsparse.runtime.generate import peak_rss_bytes, stream_generate
    from lsparse.runtime.load import load_image
    from lsparse.runtime.sampling import make_sampler

    rung = Rung(**spec["rung"])
    model, tokenizer = load_image(spec["image"], rung.decode_options(spec["workers"], spec["context"]))
    if rung.mode == "naive":
        model = NaiveModel(model, Path(spec["image"]), spec["workers"])
    result = {"tokens": [], "prompt_tps": [], "generation_tps": [], "flash": []}
    for prompt in spec["prompts"]:
        model.costs.steps.clear()
        if rung.correct_every:
            responses = list(stream_corrected(model, tokenizer, prompt, spec["gen_tokens"], rung.correct_every,
                                              None, set()))
            result.setdefault("correction", []).append(model.correction.report())
        else:
            responses = list(stream_generate(model, tokenizer, prompt, spec["gen_tokens"], make_sampler(), set()))
        result["tokens"].append([r.token for r in responses])
        result["generation_tps"].append(responses[-1].generation_tps)
        if model.fetcher is not None:
            result["flash"].append(model.flash_report(tokens=len(responses) if rung.correct_every else None))
    result["peak_memory_bytes"] = peak_rss_bytes()
    result["memory_plan"] = model.memory_plan.report()
    quality_model = model.dense if rung.mode == "naive" else model  # the same arithmetic, without the reads
    # correction changes which tokens are generated, not a teacher-forced score: no perplexity of its own
    quality = {} if rung.correct_every else spec["quality"]
    # each window's first half a prompt (a flock is chosen from it), its second half reported apart as well
    figures = {name: perplexities(quality_model, w) for name, w in quality.items()}
    result["perplexity"] = {**{name: f[0] for name, f in figures.items()},
                            **{second_half(name): f[1] for name, f in figures.items()}}
    model.close()
    return result


class NaiveModel:
    """The naive baseline: before each token, every file of the image is read from flash (timed and
    counted); the arithmetic then uses the copy already in RAM, so only the reading is emulated."""

    def __init__(self, dense, image: Path, workers: int):
        from lsparse.runtime.ffn_streamed import HYBRID_READ_BYTES
        from lsparse.runtime.reader import FlashReader
        self.dense, self.costs, self.memory_plan = dense, dense.costs, dense.memory_plan
        self.xp, self.make_cache, self.context_length = dense.xp, dense.make_cache, dense.context_length
        files = [p for p in sorted(image.rglob("*")) if p.is_file() and p.name != "manifest.json"]
        self.readers = [FlashReader(p, workers=workers, buffer_bytes=workers * HYBRID_READ_BYTES) for p in files]
        self.spans = [np.arange(0, r.size, HYBRID_READ_BYTES) for r in self.readers]
        self.fetcher, self.reader = self, self.readers[0]
        self.dense_ffn_bytes = dense.dense_ffn_bytes

    def __call__(self, tokens, cache, last_only: bool = False):
        from lsparse.runtime.ffn_streamed import HYBRID_READ_BYTES
        out = []
        for t in tokens:
            cost = self.costs.start()
            for reader, starts in zip(self.readers, self.spans, strict=True):
                lengths = np.minimum(HYBRID_READ_BYTES, reader.size - starts)
                transferred, io = reader.read_all(starts, lengths)
                cost.bytes_read += transferred
                cost.bytes_needed += int(lengths.sum())
                cost.requests += len(starts)
                cost.io_s += io
                cost.read_s += io
            out.append(self.dense.model([t], cache, self.dense.ffns))
            if last_only:
                del out[:-1]
        return np.concatenate(out)

    def flash_report(self, tokens: int | None = None) -> dict:
        from lsparse.runtime.costs import flash_report
        return {**flash_report(self.costs.steps, self.dense_ffn_bytes(), tokens), "direct_io": self.reader.direct,
                "gap_bytes": 0, "gap_rule": "whole files"}

    def close(self):
        for r in self.readers:
            r.close()
        self.dense.close()


def can_cap() -> bool:
    from lsparse.bench import memcap
    return memcap.available()


def in_subprocess(spec: dict, cap: int | None = None) -> dict:
    """A rung in a child process; with `cap`, under a hard cgroup memory cap of that many bytes (the page cache
    counts), whose peak and failures are returned under "cgroup"."""
    command = [sys.executable, "-m", "lsparse.bench.worker"]
    if cap is not None:
        command = [sys.executable, "-m", "lsparse.bench.memcap", str(cap), "--", *command]
    done = subprocess.run(command, input=json.dumps(spec), capture_output=True, text=True)
    lines = (done.stderr.strip() or "no output").splitlines()
    report = json.loads(lines.pop()) if cap is not None and lines and lines[-1].startswith("{") else None
    if done.returncode != 0:
        why = "killed at its memory cap" if report and report["oom_killed"] else (lines[-1] if lines else "failed")
        raise LsparseError(f"rung {spec['rung']['name']} failed: {why}")
    result = json.loads(done.stdout)
    result["cgroup"] = report
    return result


if __name__ == "__main__":
    try:
        out = run_rung(json.loads(sys.stdin.read()))
    except LsparseError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    print(json.dumps(out))
