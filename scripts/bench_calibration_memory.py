"""Peak memory of `lsparse compile` against the number of layers, at a real layer geometry.

Calibration holds one layer's weights and the calibration buffers, never the whole model, so its peak should
not grow with depth. This writes random ReLU Llama checkpoints (fp16, one shard per layer, written a layer
at a time) with the same layer shape and different depths, compiles each in a child process, and reports the
child's peak resident memory (VmHWM) beside the size of one layer and of the whole checkpoint.

    python scripts/bench_calibration_memory.py --d-model 4096 --d-ff 11008 --layers 2 6 --calib-tokens 1024
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO.parent / "shared" / "data" / "stories260K" / "tok512.model"
CALIBRATION = REPO / "lsparse" / "calibrate" / "data" / "stories.txt"


def write_checkpoint(folder: Path, d: int, f: int, layers: int, heads: int) -> int:
    folder.mkdir(parents=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
              "intermediate_size": f, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": heads, "vocab_size": 512, "max_position_embeddings": 2048,
              "rms_norm_eps": 1e-5, "hidden_act": "relu", "tie_word_embeddings": True,
              "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(config))
    rng = np.random.default_rng(0)
    weight_map, total = {}, 0

    def shard(name: str, tensors: dict):
        nonlocal total
        save_file(tensors, str(folder / name))
        weight_map.update({k: name for k in tensors})
        total += sum(t.nbytes for t in tensors.values())

    shard("globals.safetensors", {"model.embed_tokens.weight": rng.standard_normal((512, d), np.float32)
                                  .astype(np.float16), "model.norm.weight": np.ones(d, np.float16)})
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (d, d), "self_attn.k_proj": (d, d), "self_attn.v_proj": (d, d),
                  "self_attn.o_proj": (d, d), "mlp.gate_proj": (f, d), "mlp.up_proj": (f, d), "mlp.down_proj": (d, f)}
        tensors = {p + k + ".weight": (rng.standard_normal(s, np.float32) / np.sqrt(s[1])).astype(np.float16)
                   for k, s in shapes.items()}
        tensors[p + "input_layernorm.weight"] = np.ones(d, np.float16)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(d, np.float16)
        shard(f"layer-{i:03d}.safetensors", tensors)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(TOKENIZER, folder / "tokenizer.model")
    return total


CHILD = """
import json, sys, time
from lsparse.image.compile import CompileOptions, compile_image
from lsparse.runtime.generate import peak_rss_bytes
src, out, tokens, bits = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
start = time.perf_counter()
compile_image(src, out, CompileOptions(calib=sys.argv[5], calib_tokens=tokens, window=512, bits=bits,
                                       predictor="exact", force=True))
print(json.dumps({"peak_rss_bytes": peak_rss_bytes(), "seconds": time.perf_counter() - start}))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=4096)
    p.add_argument("--d-ff", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--layers", type=int, nargs="+", default=[2, 6])
    p.add_argument("--calib-tokens", type=int, default=1024)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one)")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="lsparse-calmem-"))
    d, f = args.d_model, args.d_ff
    layer_bytes_fp32 = (4 * d * d + 3 * d * f) * 4
    results = []
    try:
        for n in args.layers:
            folder = work / f"ckpt-{n}"
            size = write_checkpoint(folder, d, f, n, args.heads)
            done = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(work / f"image-{n}"),
                                   str(args.calib_tokens), str(args.bits), str(CALIBRATION)],
                                  capture_output=True, text=True, cwd=REPO)
            if done.returncode != 0:
                raise SystemExit(done.stderr.strip().splitlines()[-1])
            child = json.loads(done.stdout.strip().splitlines()[-1])
            results.append({"layers": n, "checkpoint_bytes_fp16": size, "layer_bytes_fp32": layer_bytes_fp32,
                            **child, "peak_in_layers_fp32": child["peak_rss_bytes"] / layer_bytes_fp32})
            print(json.dumps(results[-1]), flush=True)
            shutil.rmtree(folder)
            shutil.rmtree(work / f"image-{n}")
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"d_model": d, "d_ff": f, "calib_tokens": args.calib_tokens, "bits": args.bits,
                      "date": time.strftime("%Y-%m-%d"), "runs": results}))


if __name__ == "__main__":
    main()
