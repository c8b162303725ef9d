"""Synthetic images: the built-in model's recorded masks replayed onto larger layers, run through the ladder."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lsparse.bench.synthetic import write_synthetic
from lsparse.bench.trace_record import record
from lsparse.errors import LsparseError
from lsparse.image.image import Image
from lsparse.image.trace import TRACE, Trace
from lsparse.runtime.load import load_image
from tests.conftest import lsparse


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic") / "tiny"
    write_synthetic("tiny-relu", out, bits=4)
    return out


def test_replayed_masks_keep_each_traced_layers_statistics(synthetic, tmp_path):
    recording = record(False, tmp_path)
    masks = recording.replay  # the held-out tokens: the layout part is not replayed
    assert len(recording.layout) > 3 * len(masks) > 0
    trace = Trace(synthetic / TRACE)
    for layer in Image.open(synthetic).manifest.layers:
        replayed = trace.all_masks(layer.index, len(masks))
        traced = masks[:, layer.index % masks.shape[1]]
        # every tile replays the whole trace once, permuted: the same share of neurons fire, token for token
        assert replayed.mean() == pytest.approx(traced.mean(), abs=1e-12)
        assert layer.active_fraction == pytest.approx(traced.mean())


def test_synthetic_image_verifies_and_runs_only_where_it_means_something(synthetic):
    assert Image.open(synthetic).verify() == []
    model, _ = load_image(synthetic, mode="predicted")
    cache = model.make_cache(8)
    for t in range(8):
        model([t + 3], cache)
    assert sum(s.bytes_read for s in model.costs.steps) > 0
    for mode in ("exact", "dense"):
        with pytest.raises(LsparseError, match="synthetic"):
            load_image(synthetic, mode=mode)


def test_synthetic_ladder_reads_less_at_each_rung(synthetic, tmp_path):
    done = lsparse("bench", str(synthetic), "--variants", str(tmp_path / "variants"), "--prompts", "1",
                   "--prompt-tokens", "8", "--gen-tokens", "24", "--budgets", "", "--json", timeout=600)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    rows = {r["rung"]: r for r in result["rows"]}
    assert list(rows) == ["hybrid", "+predictor", "+window", "+bundles+layout", "+hot", "+4-bit", "+packed cache"]
    assert result["texts"] == [] and all(r["perplexity"] == {} for r in result["rows"])
    assert rows["+window"]["bytes_per_token"] <= rows["+predictor"]["bytes_per_token"]
    assert rows["+bundles+layout"]["reads_per_token"] < rows["+window"]["reads_per_token"]
    assert rows["+4-bit"]["bytes_needed_per_token"] < rows["+hot"]["bytes_needed_per_token"]
    assert rows["+4-bit"]["bytes_per_token"] < rows["hybrid"]["bytes_per_token"]


def test_the_budget_plans_each_layers_cache_as_its_store_keeps_rows(synthetic, monkeypatch):
    """The CPU path keeps a large store's rows 4-bit and decodes a small one's to fp32, so layers of one image
    differ; the plan must count each layer's cache as the runtime allocates it, at any budget it admits."""
    from lsparse.kernels import backends
    d_model = Image.open(synthetic).manifest.bundle.d_model
    model, _ = load_image(synthetic, mode="predicted", window=1)  # caches of a token's worth: sizes differ by layer
    sizes = sorted(len(f.cache.neuron_of) for f in model.ffns)
    if backends.load_native() is None or sizes[0] == sizes[-1]:
        pytest.skip("needs the C kernels and layers of different cache sizes")
    # between the smallest and the largest store: some layers keep rows as stored, some decode them
    monkeypatch.setattr(backends, "STORED_MIN_WEIGHTS", sizes[-1] * d_model)
    for budget in (None, "smallest"):
        if budget == "smallest":
            budget = model.memory_plan.smallest_budget
        model, _ = load_image(synthetic, mode="predicted", window=1, ram_budget=budget)
        stores = [store for f in model.ffns for store in f.cache.rows]
        assert {s.dtype for s in stores} == {np.dtype(np.uint8), np.dtype(np.float32)}
        assert sum(s.nbytes for s in stores) == model.memory_plan.neuron_cache
        assert budget is None or model.memory_plan.total <= budget


@pytest.mark.slow  # 33 s here: three layers written and decoded
def test_a_whole_geometry_costs_what_it_costs_and_its_predictor_errs(tmp_path):
    """tiny-2-7b: attention and embeddings as 4-bit rows multiplied by the kernels, a vocabulary of its own,
    a predictor of the real shape computed each token, and the trained predictor's masks replayed: its false
    positives are read and its misses counted (the oracle image reads fewer bytes and misses nothing)."""
    out = tmp_path / "full"
    manifest = write_synthetic("tiny-2-7b", out, bits=4, layers=3)
    assert manifest.resident_bits == 4 and len(manifest.layers) == 3 and manifest.config["vocab_size"] == 1000
    assert all(layer.predictor_rank for layer in manifest.layers)
    model, tok = load_image(out, mode="predicted")
    assert type(model.model.layers[0]["q"]).__name__ == "StoredMatrix"
    cache = model.make_cache(40)
    for t in range(40):
        model([int(t * 37 % 1000)], cache)
    steps = model.costs.steps
    assert sum(s.missed for s in steps) > 0 and sum(s.bytes_read for s in steps) > 0
    recall = manifest.layers[0].figures["predictor"]["recall"]
    assert 0.8 < recall < 1.0
    done = lsparse("run", str(out), "--mode", "predicted", "-m", "4", "--json", "--ignore-chat-template")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["flash"]["missed_per_token"] > 0
    # the lookahead guesses each layer's neurons from the previous layer's input, as recorded on the traced model
    ahead, _ = load_image(out, mode="predicted", lookahead=True, window=1)
    cache = ahead.make_cache(20)
    for t in range(20):
        ahead([int(t * 37 % 1000)], cache)
    used = sum(s.lookahead_used for s in ahead.costs.steps)
    wasted = sum(s.lookahead_wasted for s in ahead.costs.steps)
    assert used > 0 and wasted > 0  # a guess from another layer's input: right often, not always


@pytest.mark.slow  # writes a 0.4 GB image: about 40 s
def test_a_budget_below_the_resident_weights_maps_attention_and_decodes_the_same(tmp_path):
    """Two layers at Llama-2-7B's widths: a budget that cannot hold every matrix leaves the later layers'
    attention, the embeddings and the head in the image file (mapped, paged by the OS); the logits are those of
    the run that holds them all, and a budget below the mapped plan's smallest is refused."""
    out = tmp_path / "two"
    write_synthetic("llama-2-7b", out, bits=4, layers=2)
    held, _ = load_image(out, mode="predicted")
    smallest, q_bytes = held.memory_plan.smallest_budget, held.model.layers[0]["q"].store.nbytes
    assert held.memory_plan.mapped == 0 and smallest < held.memory_plan.total
    mapped, _ = load_image(out, mode="predicted", ram_budget=smallest + 6 * q_bytes)  # one layer's attention
    plan = mapped.memory_plan
    assert plan.held_attention_layers == 1 and plan.head_mapped and plan.mapped > 0
    assert plan.total <= smallest + 6 * q_bytes
    layers, g = mapped.model.layers, mapped.model.globals
    assert layers[0]["q"].mapping is None and layers[1]["q"].mapping is not None and g["lm_head"].mapping is not None
    # each token: layer 1's attention starts the head's reads, the head layer 1's four (the next token's)
    assert layers[1]["q"].read_ahead == [g["lm_head"].mapping] and len(g["lm_head"].read_ahead) == 4
    caches = held.make_cache(12), mapped.make_cache(12)
    for t in range(12):
        token = [int(t * 37 % 32000)]
        assert np.array_equal(held(token, caches[0]), mapped(token, caches[1]))
    with pytest.raises(LsparseError, match="the smallest that works is"):
        load_image(out, mode="predicted", ram_budget=smallest - 2**20)
    held.close(), mapped.close()
