"""Activation statistics against a direct, loop-by-loop computation, and `lsparse stats` end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lsparse.calibrate.activations import HOT_SHARES, WINDOWS, layer_stats, record_activations
from lsparse.model import load_model
from lsparse.source import resolve
from tests.conftest import lsparse, shared_file


def brute_force(active: np.ndarray, lengths: list[int]) -> dict:
    union, new, start = {k: [] for k in WINDOWS}, {k: [] for k in WINDOWS}, 0
    for n in lengths:
        a = active[start:start + n]
        start += n
        for k in WINDOWS:
            for t in range(k - 1, n):
                union[k].append(len(set().union(*(np.flatnonzero(a[j]) for j in range(t - k + 1, t + 1)))))
            for t in range(k, n):
                before = set().union(*(np.flatnonzero(a[j]) for j in range(t - k, t)))
                new[k].append(len(set(np.flatnonzero(a[t])) - before))
    counts = sorted(active.sum(0), reverse=True)
    d = active.shape[1]
    return {"union": {k: np.mean(v) / d for k, v in union.items()}, "new": {k: np.mean(v) / d for k, v in new.items()},
            "hot": {s: sum(counts[:max(1, round(s * d))]) / sum(counts) for s in HOT_SHARES}}


def test_layer_stats_match_a_direct_count():
    rng = np.random.default_rng(0)
    # skewed: some neurons fire far more often than others, as in real models
    active = rng.random((60, 200)) < np.linspace(0.01, 0.4, 200)[None, :]
    lengths = [25, 12, 23]
    got, want = layer_stats(active, lengths), brute_force(active, lengths)
    for k in WINDOWS:
        assert got["window_union_fraction"][k] == pytest.approx(want["union"][k])
        assert got["new_per_token_fraction"][k] == pytest.approx(want["new"][k])
    for s in HOT_SHARES:
        assert got["hot_coverage"][s] == pytest.approx(want["hot"][s])
    assert got["active_fraction"] == pytest.approx(active.mean())


def test_recorded_activations_are_what_the_ffn_uses():
    """Replaying the recorded activations through the down projections gives the plain forward's logits."""
    model = load_model(resolve(str(shared_file("stories260K/stories260K.bin"))), "numpy")
    tokens = [1, 403, 407, 261, 378, 432]
    acts = record_activations(model, [tokens])
    assert len(acts) == 5 and acts[0].shape == (6, 172)
    replay = [lambda args, w, x, xp, a=a: model.arch.ffn_down(args, w, a, xp) for a in acts]
    np.testing.assert_allclose(model(tokens, model.make_cache(8), replay), model(tokens, model.make_cache(8)),
                               atol=1e-5)


def test_stats_command_on_swiglu_stories260k(tmp_path):
    plot = tmp_path / "window.png"
    result = lsparse("stats", str(shared_file("stories260K/stories260K.bin")), "--text",
                     str(shared_file("tinystories/validation_100.txt")), "--tokens", "600", "--json",
                     "--plot", str(plot), "--levels", "0.3,0.6")
    assert result.returncode == 0, result.stderr
    stats = json.loads(result.stdout)
    assert stats["tokens"] == 600 and stats["exact_zero_fraction"] == 0.0  # SwiGLU: nothing is exactly zero
    overall = stats["overall"]
    assert overall["active_fraction"] == pytest.approx(0.5, abs=0.01)  # the 50% magnitude mask
    unions = [overall["window_union_fraction"][str(k)] for k in WINDOWS]
    assert all(a <= b for a, b in zip(unions, unions[1:], strict=False))  # a window never shrinks
    sweep = stats["threshold_sweep"]
    assert [round(s["zeroed_fraction"], 2) for s in sweep] == [0.3, 0.6]
    assert sweep[0]["perplexity"] < sweep[1]["perplexity"]  # zeroing more costs more
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
