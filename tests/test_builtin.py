"""The built-in ReLU model meets its targets on held-out text, and compiles into an image that decodes
exactly as dense does, with predictors and a layout measured on real calibration data."""

from __future__ import annotations

import numpy as np
import pytest

from lsparse.calibrate.activations import record_activations
from lsparse.image.compile import CompileOptions, compile_image
from lsparse.model import load_model
from lsparse.model.perplexity import perplexity
from lsparse.runtime.generate import generate
from lsparse.runtime.load import load_image
from lsparse.source import resolve
from lsparse.text import read_documents, token_windows
from tests.conftest import shared_file

BUILTIN = "builtin:tinystories-reglu"


@pytest.fixture(scope="module")
def held_out():
    checkpoint = resolve(BUILTIN)
    docs = read_documents(shared_file("tinystories/validation_100.txt"))
    return checkpoint, token_windows(checkpoint.tokenizer, docs, 512)


def test_shape_targets():
    config = resolve(BUILTIN).config
    assert config["hidden_act"] in ("relu", "fatrelu") and config["num_hidden_layers"] >= 6
    assert config["intermediate_size"] >= 4 * config["hidden_size"]


def test_sparsity_and_perplexity_targets_on_held_out_text(held_out):
    checkpoint, windows = held_out
    student = load_model(checkpoint, "numpy")
    zero = np.mean([(a == 0).mean() for a in record_activations(student, windows)])
    assert zero >= 0.85
    teacher = load_model(resolve(str(shared_file("stories260K/stories260K.bin"))), "numpy")
    assert perplexity(student, windows) <= 1.15 * perplexity(teacher, windows)


@pytest.fixture(scope="module")
def builtin_image(tmp_path_factory):
    image = tmp_path_factory.mktemp("builtin") / "image"
    # max_gap_bytes=0: the layout figures count adjacent bundles only, so that they show the ordering itself
    # (with read-through gaps of 16 KiB, this tiny model's whole layer is one read in either order)
    return image, compile_image(BUILTIN, str(image), CompileOptions(bits=8, predictor="lowrank", max_gap_bytes=0))


@pytest.mark.slow  # the fixture trains a predictor per layer: about 30 s
def test_exact_mode_reproduces_dense_for_256_tokens(builtin_image):
    image, _ = builtin_image
    greedy = lambda logits: int(np.argmax(logits))  # noqa: E731
    runs = {}
    for mode in ("exact", "dense"):
        model, tok = load_image(image, mode=mode)
        prompt = tok.encode("Once upon a time")
        runs[mode] = generate(model, tok, prompt, 256, greedy, set())
    assert len(runs["exact"]) == 256 and runs["exact"] == runs["dense"]


@pytest.mark.slow
def test_predictors_and_layout_on_real_calibration_data(builtin_image):
    _, manifest = builtin_image
    quality = [layer.figures["predictor"] for layer in manifest.layers]
    # held out, not the training split; the last layer fires 0.6% of its neurons and is the hardest to predict
    assert np.mean([q["recall"] for q in quality]) >= 0.9
    assert np.mean([q["false_negative_mass"] for q in quality]) <= 0.05
    assert all(q["predicted_fraction"] < 0.5 for q in quality)  # it loads far less than the whole layer
    reads = {k: np.mean([layer.figures["layout"][k]["reads_per_token"] for layer in manifest.layers])
             for k in ("natural", "coactivation")}
    assert reads["coactivation"] < reads["natural"]
