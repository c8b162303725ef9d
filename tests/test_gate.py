"""Quality-gated thresholds (lsparse/runtime/gate.py): `compile --max-quality-loss B` writes the predictor
thresholds of the lowest recall whose predicted-mode perplexity on the held-out calibration text is within B of
dense mode's."""

from __future__ import annotations

import json

import pytest

from lsparse.image.compile import CompileOptions, calibration_windows, held_out_windows
from lsparse.image.image import Image
from lsparse.model.perplexity import perplexity
from lsparse.runtime.gate import threshold_at
from lsparse.runtime.load import load_image
from lsparse.source import resolve
from tests.conftest import lsparse

ARGS = ("--predictor", "svd", "--rank", "8", "--calib-tokens", "2048")


def compiled(root, bound: str):
    out = root / f"gated-{bound}"
    done = lsparse("compile", "builtin:tinystories-reglu", "-o", str(out), *ARGS, "--max-quality-loss", bound)
    assert done.returncode == 0, done.stderr
    assert "Quality gate: recall" in done.stdout
    return Image.open(out)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate")
    return {bound: compiled(root, bound) for bound in ("2%", "30%")}


def calibration_held_out(image: Image) -> list[list[int]]:
    """The calibration windows compile held out, found again from the text and options it records."""
    options = CompileOptions(calib=image.manifest.calibration.text, calib_tokens=2048)
    return held_out_windows(*calibration_windows(resolve("builtin:tinystories-reglu").tokenizer, options))


def predicted_perplexity(image: Image, windows, recall: float | None = None) -> float:
    """Predicted mode as `lsparse run` loads it from the image, at its thresholds or those of `recall`."""
    model, _ = load_image(image.path, mode="predicted")
    if recall is not None:
        for ffn, layer in zip(model.ffns, image.manifest.layers, strict=True):
            ffn.predictor.threshold = threshold_at(layer, recall)
    return perplexity(model, windows)


@pytest.mark.parametrize("bound,share", [("2%", 0.02), ("30%", 0.30)])
def test_the_gated_thresholds_keep_held_out_perplexity_within_the_bound_and_no_lower_recall_does(images, bound,
                                                                                                 share):
    image = images[bound]
    windows = calibration_held_out(image)
    dense = perplexity(load_image(image.path, mode="dense")[0], windows)
    assert predicted_perplexity(image, windows) <= (1 + share) * dense
    recalls = sorted(r for r, _ in image.manifest.layers[0].figures["recall_thresholds"])
    chosen = image.manifest.recall_target
    assert image.manifest.option("max_quality_loss") == share
    if chosen > recalls[0]:
        lower = recalls[recalls.index(chosen) - 1]
        assert predicted_perplexity(image, windows, lower) > (1 + share) * dense


def test_a_looser_bound_computes_fewer_neurons(images):
    tight, loose = (images[b].manifest for b in ("2%", "30%"))
    assert loose.recall_target < tight.recall_target
    gate = {b: images[b].manifest.layers[0].figures["quality_gate"] for b in images}
    assert gate["30%"]["used_fraction"] < gate["2%"]["used_fraction"]
    for layer_tight, layer_loose in zip(tight.layers, loose.layers, strict=True):
        assert layer_loose.predictor_threshold > layer_tight.predictor_threshold


def test_a_bound_no_threshold_meets_is_refused_and_nothing_is_written(tmp_path):
    out = tmp_path / "image"
    done = lsparse("compile", "builtin:tinystories-reglu", "-o", str(out), *ARGS, "--max-quality-loss", "0.0001%")
    assert done.returncode != 0 and done.stderr.startswith("error: no predictor threshold keeps perplexity")
    assert "Traceback" not in done.stderr and not out.exists()
    assert not list(tmp_path.iterdir())
    for bad in (["--max-quality-loss", "1%", "--predictor", "exact"], ["--max-quality-loss", "x"],
                ["--max-quality-loss", "0"]):
        done = lsparse("compile", "builtin:tinystories-reglu", "-o", str(out), *bad)
        assert done.returncode != 0 and done.stderr.startswith("error:") and "Traceback" not in done.stderr, bad


def test_inspect_reports_the_gate_as_json(images):
    done = lsparse("inspect", str(images["2%"].path), "--json")
    gate = json.loads(done.stdout)["quality_gate"]
    assert gate["bound"] == 0.02 and gate["perplexity"] <= 1.02 * gate["dense_perplexity"]
