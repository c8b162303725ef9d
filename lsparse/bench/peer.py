"""llama.cpp, the peer a user would otherwise run: a Q4_0 GGUF of a synthetic image's geometry, and the child
program that decodes it through llama-cpp-python (which need not be installed in lsparse's environment: any
Python that has it will do)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

PROMPT = "w300 w301 w302 w303 w304 w305 w306 w307"  # the same 8 tokens in both vocabularies (and BOS)
LLAMA_CHILD = rf"""
import json, sys, time
PROMPT = "{PROMPT}"
import llama_cpp
path, tokens, mmap_only = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "mmap"
def read_bytes():
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0
if mmap_only:  # weights stay in the mmap: no repacked copy in anonymous memory (the Llama class takes no option)
    import llama_cpp.llama_cpp as low
    defaults = low.llama_model_default_params
    def params():
        p = defaults()
        p.use_extra_bufts = False
        return p
    low.llama_model_default_params = params
llm = llama_cpp.Llama(model_path=path, n_ctx=256, n_threads=2, use_mmap=True, verbose=False)
before, times = read_bytes(), []
prompt = [llm.token_bos()] + [int(w[1:]) for w in PROMPT.split()]  # token ids: no text to buffer
for token in llm.generate(prompt, temp=0.0):  # one id at a time, past EOS too: a count of tokens is timed
    times.append(time.perf_counter())
    if len(times) == tokens:
        break
n = len(times)
print(json.dumps({{"tokens": n, "tokens_per_second": (n - 1) / (times[-1] - times[0]) if n > 1 else None,
                  "bytes_read_per_token": (read_bytes() - before) / max(n, 1)}}))
"""


def llama_cpp_params_supported(python: str) -> bool:
    """Whether this Python's llama-cpp-python can keep weights in the mmap (use_extra_bufts in its params)."""
    import subprocess
    done = subprocess.run([python, "-c", "import llama_cpp; print(any(name == 'use_extra_bufts' for name, _ in "
                           "llama_cpp.llama_model_params._fields_))"], capture_output=True, text=True)
    return done.returncode == 0 and done.stdout.strip() == "True"


def write_gguf(path: Path, config: dict, progress=None) -> None:
    """A Q4_0 GGUF of this Llama geometry with random weights (one quantized matrix per shape, reused: the
    bytes only need paging in), a word-level vocabulary like the synthetic image's ("w3", "w4", ...)."""
    import gguf
    from gguf.quants import quantize
    d, f, n, hd = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"], config["head_dim"]
    heads, kv, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    rng = np.random.default_rng(0)
    q4 = gguf.GGMLQuantizationType.Q4_0

    def q(shape):
        return quantize((rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32), q4)

    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_context_length, config["max_position_embeddings"]), (w.add_embedding_length, d),
                       (w.add_block_count, n), (w.add_feed_forward_length, f), (w.add_head_count, heads),
                       (w.add_head_count_kv, kv), (w.add_key_length, hd), (w.add_value_length, hd),
                       (w.add_rope_dimension_count, hd), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_file_type, gguf.LlamaFileType.MOSTLY_Q4_0), (w.add_tokenizer_model, "llama"),
                       (w.add_bos_token_id, 1), (w.add_eos_token_id, 2)):
        add(value)
    # Llama's layout: unknown, BOS, EOS, the 256 byte tokens SentencePiece falls back to, then words ("w300" is
    # token 300 here and in the synthetic image's word-level tokenizer)
    words = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + \
        [f"\u2581w{i}" for i in range(259, vocab)]
    w.add_token_list([t.encode() for t in words])
    w.add_token_scores([0.0] * vocab)
    w.add_token_types([gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
                      + [gguf.TokenType.BYTE] * 256 + [gguf.TokenType.NORMAL] * (vocab - 259))
    embed, out = q((vocab, d)), q((vocab, d))
    w.add_tensor("token_embd.weight", embed, raw_dtype=q4)
    w.add_tensor("output_norm.weight", np.ones(d, np.float32))
    w.add_tensor("output.weight", out, raw_dtype=q4)
    shapes = {"attn_q": (heads * hd, d), "attn_k": (kv * hd, d), "attn_v": (kv * hd, d),
              "attn_output": (d, heads * hd), "ffn_gate": (f, d), "ffn_up": (f, d), "ffn_down": (d, f)}
    tensors = {name: q(shape) for name, shape in shapes.items()}
    for i in range(n):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(d, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(d, np.float32))
        for name, t in tensors.items():
            w.add_tensor(f"blk.{i}.{name}.weight", t, raw_dtype=q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
