"""lsparse against llama.cpp's memory-mapped loading, both under the same hard memory caps (cgroup v1, root).

The model is synthetic:llama-7b-relu's geometry (Llama-2-7B's FFN: 32 layers of 4096 x 11008; one 64-wide
attention head; the built-in model's 512-piece SentencePiece vocabulary). lsparse runs the synthetic 4-bit
image (masks replayed from the built-in model; only the predicted neurons are read); llama.cpp runs a Q4_0
GGUF of the same geometry, written here with the `gguf` package, whose weights it maps and must page in
whole each token once the cap is below the file's size. Both decode the same number of tokens; each run is a
child under lsparse.bench.memcap, and its tokens per second and cgroup peak are reported.

llama.cpp computes a dense SiLU FFN: arithmetic differs, bytes do not, and the bytes are what a cap tests.

    python scripts/bench_llamacpp.py --llama-python /tmp/llamacpp-venv/bin/python --caps 0.5 0.25
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
TOKENIZER = REPO.parent / "shared" / "data" / "stories260K" / "tok512.model"


def write_gguf(path: Path, image: Path) -> None:
    """A Q4_0 GGUF with the synthetic image's geometry and random weights (one quantized matrix per shape,
    reused: the bytes only need paging in)."""
    import gguf
    import sentencepiece as spm
    from gguf.quants import quantize

    from lsparse.image.image import Image
    c = Image.open(image).manifest.config
    d, f, n, hd = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["head_dim"]
    rng = np.random.default_rng(0)
    q4 = gguf.GGMLQuantizationType.Q4_0

    def q(shape):
        return quantize((rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32), q4)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(2048)
    w.add_embedding_length(d)
    w.add_block_count(n)
    w.add_feed_forward_length(f)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    sp = spm.SentencePieceProcessor(model_file=str(TOKENIZER))
    w.add_tokenizer_model("llama")
    w.add_token_list([sp.id_to_piece(i).encode() for i in range(sp.vocab_size())])
    w.add_token_scores([sp.get_score(i) for i in range(sp.vocab_size())])
    types = [gguf.TokenType.CONTROL if sp.is_control(i) else gguf.TokenType.UNKNOWN if sp.is_unknown(i)
             else gguf.TokenType.BYTE if sp.is_byte(i) else gguf.TokenType.NORMAL for i in range(sp.vocab_size())]
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    vocab = sp.vocab_size()
    w.add_tensor("token_embd.weight", (rng.standard_normal((vocab, d)) * 0.02).astype(np.float32))
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output.weight", (rng.standard_normal((vocab, d)) * 0.02).astype(np.float32))
    gate, up, down = q((f, d)), q((f, d)), q((d, f))
    attn_q, attn_kv, attn_o = q((hd, d)), q((hd, d)), q((d, hd))
    for i in range(n):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(d, np.float32))
        for name, t in (("attn_q", attn_q), ("attn_k", attn_kv), ("attn_v", attn_kv), ("attn_output", attn_o),
                        ("ffn_gate", gate), ("ffn_up", up), ("ffn_down", down)):
            w.add_tensor(p + name + ".weight", t, raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


LLAMA_CHILD = """
import sys, time, json
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=64, n_threads=2, use_mmap=True, verbose=False)
tokens = int(sys.argv[2])
start = time.perf_counter()
out = llm("Once upon a time", max_tokens=tokens, temperature=0.0)
elapsed = time.perf_counter() - start
print(json.dumps({"tokens": out["usage"]["completion_tokens"], "seconds": elapsed}))
"""


def capped(cap: int | None, command: list[str]) -> tuple[dict | None, dict | None]:
    """(the command's JSON output or None, the cgroup report or None)."""
    full = [sys.executable, "-m", "lsparse.bench.memcap", str(cap), "--", *command] if cap else command
    done = subprocess.run(full, capture_output=True, text=True, timeout=3600)
    lines = done.stderr.strip().splitlines()
    report = json.loads(lines[-1]) if cap and lines and lines[-1].startswith("{") else None
    out = None
    if done.returncode == 0:
        out = json.loads(done.stdout.strip().splitlines()[-1])
    elif not report:
        print(done.stderr[-2000:], file=sys.stderr)
    return out, report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image", type=Path, default=REPO / "out" / "synthetic" / "llama-7b-relu" / "4bit-hot")
    p.add_argument("--gguf", type=Path, default=REPO / "out" / "synthetic" / "llama-7b-relu-q4_0.gguf")
    p.add_argument("--llama-python", default=sys.executable, help="a Python with llama-cpp-python installed")
    p.add_argument("--caps", type=float, nargs="+", default=[0.5, 0.25], help="shares of the GGUF's size")
    p.add_argument("--tokens", type=int, default=8)
    p.add_argument("--kernels", default="cpu", help="lsparse's FFN backend (lsparse run --kernels)")
    args = p.parse_args()
    if not args.gguf.exists():
        print(f"writing {args.gguf}", file=sys.stderr)
        write_gguf(args.gguf, args.image)
    size = args.gguf.stat().st_size
    rows = []
    for share in [None, *args.caps]:
        cap = int(share * size) if share else None
        out, report = capped(cap, [args.llama_python, "-c", LLAMA_CHILD, str(args.gguf), str(args.tokens)])
        rows.append({"engine": "llama.cpp (mmap)", "cap_share": share, "cap_bytes": cap,
                     "tokens_per_second": out["tokens"] / out["seconds"] if out else None, "cgroup": report})
        print(json.dumps(rows[-1]), flush=True)
        lsparse = [str(Path(sys.executable).with_name("lsparse")), "run", str(args.image), "--mode", "predicted",
                   "--kernels", args.kernels, "-m", str(args.tokens), "--json"]
        if cap:
            lsparse += ["--ram-budget", str(cap)]
        out, report = capped(cap, lsparse)
        rows.append({"engine": f"lsparse (predicted, {args.kernels} kernels)", "cap_share": share, "cap_bytes": cap,
                     "tokens_per_second": out["generation_tps"] if out else None,
                     "flash_bytes_per_token": out["flash"]["bytes_read_per_token"] if out else None,
                     "cgroup": report})
        print(json.dumps(rows[-1]), flush=True)
    print(json.dumps({"date": time.strftime("%Y-%m-%d"), "gguf_bytes": size, "tokens": args.tokens, "rows": rows}))


if __name__ == "__main__":
    main()
