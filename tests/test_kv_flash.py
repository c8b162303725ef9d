"""The KV cache paged to flash (lsparse/runtime/kv_flash.py): the same attention as SparQ's cache in RAM and as
full attention over every key, RAM held to 2R tokens, the bytes it counts being the bytes the kernel read."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lsparse.model.layers import KVCache, attention
from lsparse.model.sparq import SparQ, SparQCache
from lsparse.runtime.kv_flash import KVSpill
from tests.conftest import lsparse

N_HEADS, N_KV, D, CONTEXT = 6, 2, 32, 200


def steps(rng, t: int):
    """q (heads, t, d), k and v (kv heads, t, d)."""
    return (rng.standard_normal((N_HEADS, t, D)).astype(np.float32),
            *(rng.standard_normal((N_KV, t, D)).astype(np.float32) for _ in range(2)))


def decode(caches, rng, prompt: int, tokens: int) -> list[list[np.ndarray]]:
    """Each cache's attention outputs for a prompt of `prompt` tokens, then `tokens` one at a time, then a
    second prompt of 5 (a chat turn), the same queries, keys and values for all."""
    outs = [[] for _ in caches]
    calls = [np.arange(prompt)] + [np.array([t]) for t in range(prompt, prompt + tokens)] + \
        [np.arange(prompt + tokens, prompt + tokens + 5)]
    for positions in calls:
        q, k, v = steps(rng, len(positions))
        for out, cache in zip(outs, caches, strict=True):
            out.append(attention(q, k, v, cache, positions, D ** -0.5, np))
    return outs


def test_paged_attention_is_sparq_in_ram_and_full_attention_where_k_covers(tmp_path):
    sparq = SparQ(rank=8, top_k=24)
    spill = KVSpill(tmp_path, 16, sparq)
    paged = spill.make_cache(np, 1, N_KV, CONTEXT, D)[0]
    in_ram = SparQCache(np, N_KV, CONTEXT, D, sparq)
    paged_out, ram_out = decode([paged, in_ram], np.random.default_rng(0), 40, 110)
    assert paged.paged == 128 and paged.keys.shape[1] == 32  # 16 to 32 tokens held, the rest in pages
    assert paged.flash_bytes > 0 and spill.written == 8 * paged.page_bytes
    for a, b in zip(paged_out, ram_out, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # k covering the context: every step is full attention over every key, paged or not
    covering = KVSpill(tmp_path, 16, SparQ(rank=8, top_k=CONTEXT)).make_cache(np, 1, N_KV, CONTEXT, D)[0]
    full_out, plain_out = decode([covering, KVCache(np, N_KV, CONTEXT, D)], np.random.default_rng(1), 40, 110)
    for a, b in zip(full_out, plain_out, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    assert not list(tmp_path.iterdir())  # the spill file was unlinked when made


def test_counted_bytes_are_the_kernels_reads(tmp_path):
    io = "/proc/self/io"
    spill = KVSpill(tmp_path, 64, SparQ(rank=8, top_k=16))
    if not spill.reader.direct or not __import__("os").path.exists(io):
        pytest.skip("needs direct I/O and /proc/self/io (Linux) to see the storage reads")

    def read_bytes() -> int:
        return int(dict(line.split(": ") for line in open(io).read().splitlines())["read_bytes"])
    cache = spill.make_cache(np, 1, N_KV, 1024, D)[0]
    rng = np.random.default_rng(2)
    q, k, v = steps(rng, 600)
    attention(q, k, v, cache, np.arange(600), D ** -0.5, np)
    before, counted = read_bytes(), cache.flash_bytes
    for t in range(600, 640):
        attention(*steps(rng, 1), cache, np.array([t]), D ** -0.5, np)
    read, counted = read_bytes() - before, cache.flash_bytes - counted
    assert counted > 0 and counted <= read <= counted + 64 * 1024, (counted, read)


def test_run_pages_the_kv_cache_with_the_same_text(tmp_path):
    from lsparse.image.compile import CompileOptions, compile_image
    image = tmp_path / "image"
    compile_image("builtin:tinystories-reglu", str(image), CompileOptions(predictor="svd", calib_tokens=1024))
    files = sorted(image.rglob("*"))
    runs = [json.loads(lsparse("run", str(image), "--kv-top-k", "8", *more, "-m", "48", "--json").stdout)
            for more in ([], ["--kv-ram-tokens", "8"])]
    assert runs[0]["text"] == runs[1]["text"]
    assert runs[0]["flash"]["kv_flash_bytes_per_token"] == 0 < runs[1]["flash"]["kv_flash_bytes_per_token"]
    assert sorted(image.rglob("*")) == files  # nothing left behind
    for bad in (["--kv-ram-tokens", "8"], ["--kv-top-k", "8", "--kv-ram-tokens", "0"]):
        done = lsparse("run", str(image), *bad, "-m", "4")
        assert done.returncode != 0 and done.stderr.startswith("error:") and done.stderr.count("\n") == 1, bad
