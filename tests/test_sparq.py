"""SparQ attention (lsparse/model/sparq.py): a decoding step reads r key components to rank the keys, then k
whole keys and values; checked against the paper's algorithm written out here head by head."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lsparse.model.layers import attention
from lsparse.model.sparq import SparQ, SparQCache
from lsparse.runtime.generate import generate
from lsparse.runtime.load import load_image
from tests.conftest import lsparse


def reference_sparq(q, keys, values, r, k, scale):
    """Algorithm 1 of Ribar et al. (2023) for each query head, in loops: q (heads, d), keys and values
    (kv heads, s, d)."""
    n_heads, d = q.shape
    group = n_heads // keys.shape[0]
    out = np.zeros((n_heads, d))
    columns, rows = [set() for _ in keys], [set() for _ in keys]  # per key-value head: what its heads read
    for h in range(n_heads):
        K, V, qh = keys[h // group].astype(np.float64), values[h // group].astype(np.float64), q[h].astype(np.float64)
        i1 = np.argsort(-np.abs(qh))[:r]
        temperature = np.sqrt(d * np.abs(qh[i1]).sum() / np.abs(qh).sum())
        s_hat = np.exp(K[:, i1] @ qh[i1] / temperature)
        s_hat /= s_hat.sum()
        i2 = np.argsort(-s_hat)[:k]
        alpha = s_hat[i2].sum()
        s = np.exp(K[i2] @ qh * scale)
        s /= s.sum()
        out[h] = alpha * (s @ V[i2]) + (1 - alpha) * V.mean(0)
        columns[h // group] |= set(i1.tolist())
        rows[h // group] |= set(i2.tolist())
    read = sum(len(c) * keys.shape[1] + 2 * len(r) * d for c, r in zip(columns, rows, strict=True)) * 4
    return out.reshape(1, -1), read


def filled(cache, keys, values):
    cache.update(keys, values)
    return cache


@pytest.mark.parametrize("r,k", [(4, 8), (16, 40), (64, 200)])
def test_a_step_is_the_papers_algorithm(r, k):
    rng = np.random.default_rng(r)
    n_heads, n_kv, s, d = 8, 2, 300, 64
    keys, values = rng.standard_normal((n_kv, s - 1, d)), rng.standard_normal((n_kv, s - 1, d))
    q, k_new, v_new = rng.standard_normal((n_heads, 1, d)), rng.standard_normal((n_kv, 1, d)), \
        rng.standard_normal((n_kv, 1, d))
    cache = filled(SparQCache(np, n_kv, s, d, SparQ(rank=r, top_k=k)), keys.astype(np.float32),
                   values.astype(np.float32))
    out = attention(q.astype(np.float32), k_new.astype(np.float32), v_new.astype(np.float32), cache,
                    np.array([s - 1]), d ** -0.5, np)
    all_keys = np.concatenate([keys, k_new], axis=1)
    all_values = np.concatenate([values, v_new], axis=1)
    want, read = reference_sparq(q[:, 0], all_keys, all_values, r, k, d ** -0.5)
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-5)
    assert cache.bytes_read == read and cache.bytes_full == n_kv * 2 * s * d * 4
    assert read < cache.bytes_full or r == d  # every column of every key costs more than full attention


def test_every_key_chosen_is_full_attention_and_the_mean_stands_in_for_those_left_out():
    rng = np.random.default_rng(0)
    n_heads, n_kv, s, d = 4, 2, 50, 16
    keys, values = rng.standard_normal((2, n_kv, s, d)).astype(np.float32)
    q = rng.standard_normal((n_heads, 1, d)).astype(np.float32)
    scores = np.einsum("hd,hsd->hs", q[:, 0], np.repeat(keys, 2, axis=0)) * d ** -0.5
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    full = np.einsum("hs,hsd->hd", probs, np.repeat(values, 2, axis=0)).reshape(1, -1)
    every = filled(SparQCache(np, n_kv, s, d, SparQ(rank=3, top_k=s)), keys, values)
    np.testing.assert_allclose(every.attend(q, d ** -0.5), full, rtol=1e-4, atol=1e-6)
    most = filled(SparQCache(np, n_kv, s, d, SparQ(rank=d, top_k=s - 10)), keys, values)
    near = most.attend(q, d ** -0.5)
    assert 0 < np.abs(near - full).max() < 0.1  # ten keys' weight given to the mean: close, not equal


def test_decoding_with_sparq_reads_less_attention_and_keeps_the_text_while_k_covers_the_context(tmp_path):
    from lsparse.image.compile import CompileOptions, compile_image
    image = tmp_path / "image"
    compile_image("builtin:tinystories-reglu", str(image), CompileOptions(predictor="svd", calib_tokens=1024))
    plain, tok = load_image(image, mode="exact")
    prompt = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside")
    want = generate(plain, tok, prompt, 40, lambda p: int(np.argmax(p)), set())
    covered, _ = load_image(image, mode="exact", kv_top_k=len(prompt) + 40)
    assert generate(covered, tok, prompt, 40, lambda p: int(np.argmax(p)), set()) == want
    assert all(s.attention_bytes == 0 for s in covered.costs.steps)  # k covers every step: full attention
    sparse, _ = load_image(image, mode="exact", kv_top_k=8, kv_rank=2)
    generate(sparse, tok, prompt, 40, lambda p: int(np.argmax(p)), set())
    steps = sparse.costs.steps[1:]
    assert all(0 < s.attention_bytes < s.attention_full_bytes for s in steps)


def test_run_reports_attention_bytes_and_refuses_bad_knobs(tmp_path):
    from lsparse.image.compile import CompileOptions, compile_image
    image = tmp_path / "image"
    compile_image("builtin:tinystories-reglu", str(image), CompileOptions(predictor="svd", calib_tokens=1024))
    done = lsparse("run", str(image), "--kv-top-k", "8", "--kv-rank", "2", "-m", "24", "--json")
    flash = json.loads(done.stdout)["flash"]
    assert 0 < flash["attention_bytes_per_token"] < flash["attention_full_bytes_per_token"]
    for bad in (["--kv-top-k", "0"], ["--kv-rank", "2"], ["--kv-top-k", "8", "--kv-rank", "0"]):
        done = lsparse("run", str(image), *bad, "-m", "4")
        assert done.returncode != 0 and done.stderr.startswith("error:") and "Traceback" not in done.stderr, bad
