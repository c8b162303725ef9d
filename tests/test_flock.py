"""Flocking (GRIFFIN, lsparse/runtime/flock.py): a sequence's flock chosen from its prompt by GRIFFIN's statistic,
read with the prompt's one stream of each layer, pinned; after it, the within and core rules read nothing and
exact mode stays lossless."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lsparse.image.compile import CompileOptions, compile_image
from lsparse.model import load_model
from lsparse.runtime.cache import NeuronCache
from lsparse.runtime.generate import generate
from lsparse.runtime.load import load_image, plan_image
from lsparse.runtime.options import DecodeOptions
from lsparse.source import resolve
from tests.conftest import lsparse

PROMPT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
          "friends. One day, she saw a big red ball")
OTHER = "Tom had a small boat. He took it to the lake every morning and sailed it with his sister Sue"


@pytest.fixture(scope="module")
def image(tmp_path_factory):
    out = tmp_path_factory.mktemp("flock") / "image"
    compile_image("builtin:tinystories-reglu", str(out), CompileOptions(bits=4, predictor="svd", calib_tokens=1024))
    return out


def greedy(logits):
    return int(np.argmax(logits))


def step_bytes(model) -> list[int]:
    return [s.bytes_read for s in model.costs.steps]


def test_the_flock_is_griffins_top_share_of_the_dense_models_prompt_activations(tmp_path):
    """Reference: the checkpoint's dense model in fp32, each FFN's coefficients recorded by the FATReLU rule written
    out here, GRIFFIN's statistic (rows scaled to unit length, each column's length) computed here."""
    fp16 = tmp_path / "fp16"
    compile_image("builtin:tinystories-reglu", str(fp16), CompileOptions(bits=16, predictor="exact", calib_tokens=1024))
    model, tok = load_image(fp16, mode="exact", flock=0.5)
    prompt = tok.encode(PROMPT)
    model(prompt, model.make_cache(len(prompt)))

    dense = load_model(resolve("builtin:tinystories-reglu"), backend="numpy")
    cut, recorded = dense.args.relu_threshold, []

    def recording(args, w, x, xp):
        gate, up = x @ np.asarray(w["gate"]).T, x @ np.asarray(w["up"]).T
        a = gate * (gate > cut) * up  # (t, d_ff)
        recorded.append(a)
        return a @ np.asarray(w["down"]).T
    dense(prompt, dense.make_cache(len(prompt)), [recording] * len(dense.layers))
    misses = 0
    for ffn, a in zip(model.ffns, recorded, strict=True):
        norms = np.linalg.norm(a, axis=1, keepdims=True)
        z = a[norms[:, 0] > 0] / norms[norms[:, 0] > 0]  # a token no neuron fires for adds nothing
        score = np.linalg.norm(z, axis=0)
        assert len(ffn.flock) == a.shape[1] // 2
        assert within_ties(score, ffn.flock)  # GRIFFIN's top half, up to fp16 weights' rounding at its edge
        unnormalized = np.argsort(-np.linalg.norm(a, axis=0))[: len(ffn.flock)]  # not GRIFFIN's statistic
        misses += not within_ties(score, unnormalized)
    assert misses >= 3  # the check tells the statistic from a near one


def within_ties(score: np.ndarray, chosen: np.ndarray) -> bool:
    """Whether `chosen` are the highest scores, up to 1% of the largest at the edge."""
    outside = np.ones(len(score), dtype=bool)
    outside[chosen] = False
    return bool(score[chosen].min() >= score[outside].max() - 0.01 * score.max())


def test_exact_mode_with_a_flock_is_lossless_and_a_whole_flock_reads_nothing_after_the_prompt(image):
    exact, tok = load_image(image, mode="exact")
    prompt = tok.encode(PROMPT)
    want = generate(exact, tok, prompt, 40, greedy, set())
    flocked, _ = load_image(image, mode="exact", flock=0.5)
    assert generate(flocked, tok, prompt, 40, greedy, set()) == want
    assert sum(step_bytes(flocked)[1:]) > 0  # neurons outside the flock are read when the gate needs them
    whole, _ = load_image(image, mode="exact", flock=1.0)
    assert generate(whole, tok, prompt, 40, greedy, set()) == want
    region = sum(layer.region.size for layer in whole.image.manifest.layers)
    assert step_bytes(whole)[0] >= region and sum(step_bytes(whole)[1:]) == 0


@pytest.mark.parametrize("rule", ["within", "core"])
def test_after_the_burst_the_flock_reads_nothing_even_at_the_smallest_budget(image, rule):
    options = DecodeOptions(mode="predicted", flock=0.5, flock_rule=rule)
    smallest = plan_image(load_image(image, options)[0].image, options)[1].smallest_budget
    model, tok = load_image(image, options.but(ram_budget=smallest))
    for text in (PROMPT, OTHER):  # a second sequence: a flock of its own, the first one's released
        model.costs.steps.clear()
        tokens = generate(model, tok, tok.encode(text), 24, greedy, set())
        steps = model.costs.steps
        assert len(tokens) == 24 and steps[0].bytes_read >= sum(r.size for r in
                                                                 (layer.region for layer in
                                                                  model.image.manifest.layers))
        assert all(s.bytes_read == 0 and s.requests == 0 and s.hits == s.lookups for s in steps[1:])
        for ffn in model.ffns:
            assert len(ffn.flock) == ffn.layer.d_ff // 2
            pinned = np.flatnonzero(ffn.cache.slot_of >= 0)
            cold_flock = ffn.flock[ffn.is_cold[ffn.flock]]
            assert set(cold_flock.tolist()) <= set(pinned.tolist())
    first = load_image(image, options)[0]
    generate(first, tok, tok.encode(PROMPT), 2, greedy, set())
    assert any(not np.array_equal(a.flock, b.flock) for a, b in zip(first.ffns, model.ffns, strict=True))


def test_within_keeps_the_predictors_mask_to_the_flock(image):
    model, tok = load_image(image, mode="predicted", flock=0.5, flock_rule="within")
    raw, used = [], []
    for ffn in model.ffns:
        predict, choose = ffn.predictor.predict, ffn._predict
        ffn.predictor.predict = lambda x, cached=None, f=predict: raw.append(f(x, cached)[0]) or (raw[-1], None)
        ffn._predict = lambda x, cost, f=choose, ffn=ffn: used.append((ffn, f(x, cost)[0])) or (used[-1][1], None)
    generate(model, tok, tok.encode(PROMPT), 8, greedy, set())
    assert len(raw) == len(used) == 7 * len(model.ffns)  # the prompt's call predicts nothing
    for mask, (ffn, active) in zip(raw, used, strict=True):
        np.testing.assert_array_equal(active, mask[ffn.in_flock[mask]])
    assert sum(len(m) for m in raw) > sum(len(a) for _, a in used)  # the predictor wanted neurons outside


def test_pinned_neurons_outlast_the_window_and_the_next_pin_releases_them():
    from lsparse.kernels.backends import select
    cache = NeuronCache(10, 4, 1, window=1, kernels=select("cpu", 64, 16, 0))

    def rows(n):
        return np.zeros((n, 1, 128), dtype=np.uint8)
    assert cache.pin(np.array([3, 7]), rows(2)) == 2
    for _ in range(3):
        missing = cache.lookup(np.array([1, 2]))
        cache.insert(missing, rows(len(missing)))
    assert cache.slot_of[3] >= 0 and cache.slot_of[7] >= 0  # three tokens later, with a window of 1
    # full: 3 stays pinned, 7 is released and makes room; 1 and 2 are this token's
    assert cache.pin(np.array([5, 6, 3]), rows(3)) == 2
    assert cache.slot_of[3] >= 0 and cache.slot_of[7] < 0 and (cache.slot_of[[5, 6]] >= 0).sum() == 1
    for needed in ([3, 8], [9]):  # a pinned neuron a token uses stays pinned
        cache.insert(cache.lookup(np.array(needed)), rows(1))
    assert cache.slot_of[3] >= 0 and cache.slot_of[1] < 0 and cache.slot_of[2] < 0


def test_run_takes_a_flock_and_refuses_what_it_cannot_flock(image):
    done = lsparse("run", str(image), "--mode", "predicted", "--flock", "0.5", "--flock-rule", "within", "-m", "12",
                   "--json")
    flash = json.loads(done.stdout)["flash"]
    assert flash["bytes_read_per_token"] == 0 and flash["prompt_bytes_read"] > 0
    for extra in (["--flock", "0"], ["--flock", "1.5"], ["--mode", "hybrid", "--flock", "0.5"],
                  ["--flock", "0.5", "--flock-rule", "core"], ["--flock-rule", "within"],
                  ["--flock", "0.5", "--flock-rule", "all"], ["--flock", "0.5", "--lookahead"]):
        done = lsparse("run", str(image), *extra, "-m", "4")
        assert done.returncode != 0 and done.stderr.startswith("error:") and "Traceback" not in done.stderr, extra
