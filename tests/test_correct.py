"""Correction (Sirius, lsparse/runtime/correct.py): the dense path checks predicted mode's tokens every k
tokens; the text is the dense path's, whatever k and the predictor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lsparse.image.compile import CompileOptions, compile_image
from lsparse.runtime.correct import stream_corrected
from lsparse.runtime.generate import generate
from lsparse.runtime.load import load_image
from tests.conftest import lsparse


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    """The built-in model, 4-bit, with a rank-16 SVD predictor: a weak one, whose greedy text drifts from dense
    within a few tokens, so that corrections happen."""
    out = tmp_path_factory.mktemp("correct") / "image"
    compile_image("builtin:tinystories-reglu", str(out), CompileOptions(bits=4, predictor="svd", rank=16))
    return out


PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
          "friends. One day, she saw a big red ball")


def greedy(logits):
    return int(np.argmax(logits))


def dense_tokens(image, prompt, n):
    model, tok = load_image(image, mode="hybrid")  # every neuron, from the same image
    return generate(model, tok, prompt, n, greedy, set())


@pytest.mark.parametrize("every,margin", [(1, None), (4, None), (8, 2.0)])
def test_corrected_text_is_the_dense_paths(image, every, margin):
    model, tok = load_image(image, mode="predicted", correct_every=every, correct_margin=margin)
    prompt = tok.encode(PROMPT)
    assert len(prompt) > 30
    tokens = [r.token for r in stream_corrected(model, tok, prompt, 48, every, margin, set())]
    sparse, _ = load_image(image, mode="predicted")
    uncorrected = generate(sparse, tok, prompt, 48, greedy, set())
    want = dense_tokens(image, prompt, 48)
    assert tokens == want and uncorrected != want  # the predictor alone drifts; corrected, it does not
    c = model.correction
    assert c.emitted == 48 and c.accepted + c.rounds >= 48 and 0 < c.corrected <= c.rounds
    assert c.drafted <= every * c.rounds and (every > 1 or c.drafted == c.rounds)


def test_run_reports_the_correction_and_refuses_what_it_cannot_correct(image):
    done = lsparse("run", str(image), "--mode", "predicted", "--correct-every", "4", "-m", "24", "--json")
    result = json.loads(done.stdout)
    assert len(result["tokens"]) == 24 and result["correction"]["emitted"] == 24
    assert 0 < result["flash"]["bytes_read_per_token"]
    for extra in (["--mode", "exact"], ["--mode", "predicted", "--temp", "0.7"]):
        done = lsparse("run", str(image), *extra, "--correct-every", "2", "-m", "4")
        assert done.returncode != 0 and done.stderr.startswith("error:") and "Traceback" not in done.stderr
