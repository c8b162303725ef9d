"""Seeded, bounded fuzzing of an image: mutations of the manifest and of every binary file, each run through
`lsparse verify` and `lsparse run` as a user runs them (in this process, for speed). Every outcome must be a
clean one-line refusal or output identical to the undamaged image's: no traceback, no hang, no silent change."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import signal
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import shared_file
from tests.models import write_tiny_llama

CPU_SECONDS = 20  # of CPU time per command: far beyond what a tiny image needs; past it, a hang


class Hang(BaseException):
    """Raised by the CPU-time alarm; a BaseException, so that nothing in lsparse can mistake it for its own."""


def cli(*args) -> tuple[str, int | str, str]:
    """(stdout, exit status or "traceback"/"hang", stderr) of `lsparse ARGS` run in this process."""
    from lsparse.cli import main

    def expired(signum, frame):
        raise Hang

    out, err = io.StringIO(), io.StringIO()
    previous = signal.signal(signal.SIGPROF, expired)
    signal.setitimer(signal.ITIMER_PROF, CPU_SECONDS)
    argv, sys.argv = sys.argv, ["lsparse", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except Hang:
        status = "hang"
    except BaseException:  # noqa: BLE001  (anything escaping main is a traceback to the user)
        status = "traceback"
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)
        sys.argv = argv
    return out.getvalue(), status, err.getvalue()


def essence(command: str, out: str, image: Path) -> str:
    """What a command's output says, less what differs from run to run: the image's path, and timings."""
    if command.startswith("run"):
        try:
            result = json.loads(out)
        except ValueError:
            return f"not JSON: {out[:200]!r}"
        return json.dumps([result["tokens"], result["text"]])
    return out.replace(str(image), "IMAGE")


def outcome(command: str, got: tuple, image: Path, want: tuple, original: Path) -> str:
    out, status, err = got
    if status in ("hang", "traceback"):
        return status
    if status == 1 and err.startswith("error: ") and err.count("\n") == 1:
        return "refused"
    same = status == want[1] == 0 and essence(command, out, image) == essence(command, want[0], original)
    return "same" if same else "silent change"


def mutate(data: bytes, rng, region: tuple[int, int] | None = None) -> bytes:
    """One random damage: a flipped bit, a cut, a byte dropped or doubled, or random bytes over a span."""
    lo, hi = region or (0, len(data))
    data, at = bytearray(data), int(rng.integers(lo, hi))
    kind = rng.integers(5)
    if kind == 0:
        data[at] ^= 1 << int(rng.integers(8))
    elif kind == 1:
        del data[at:]
    elif kind == 2:
        del data[at]
    elif kind == 3:
        data.insert(at, data[at])
    else:
        n = int(rng.integers(1, 4096))
        data[at:at + n] = rng.bytes(len(data[at:at + n]))
    return bytes(data)


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    from lsparse.image.compile import CompileOptions, compile_image
    root = tmp_path_factory.mktemp("fuzz")
    folder = write_tiny_llama(root / "llama", tokenizer=shared_file("stories260K/tok512.model"))
    compile_image(str(folder), str(root / "image"), CompileOptions(
        calib=shared_file("tinystories/validation_100.txt"), calib_tokens=512, window=64, bits=8, group_size=32,
        predictor="svd", rank=4, hot_fraction=0.1))
    return root / "image"


def targets(image: Path) -> dict[str, int]:
    """File -> mutations: the manifest most, then each binary file."""
    files = sorted(str(p.relative_to(image)) for p in image.rglob("*") if p.is_file())
    return {name: 150 if name == "manifest.json" else 120 if name == "neurons.bin" else 25 for name in files}


def test_damaged_images_are_refused_or_decode_exactly_as_before(image, tmp_path):
    from lsparse.image.image import Image
    rng = np.random.default_rng(2026)
    run = ["run", "-m", "6", "--json", "--ignore-chat-template"]
    commands = {"verify": ["verify"], "run": run, "run-predicted": [*run, "--mode", "predicted"],
                "run-hybrid": [*run, "--mode", "hybrid"]}
    want = {name: cli(args[0], image, *args[1:]) for name, args in commands.items()}
    assert all(w[1] == 0 for w in want.values()), want
    regions = [(L.region.offset, L.region.offset + L.region.size) for L in Image.open(image).manifest.layers]
    tally = Counter()
    bad = []
    for name, count in targets(image).items():
        for i in range(count):
            copy = tmp_path / f"case-{name.replace('/', '-')}-{i}"
            shutil.copytree(image, copy)
            original = (copy / name).read_bytes()
            region = regions[i % len(regions)] if name == "neurons.bin" and i % 2 else None  # half in a region
            (copy / name).write_bytes(mutate(original, rng, region))
            for command, args in commands.items():
                result = outcome(command, cli(args[0], copy, *args[1:]), copy, want[command], image)
                tally[(name.split("/")[0], command, result)] += 1
                if result not in ("refused", "same"):
                    got = cli(args[0], copy, *args[1:])
                    bad.append(f"{name} #{i} {command}: {result} ({got[1]}; {got[2][-300:]!r}; "
                               f"{essence(command, got[0], copy)[:300]} against "
                               f"{essence(command, want[command][0], image)[:300]})")
            shutil.rmtree(copy)
    print(json.dumps({" ".join(k): v for k, v in sorted(tally.items())}, indent=1))
    assert not bad, "\n".join(bad)
    assert tally[("neurons.bin", "run-hybrid", "refused")] > 0 and tally[("manifest.json", "run", "refused")] > 0
