"""Dense decode speed at the SmolLM2-135M geometry (random weights), lsparse's numpy and MLX paths beside
transformers, plus the matrix-vector products that decide the CPU path. Prints a Markdown table.

    python scripts/bench_dense.py [--tokens 64] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "vocab_size": 49152, "max_position_embeddings": 2048,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "hidden_act": "silu", "tie_word_embeddings": True,
                "bos_token_id": 1, "eos_token_id": 2}
PROMPT = list(range(100, 132))  # 32 prompt tokens


def write_checkpoint(folder: Path) -> None:
    from safetensors.numpy import save_file

    from lsparse.bench.random_weights import llama_tensors
    (folder / "config.json").write_text(json.dumps(SMOLLM2_135M))
    save_file(llama_tensors(SMOLLM2_135M), str(folder / "model.safetensors"))


def time_lsparse(folder: str, backend: str, tokens: int, repeats: int) -> dict:
    from lsparse.model import load_model
    from lsparse.runtime.generate import stream_generate
    from lsparse.source import resolve
    model = load_model(resolve(folder), backend)
    runs = []
    for _ in range(repeats + 1):  # the first run warms up
        runs.append(list(stream_generate(model, None, PROMPT, tokens, lambda lp: int(lp.argmax()), set()))[-1])
    runs = runs[1:]
    return {"prompt_tps": statistics.median(r.prompt_tps for r in runs),
            "generation_tps": statistics.median(r.generation_tps for r in runs),
            "peak_memory_bytes": max(r.peak_memory for r in runs)}


def time_transformers(folder: str, tokens: int, repeats: int) -> dict:
    import torch
    from transformers import LlamaForCausalLM

    from lsparse.runtime.generate import peak_rss_bytes
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPT])
    prompt, generation = [], []
    with torch.no_grad():
        for i in range(repeats + 1):
            start = time.perf_counter()
            model(ids)
            p = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            g = time.perf_counter() - start - p  # generate() includes the prompt pass
            if i:
                prompt.append(len(PROMPT) / p)
                generation.append(tokens / g)
    return {"prompt_tps": statistics.median(prompt), "generation_tps": statistics.median(generation),
            "peak_memory_bytes": peak_rss_bytes(), "torch_threads": torch.get_num_threads()}


def time_matvec(repeats: int = 200) -> dict:
    import mlx.core as mx
    import numpy as np
    out = {}
    for rows, cols in ((1536, 576), (11008, 4096)):
        w = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
        x = np.ones((1, cols), np.float32)
        wm, xm = mx.array(w), mx.array(x)
        mx.eval(wm, xm)
        for name, fn in (("numpy", lambda x=x, w=w: x @ w.T), ("mlx", lambda x=xm, w=wm: mx.eval(x @ w.T))):
            fn()
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            out[f"{name} {rows}x{cols}"] = (time.perf_counter() - start) / repeats * 1e3
    return out


def child(args) -> None:
    if args.one == "transformers":
        result = time_transformers(args.folder, args.tokens, args.repeats)
    elif args.one == "matvec":
        result = time_matvec()
    else:
        result = time_lsparse(args.folder, args.one, args.tokens, args.repeats)
    print(json.dumps(result))


def run_child(args, what: str, env: dict) -> dict:
    cmd = [sys.executable, __file__, "--one", what, "--folder", args.folder, "--tokens", str(args.tokens),
           "--repeats", str(args.repeats)]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one")
    parser.add_argument("--folder")
    args = parser.parse_args()
    if args.one:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        args.folder = tmp
        write_checkpoint(Path(tmp))
        rows = []
        for label, what, env in (
            ("lsparse, numpy (OpenBLAS, 1 thread)", "numpy", {"OPENBLAS_NUM_THREADS": "1"}),
            ("lsparse, numpy (OpenBLAS, 2 threads)", "numpy", {"OPENBLAS_NUM_THREADS": "2"}),
            ("lsparse, MLX (CPU backend)", "mlx", {}),
            ("transformers (torch fp32, eager)", "transformers", {}),
        ):
            rows.append((label, run_child(args, what, env)))
        matvec = {threads: run_child(args, "matvec", {"OPENBLAS_NUM_THREADS": threads}) for threads in ("1", "2")}
    print(f"Dense decode, SmolLM2-135M geometry (random fp32 weights), {len(PROMPT)}-token prompt, "
          f"{args.tokens} generated tokens, median of {args.repeats} runs; {platform.machine()}, "
          f"{os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}.\n")
    print("| implementation | prompt tok/s | decode tok/s | peak RSS (MB) |")
    print("|---|---|---|---|")
    for label, r in rows:
        print(f"| {label} | {r['prompt_tps']:.1f} | {r['generation_tps']:.1f} | {r['peak_memory_bytes'] / 1e6:.0f} |")
    print("\nfp32 matrix-vector product, ms per call (median of 200):\n")
    print("| shape (out x in) | numpy, 1 thread | numpy, 2 threads | MLX CPU |")
    print("|---|---|---|---|")
    for shape in ("1536x576", "11008x4096"):
        print(f"| {shape} | {matvec['1'][f'numpy {shape}']:.3f} | {matvec['2'][f'numpy {shape}']:.3f} | "
              f"{matvec['1'][f'mlx {shape}']:.3f} |")


if __name__ == "__main__":
    main()
