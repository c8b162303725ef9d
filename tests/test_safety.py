"""Nothing lost: --force replaces only what lsparse wrote, atomically, one writer per path; a pack writes only
what its manifest announced; command-line mistakes are one line; a planted native library is never loaded."""

from __future__ import annotations

import io
import json
import os
import signal
import tarfile

import pytest

from lsparse.errors import LsparseError
from lsparse.image import replace
from lsparse.image.image import Image
from tests.conftest import lsparse, shared_file
from tests.models import write_tiny_llama


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("safety") / "llama",
                            tokenizer=shared_file("stories260K/tok512.model"))


def compile_args(checkpoint, out, *more):
    return ("compile", str(checkpoint), "-o", str(out), "--predictor", "svd", "--calib-tokens", "512", "--bits", "16",
            *more)


def test_force_never_deletes_what_lsparse_did_not_write(checkpoint, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    done = lsparse(*compile_args(checkpoint, mine, "--force"))
    assert done.returncode == 1 and "is not an lsparse image" in done.stderr
    assert (mine / "notes.txt").read_text() == "keep me"
    before = sorted(p.name for p in checkpoint.iterdir())
    done = lsparse(*compile_args(checkpoint, checkpoint, "--force"))  # the input itself
    assert done.returncode == 1 and sorted(p.name for p in checkpoint.iterdir()) == before


def test_pack_and_unpack_replace_only_packs_and_images(checkpoint, tmp_path):
    image = tmp_path / "image"
    assert lsparse(*compile_args(checkpoint, image)).returncode == 0
    important = tmp_path / "important.txt"
    important.write_text("keep me")
    for force in ([], ["--force"]):
        done = lsparse("pack", str(image), "-o", str(important), *force)
        assert done.returncode == 1 and "not an lsparse pack" in done.stderr and important.read_text() == "keep me"
    assert lsparse("pack", str(image), "-o", str(tmp_path / "a.zst")).returncode == 0
    assert "already exists" in lsparse("pack", str(image), "-o", str(tmp_path / "a.zst")).stderr
    assert lsparse("pack", str(image), "-o", str(tmp_path / "a.zst"), "--force").returncode == 0
    done = lsparse("unpack", str(tmp_path / "a.zst"), "-o", str(tmp_path), "--force")  # the folder holding it
    assert done.returncode == 1 and (tmp_path / "a.zst").exists() and important.exists()
    assert lsparse("unpack", str(tmp_path / "a.zst"), "-o", str(image), "--force").returncode == 0
    assert Image.open(image).verify() == []


def test_stale_staging_of_killed_writers_is_removed(checkpoint, tmp_path):
    image = tmp_path / "image"
    (tmp_path / ".image.partial-999999").mkdir()
    (tmp_path / ".image.partial-999999" / "neurons.bin").write_bytes(b"x" * 1000)
    (tmp_path / ".image.old-999998").mkdir()
    assert lsparse(*compile_args(checkpoint, image)).returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image"]


def test_a_second_writer_of_one_path_is_refused(checkpoint, tmp_path):
    with replace.locked(tmp_path / "image"):
        done = lsparse(*compile_args(checkpoint, tmp_path / "image"))
    assert done.returncode == 1 and "another lsparse process is writing" in done.stderr
    assert not (tmp_path / "image").exists()


def test_replacing_is_atomic_and_a_late_ctrl_c_loses_nothing(checkpoint, tmp_path, monkeypatch):
    """The swap is one step: killed before it, the old image stands; after it, the new one. A Ctrl-C that
    arrives while the swap runs is held back and let go: the image was complete."""
    from lsparse.image.compile import CompileOptions, compile_image
    options = CompileOptions(calib=shared_file("tinystories/validation_100.txt"), calib_tokens=512, bits=16,
                             predictor="svd", rank=4, force=True)
    image = tmp_path / "image"
    old = compile_image(str(checkpoint), str(image), options)
    real = replace._exchange
    swaps = []

    def exchange_with_ctrl_c(a, b):
        os.kill(os.getpid(), signal.SIGINT)  # held back by commit()
        swaps.append(real(a, b))
        return swaps[-1]

    monkeypatch.setattr(replace, "_exchange", exchange_with_ctrl_c)
    new = compile_image(str(checkpoint), str(image), CompileOptions(**{**options.__dict__, "hot_fraction": 0.5}))
    assert swaps == [True] and Image.open(image).verify() == []
    assert Image.open(image).manifest.created >= old.created and new.option("hot_fraction") == 0.5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["image"]

    def killed(a, b):
        raise KeyboardInterrupt  # as if the process died before the swap
    monkeypatch.setattr(replace, "_exchange", killed)
    with pytest.raises(KeyboardInterrupt):
        compile_image(str(checkpoint), str(image), options)
    assert Image.open(image).manifest.option("hot_fraction") == 0.5 and Image.open(image).verify() == []


def _pack_with(tmp_path, image, extra: bytes | None = None, size_lie: bool = False):
    """A pack of `image` as lsparse writes it, then altered: a member the manifest does not list, or a
    neuron file longer than the manifest says."""
    import zstandard
    manifest = Image.open(image).manifest
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        tar.add(image / "manifest.json", arcname="manifest.json")
        for name in manifest.files:
            data = (image / name).read_bytes() + (b"\0" * (1 << 20) if size_lie and name == "neurons.bin" else b"")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        if extra is not None:
            info = tarfile.TarInfo("payload.bin")
            info.size = len(extra)
            tar.addfile(info, io.BytesIO(extra))
    path = tmp_path / "crafted.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(raw.getvalue()))
    return path


def test_unpack_writes_only_what_the_manifest_announced(checkpoint, tmp_path):
    from lsparse.image.pack import unpack
    image = tmp_path / "image"
    assert lsparse(*compile_args(checkpoint, image)).returncode == 0
    for crafted in (_pack_with(tmp_path, image, extra=b"x" * 4096), _pack_with(tmp_path, image, size_lie=True)):
        with pytest.raises(LsparseError, match="not a file of the size its manifest lists"):
            unpack(crafted, tmp_path / "out")
        assert not (tmp_path / "out").exists()
        assert not any(p.name.startswith(".out.") for p in tmp_path.iterdir())


@pytest.mark.parametrize("args", [["run", "IMG", "-m", "0"], ["run", "IMG", "--bogus"], ["run", "IMG", "-m", "abc"],
                                  ["run", "IMG", "--window", "0"], ["run", "IMG", "--readers", "0"],
                                  ["compile", "builtin:tinystories-reglu", "-o", "x", "--hot-fraction", "2"],
                                  ["pack", "IMG", "--level", "0"], ["nonsense"]])
def test_command_line_mistakes_are_one_line(args, tmp_path):
    done = lsparse(*[str(tmp_path) if a == "IMG" else a for a in args], cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.startswith("error: ") and done.stderr.count("\n") == 1, done.stderr


def test_bare_lsparse_shows_the_help(tmp_path):
    done = lsparse(cwd=tmp_path)
    assert done.returncode == 2 and "Traceback" not in done.stderr and "compile" in done.stdout + done.stderr


def test_output_under_a_file_is_one_line(checkpoint, tmp_path):
    (tmp_path / "file").write_text("x")
    done = lsparse(*compile_args(checkpoint, tmp_path / "file" / "x"))
    assert done.returncode == 1 and "Traceback" not in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_a_library_others_can_write_is_never_loaded(tmp_path, monkeypatch):
    from lsparse.kernels import native
    if native.compiler() is None:
        pytest.skip("no C compiler: no native library to plant")
    shared = tmp_path / "cache"
    shared.mkdir(mode=0o777)
    os.chmod(shared, 0o777)  # as under umask 000, or a folder others share
    monkeypatch.setattr(native, "CACHE", shared)
    monkeypatch.setattr(native, "_loaded", {})
    library = native.library()
    assert library is not None and not library._name.startswith(str(shared))
    assert not native.private(shared) and native.private(library._name)


def test_an_empty_ram_budget_is_refused(checkpoint, tmp_path):
    image = tmp_path / "image"
    assert lsparse(*compile_args(checkpoint, image)).returncode == 0
    done = lsparse("run", str(image), "--ram-budget", "", "-m", "2")
    assert done.returncode == 1 and "--ram-budget is empty" in done.stderr


@pytest.mark.parametrize("args,message", [
    (["run", "--dense", "CKPT", "--mode", "exact"], "--mode apply to images"),
    (["run", "--dense", "CKPT", "--ram-budget", "1GB"], "--ram-budget apply to images"),
    (["run", "IMAGE", "--dense", "--mode", "exact"], "--dense is --mode dense"),
    (["run", "IMAGE", "--revision", "main"], "--revision apply to checkpoints"),
    (["run", "IMAGE", "--threshold", "nan"], "--threshold must be a finite number"),
    (["run", "IMAGE", "--temp", "nan"], "--temp must be a number >= 0"),
    (["run", "IMAGE", "--seed", "-1"], "--seed must be between 0"),
    (["stats", "CKPT", "--text", "CKPT/config.json", "--levels", "5"], "--levels are shares"),
])
def test_options_that_cannot_apply_are_refused_not_ignored(checkpoint, tmp_path, args, message):
    image = tmp_path / "image"
    if "IMAGE" in args:
        assert lsparse(*compile_args(checkpoint, image)).returncode == 0
    done = lsparse(*[str(image) if a == "IMAGE" else a.replace("CKPT", str(checkpoint)) for a in args])
    assert done.returncode == 1 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_a_prompt_that_is_not_utf8_and_a_long_generation_end_cleanly(checkpoint, tmp_path):
    import subprocess

    from tests.conftest import LSPARSE
    image = tmp_path / "image"
    assert lsparse(*compile_args(checkpoint, image)).returncode == 0
    done = subprocess.run([str(LSPARSE), "run", str(image), "-p", b"caf\xe9".decode("utf-8", "surrogateescape"),
                           "-m", "2"], capture_output=True, text=True)
    assert done.returncode == 1 and "not valid UTF-8" in done.stderr
    # the tiny model's context is 64: -m 1000 stops there, says so, and a budget is planned for the context
    done = lsparse("run", str(image), "-m", "1000", "--ignore-chat-template")
    assert done.returncode == 0 and "at the end of the model's context" in done.stderr


def test_writing_where_nobody_may_write_is_one_line(checkpoint, tmp_path):
    """/sys refuses new files even to root (a read-only folder does not, for root)."""
    if not os.path.isdir("/sys") or os.access("/sys", os.W_OK) and os.path.exists("/sys/x.zst"):
        pytest.skip("no /sys here")
    image = tmp_path / "image"
    assert lsparse(*compile_args(checkpoint, image)).returncode == 0
    for args in (["pack", str(image), "-o", "/sys/x.zst"],
                 ["stats", "builtin:tinystories-reglu", "--text", str(shared_file("tinystories/validation_100.txt")),
                  "--tokens", "64", "--plot", "/sys/x.png"]):
        done = lsparse(*args)
        assert done.returncode == 1 and done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


def test_a_disk_that_fills_while_safetensors_writes_is_one_line_and_leaves_nothing(checkpoint, tmp_path,
                                                                                    monkeypatch):
    import safetensors.numpy

    from lsparse.image.compile import CompileOptions, compile_image

    def full(tensors, path):
        raise safetensors.SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                                          'message: "No space left on device" })')
    monkeypatch.setattr(safetensors.numpy, "save_file", full)
    with pytest.raises(LsparseError, match="the disk is full"):
        compile_image(str(checkpoint), str(tmp_path / "image"), CompileOptions(
            calib=shared_file("tinystories/validation_100.txt"), calib_tokens=512, predictor="svd", rank=4,
            bits=16))
    assert list(tmp_path.iterdir()) == []


def test_row_checksums_in_c_are_the_definition():
    import numpy as np

    from lsparse.image.bundles import row_sums
    from lsparse.kernels import native
    row = np.array([1, 0, 0, 0, 2, 0, 0, 0, 255, 255, 255, 255], dtype=np.uint8)  # words 1, 2, 2^32 - 1
    assert row_sums(row[None])[0] == 1 * 1 + 2 * 3 + (2**32 - 1) * 5
    rows = np.random.default_rng(0).integers(0, 256, (50, 3, 36), dtype=np.uint8)
    np.testing.assert_array_equal(native.row_sums(rows), row_sums(rows))


@pytest.mark.parametrize("mode", ["exact", "predicted", "hybrid", "dense"])
@pytest.mark.parametrize("damage", ["one byte", "random bytes", "another layout"])
def test_a_damaged_or_foreign_neuron_file_stops_the_run(checkpoint, tmp_path, mode, damage):
    import shutil

    import numpy as np
    image = tmp_path / "image"
    assert lsparse(*compile_args(checkpoint, image)).returncode == 0
    want = json.loads(lsparse("run", str(image), "--mode", mode, "-m", "12", "--json").stdout)["tokens"]
    neurons = bytearray((image / "neurons.bin").read_bytes())
    region = Image.open(image).manifest.layers[1].region
    if damage == "one byte":
        neurons[region.offset + 7] ^= 0x10
    elif damage == "random bytes":
        neurons[region.offset:region.offset + region.size] = np.random.default_rng(0).bytes(region.size)
    else:
        assert lsparse(*compile_args(checkpoint, tmp_path / "natural", "--layout", "natural")).returncode == 0
        neurons = (tmp_path / "natural" / "neurons.bin").read_bytes()
        assert len(neurons) == (image / "neurons.bin").stat().st_size
    (image / "neurons.bin").write_bytes(bytes(neurons))
    done = lsparse("run", str(image), "--mode", mode, "-m", "12", "--json")
    if done.returncode == 0:  # only bundles this run never read were damaged: the output must not change
        assert json.loads(done.stdout)["tokens"] == want
    else:
        assert done.returncode == 1 and "does not match its checksum" in done.stderr and "Traceback" not in \
            done.stderr, done.stderr
    assert damage == "one byte" or done.returncode == 1  # a whole layer's bundles: some are always read
    shutil.rmtree(tmp_path / "natural", ignore_errors=True)


def test_a_budget_is_planned_for_the_context_the_run_can_reach(checkpoint, tmp_path):
    """-m 100000 on a model of 64 tokens of context needs no more RAM than -m 56: it was refused before."""
    from lsparse.runtime.options import DecodeOptions
    from lsparse.runtime.plan import plan
    image = tmp_path / "image"
    assert lsparse(*compile_args(checkpoint, image)).returncode == 0
    budget = plan(Image.open(image).manifest, None, DecodeOptions(context=64)).smallest_budget
    for tokens in ("56", "100000"):
        done = lsparse("run", str(image), "-m", tokens, "--ram-budget", str(budget), "--kernels", "reference")
        assert done.returncode == 0, done.stderr


def test_a_deleted_tokenizer_is_one_line(checkpoint, tmp_path):
    image = tmp_path / "image"
    assert lsparse(*compile_args(checkpoint, image)).returncode == 0
    (image / "tokenizer.model").unlink()
    done = lsparse("run", str(image), "-m", "2")
    assert done.returncode == 1 and "tokenizer.model: missing" in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.parametrize("delay", [0.05, 0.15, 0.3, 0.5])
def test_ctrl_c_during_start_up_is_one_line(checkpoint, tmp_path, delay):
    import subprocess
    import time

    from tests.conftest import LSPARSE
    process = subprocess.Popen([str(LSPARSE), "run", "--dense", str(checkpoint), "-m", "50"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    # the run takes about 0.3 s: a signal after its output finds the interpreter exiting, with the default
    # handler back, and ends it silently (as any program's Ctrl-C)
    finished_then_killed = process.returncode == -signal.SIGINT and err == "" and "Generation:" in out
    assert "Traceback" not in err and (process.returncode == 130 and err == "interrupted\n"
                                       or process.returncode == 0 or finished_then_killed), (process.returncode, err)


def test_ctrl_c_inside_an_import_waits_for_the_import(tmp_path):
    """MLX's extension aborts the process when interrupted while it loads: the command line's handler lets an
    import finish and raises KeyboardInterrupt after it."""
    import subprocess
    import sys

    (tmp_path / "interrupts_itself.py").write_text(
        "import os, signal, time\nos.kill(os.getpid(), signal.SIGINT)\n"
        "end = time.time() + 0.2\nwhile time.time() < end:\n    pass\nloaded = True\n")
    script = ("import signal, sys, time\nfrom lsparse.cli import _on_interrupt\n"
              "signal.signal(signal.SIGINT, _on_interrupt)\nsys.path.insert(0, sys.argv[1])\n"
              "try:\n    import interrupts_itself\n    time.sleep(5)\n    print('not interrupted')\n"
              "except KeyboardInterrupt:\n    print('interrupted, imported:', 'interrupts_itself' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    # an import interrupted midway leaves no module behind
    assert done.stdout == "interrupted, imported: True\n", (done.stdout, done.stderr)
