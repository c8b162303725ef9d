"""The manifest: read and checked in one place. Every broken invariant is one clear refusal, whichever command
reads the image; a manifest that keeps them all reads back exactly as written."""

from __future__ import annotations

import json

import pytest

from lsparse.image.image import Image
from lsparse.image.manifest import Manifest, ManifestError, checksum
from tests.conftest import lsparse
from tests.models import write_tiny_llama


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    from lsparse.image.compile import CompileOptions, compile_image
    from tests.conftest import shared_file
    root = tmp_path_factory.mktemp("manifest")
    folder = write_tiny_llama(root / "llama", tokenizer=shared_file("stories260K/tok512.model"))
    compile_image(str(folder), str(root / "image"), CompileOptions(
        calib=shared_file("tinystories/validation_100.txt"), calib_tokens=512, window=64, bits=16,
        predictor="svd", rank=4, hot_fraction=0.25))
    return root / "image"


def resealed(data: dict) -> str:
    """The manifest with its own checksum made right again, so that the rule under test is what refuses it."""
    return json.dumps({**data, "sha256": checksum(data)})


def test_a_manifest_reads_back_as_written(image):
    text = (image / "manifest.json").read_text()
    manifest = Manifest.from_json(text)
    assert json.loads(manifest.to_json()) == json.loads(text)
    assert manifest.layers[0].hot.dtype.kind == "i" and not manifest.layers[0].hot.flags.writeable


def test_one_flipped_bit_is_refused(image):
    text = bytearray((image / "manifest.json").read_bytes())
    at = text.index(b'"rms_norm_eps": ') + len(b'"rms_norm_eps": 1e-0')  # 1e-05 becomes 1e-04
    text[at] ^= 0x01
    with pytest.raises(ManifestError, match="do not match its own checksum"):
        Manifest.from_json(bytes(text))


def _layer0(d, f):
    f(d["layers"][0])
    return d


MUTATIONS = {
    "a field of the wrong type": (lambda d: {**d, "bundle": {**d["bundle"], "bits": "4"}}, "bundle.bits is not a int"),
    "a field too many": (lambda d: {**d, "extra": 1}, "wrong fields .extra"),
    "a field missing": (lambda d: {k: v for k, v in d.items() if k != "layers"}, "wrong fields .layers"),
    "a neuron both hot and cold": (lambda d: _layer0(d, lambda L: L["cold_order"].__setitem__(0, L["hot"][0])),
                                   "do not split its 128 neurons exactly"),
    "a neuron out of range": (lambda d: _layer0(d, lambda L: L["hot"].__setitem__(-1, 999)), "outside 0..127"),
    "layers reversed": (lambda d: {**d, "layers": d["layers"][::-1]}, "layer 0 has index 1"),
    "a layer cut": (lambda d: {**d, "layers": d["layers"][:1]}, "1 layers where the config has 2"),
    "regions overlapping": (lambda d: _layer0(d, lambda L: L["region"].__setitem__(
        "offset", d["layers"][1]["region"]["offset"])), "overlap"),
    "a region past the file": (lambda d: _layer0(d, lambda L: L["region"].__setitem__(
        "offset", L["region"]["offset"] + (1 << 20))), "past the end of neurons.bin"),
    "a region unaligned": (lambda d: _layer0(d, lambda L: L["region"].__setitem__("offset", 100)),
                           "does not hold its .* cold bundles aligned"),
    "a path outside the image": (lambda d: {**d, "files": {**d["files"], "../x": d["files"]["neurons.bin"]}},
                                 "not a plain name"),
    "a device as a file": (lambda d: {**d, "files": {**d["files"], "/dev/zero": {"size": 0, "sha256": "0" * 64}}},
                           "not a plain name"),
    "a needed file unlisted": (lambda d: {**d, "files": {k: v for k, v in d["files"].items()
                                                         if k != "resident/layer-001.safetensors"}},
                               "lacks resident/layer-001.safetensors"),
    "a stride that does not follow": (lambda d: {**d, "bundle": {**d["bundle"], "stride": 64}},
                                      "do not follow from its geometry"),
    "an unknown architecture": (lambda d: {**d, "config": {**d["config"], "architectures": ["GPT2"],
                                                           "model_type": "gpt2"}}, "unsupported architecture"),
    "a threshold not a number": (lambda d: _layer0(d, lambda L: L.__setitem__("threshold", None)),
                                 "threshold is not a float"),
    "a share above one": (lambda d: _layer0(d, lambda L: L.__setitem__("max_active_fraction", 2.0)), "out of range"),
    "a predictor with no threshold": (lambda d: _layer0(d, lambda L: L.__setitem__("predictor_threshold", None)),
                                      "out of range"),
}


@pytest.mark.parametrize("name", MUTATIONS)
def test_every_broken_invariant_is_one_clear_refusal(image, name):
    mutate, message = MUTATIONS[name]
    data = mutate(json.loads((image / "manifest.json").read_text()))
    with pytest.raises(ManifestError, match=message):
        Manifest.from_json(resealed(data))


def test_nesting_and_size_beyond_any_manifest_are_refused(image):
    with pytest.raises(ManifestError, match="not readable JSON"):
        Manifest.from_json("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ManifestError, match="more than any image needs"):
        Manifest.from_json(" " * (300 << 20))


@pytest.mark.parametrize("command", [["run", "-m", "2"], ["verify"], ["inspect"]])
def test_commands_refuse_a_damaged_manifest_in_one_line(image, tmp_path, command):
    import shutil
    copy = tmp_path / "image"
    shutil.copytree(image, copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["layers"][0]["region"]["offset"] = 100
    (copy / "manifest.json").write_text(resealed(data))
    done = lsparse(command[0], str(copy), *command[1:])
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "cold bundles aligned" in done.stderr


def test_a_manifest_that_is_a_folder_is_refused(tmp_path):
    (tmp_path / "image" / "manifest.json").mkdir(parents=True)
    done = lsparse("run", str(tmp_path / "image"), "-m", "2")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr


def test_the_image_api_refuses_before_reading_any_tensor(image, tmp_path, monkeypatch):
    import shutil
    copy = tmp_path / "image"
    shutil.copytree(image, copy)
    data = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(resealed({**data, "layers": data["layers"][:1]}))
    opened = []
    monkeypatch.setattr(Image, "resident", lambda self, name: opened.append(name))
    with pytest.raises(ManifestError):
        Image.open(copy)
    assert opened == []
