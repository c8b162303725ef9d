"""The sparse FFN step with its rows coming from memory, not from the CPU's caches: rows of enough layers that
no cache holds them, the step run on each layer in turn, as decoding runs it, beside the machine's streaming
read bandwidth (the bar: bytes touched per second against it) and, where a Python with llama-cpp-python is
given, llama.cpp's dense step at the same shape (a one-layer FFN-only Q4_0 GGUF, per token)."""

from __future__ import annotations

import ctypes
import time

import numpy as np

LAYERS = 24  # 24 layers of 4-bit 4096 x 11008 rows: 1.8 GB, far beyond any cache


def stream_bandwidth(gigabytes: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second reading a large array once, on the C kernels' threads (the best of `repeats`)."""
    from lsparse.kernels import native
    lib = native.library()
    words = np.ones(int(gigabytes * 2**30) // 8, dtype=np.uint64)
    fn = lib.lsparse_stream_sum
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int], ctypes.c_uint64
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(words.ctypes.data, len(words), native.THREADS)
        best = min(best, time.perf_counter() - start)
    return words.nbytes / best


def step_from_memory(d: int, f: int, share: float, bits: int = 4, seconds: float = 2.0, seed: int = 0) -> dict:
    """One layer's sparse FFN step (gate and up over the active rows, ReLU, down) through the cpu backend, each
    call on the next of LAYERS layers' stores: ms per step and the bytes it touches per second."""
    from lsparse.image.quantize import quantize_rows, row_bytes
    from lsparse.kernels.backends import CpuKernels
    rng = np.random.default_rng(seed)
    kernels = CpuKernels(d, bits, 64)
    pattern = quantize_rows(rng.standard_normal((512, d)).astype(np.float32), bits, 64)
    layers = [[np.ascontiguousarray(np.resize(pattern, (f, pattern.shape[1]))) for _ in range(3)]
              for _ in range(LAYERS)]
    slots = [np.sort(rng.choice(f, max(1, round(share * f)), replace=False)) for _ in range(LAYERS)]
    x = rng.standard_normal((1, d)).astype(np.float32)

    def step(gate, up, down, s):
        a = np.maximum(kernels.mv(gate, s, x), 0) * kernels.mv(up, s, x)
        return kernels.vm(down, s, a)

    for (gate, up, down), s in zip(layers, slots, strict=True):
        step(gate, up, down, s)
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for (gate, up, down), s in zip(layers, slots, strict=True):
            step(gate, up, down, s)
            calls += 1
    per = (time.perf_counter() - start) / calls
    touched = 3 * len(slots[0]) * row_bytes(d, bits, 64)
    return {"d_model": d, "d_ff": f, "active_share": share, "step_ms": 1e3 * per, "bytes_touched": touched,
            "gbps": touched / per / 1e9}


def llama_cpp_ffn_step(python: str, d: int, f: int, folder, tokens: int = 64) -> dict:
    """llama.cpp's decode of a one-layer FFN-only Q4_0 GGUF of this shape (one 64-wide attention head, a
    512-token vocabulary: the rest costs next to nothing): ms per token, its FFN step and little else."""
    import json
    import subprocess
    from pathlib import Path

    from lsparse.bench.peer import LLAMA_CHILD, write_gguf
    from lsparse.bench.synthetic_parts import llama_config
    path = Path(folder) / f"ffn-{d}x{f}-q4_0.gguf"
    if not path.exists():
        write_gguf(path, llama_config(d, f, 1, 1, 1, 64, 512, tied=True))
    done = subprocess.run([python, "-c", LLAMA_CHILD, str(path), str(tokens), "defaults"], capture_output=True,
                          text=True)
    if done.returncode != 0:  # its default may use a buffer type this machine lacks: weights left in the mmap
        done = subprocess.run([python, "-c", LLAMA_CHILD, str(path), str(tokens), "mmap"], capture_output=True,
                              text=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    return {"step_ms": 1e3 / out["tokens_per_second"], "settings": "defaults" if "defaults" in done.args else
            "mmap, no repacking"}


def memory_section(llama_python: str | None, folder, shares=(0.1, 0.2), progress=None) -> dict:
    """At 7B geometry: the machine's streaming bandwidth, the sparse step from memory at these shares, and
    llama.cpp's dense step where a Python with llama-cpp-python is given; the goals' ratios."""
    from lsparse.bench.peer import llama_cpp_params_supported
    if progress:
        progress("streaming bandwidth")
    bandwidth = stream_bandwidth()
    rows = []
    for share in shares:
        if progress:
            progress(f"7B step from memory at {share:.0%}")
        rows.append({**step_from_memory(4096, 11008, share), "of_bandwidth": None})
        rows[-1]["of_bandwidth"] = rows[-1]["gbps"] * 1e9 / bandwidth
    peer = None
    if llama_python and llama_cpp_params_supported(llama_python):
        if progress:
            progress("llama.cpp's dense step (a one-layer FFN-only GGUF)")
        peer = llama_cpp_ffn_step(llama_python, 4096, 11008, folder)
        for r in rows:
            r["vs_llama_cpp_dense"] = peer["step_ms"] / r["step_ms"]
    return {"stream_gbps": bandwidth / 1e9, "rows": rows, "llama_cpp": peer}
