"""The pieces of a synthetic image that are not its FFN: configs of real geometries, random weight matrices
(small ones in fp16, large ones as 4-bit rows), a tokenizer of the geometry's vocabulary, and the simulated
predictor's tensors."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PATTERN_ROWS = 512  # distinct random rows, repeated through a large matrix: its bytes are what matters


@dataclass(frozen=True)
class Geometry:
    config: dict          # the model's config.json, as the image carries it
    resident_bits: int    # 16: attention and embeddings fp16 (negligible ones); 4: as rows, as a real 7B keeps them
    simulated_predictor: bool  # a predictor of the real shape runs each token; the trained one's masks replay
    note: str


def llama_config(d: int, d_ff: int, layers: int, heads: int, kv_heads: int, head_dim: int, vocab: int,
                 tied: bool) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
            "intermediate_size": d_ff, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": head_dim, "vocab_size": vocab,
            "max_position_embeddings": 4096, "hidden_act": "relu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2}


def matrix(out: int, width: int, bits: int, rng) -> np.ndarray:
    """A random (out, width) weight matrix of about 1/sqrt(width) per weight: fp16, or 4/8-bit rows (out, row
    bytes) repeating PATTERN_ROWS distinct random rows."""
    if bits == 16:
        return (rng.standard_normal((out, width)) / np.sqrt(width)).astype(np.float16)
    from lsparse.image.quantize import quantize_rows
    pattern = quantize_rows((rng.standard_normal((min(out, PATTERN_ROWS), width)) / np.sqrt(width))
                            .astype(np.float32), bits, 64)
    return np.ascontiguousarray(np.resize(pattern, (out, pattern.shape[1])))


def attention(config: dict, bits: int, rng) -> dict:
    """q, k, v, o of one layer, and its norms."""
    d, hd = config["hidden_size"], config["head_dim"]
    heads, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    return {"q": matrix(heads, d, bits, rng), "k": matrix(kv, d, bits, rng), "v": matrix(kv, d, bits, rng),
            "o": matrix(d, heads, bits, rng), "input_norm": np.ones(d, np.float16),
            "post_norm": np.ones(d, np.float16)}


def embeddings(config: dict, bits: int, rng) -> dict:
    d, vocab = config["hidden_size"], config["vocab_size"]
    out = {"embed": matrix(vocab, d, bits, rng), "norm": np.ones(d, np.float16)}
    if not config["tie_word_embeddings"]:
        out["lm_head"] = matrix(vocab, d, bits, rng)
    return out


def predictor(d: int, d_ff: int, rank: int, rng) -> dict:
    """A low-rank predictor of the real shape (its compute and RAM are real; its output is not used)."""
    return {"W1": (rng.standard_normal((d, rank)) / np.sqrt(d)).astype(np.float32),
            "W2": (rng.standard_normal((rank, d_ff)) / np.sqrt(rank)).astype(np.float32),
            "b2": np.zeros(d_ff, np.float32)}


def tokenizer(vocab: int, traced):
    """The traced model's tokenizer where the vocabularies agree; else a word-level one of `vocab` tokens
    ("<unk>", "<s>", "</s>", then "w3", "w4", ...): a synthetic model's text means nothing either way."""
    if vocab == traced.vocab_size:
        return traced
    from tokenizers import Tokenizer, models, pre_tokenizers

    from lsparse.source.tokenizer import Tokenizer as LsparseTokenizer
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab)}}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()

    def save(folder):
        tok.save(str(folder / "tokenizer.json"))

    def encode(text, parse_special=True):  # the words spell no special token
        return tok.encode(text).ids

    return LsparseTokenizer(encode, lambda ids: tok.decode(ids), vocab, 1, {2}, True,
                            special={"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, save_fn=save)
