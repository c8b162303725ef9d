"""OPT: ReLU FFN (fc1/fc2) with biases, LayerNorm before (or, for OPT-350m, after) each block,
learned positions offset by 2, and an optional projection between embedding and model widths."""

from __future__ import annotations

from dataclasses import dataclass

from lsparse.errors import LsparseError
from lsparse.model.layers import attention, layer_norm, linear, relu, split_heads

POSITION_OFFSET = 2  # OPT's learned position table starts with two unused rows
ACTIVATIONS = ("relu",)
# A neuron's rows on flash, in file order; exact mode computes the resident fc1 and reads only fc2's column.
BUNDLE = ("down", "up")
EXACT_PREFIX = 1
EXACT_PROJECTION = "up"
MATRICES = ("q", "k", "v", "o", "embed", "lm_head")  # as in llama.py


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    ffn_dim: int
    num_attention_heads: int
    vocab_size: int
    word_embed_proj_dim: int
    do_layer_norm_before: bool
    max_position_embeddings: int
    layer_norm_eps: float = 1e-5

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        act = config.get("activation_function", "relu")
        if act not in ACTIVATIONS:
            raise LsparseError(f"unsupported OPT activation {act!r} (supported: {', '.join(ACTIVATIONS)})")
        try:
            return cls(
                hidden_size=config["hidden_size"],
                num_hidden_layers=config["num_hidden_layers"],
                ffn_dim=config["ffn_dim"],
                num_attention_heads=config["num_attention_heads"],
                vocab_size=config["vocab_size"],
                word_embed_proj_dim=config.get("word_embed_proj_dim") or config["hidden_size"],
                do_layer_norm_before=config.get("do_layer_norm_before", True),
                max_position_embeddings=config.get("max_position_embeddings", 2048),
            )
        except KeyError as e:
            raise LsparseError(f"config.json lacks {e.args[0]!r}, which an OPT model needs") from None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def intermediate_size(self) -> int:
        return self.ffn_dim


def _prefix(available: set[str]) -> str:
    # OPTForCausalLM saves "model.decoder.*"; the original facebook/opt-* checkpoints saved "decoder.*".
    return "model.decoder." if "model.decoder.embed_tokens.weight" in available else "decoder."


def layer_tensor_names(args: ModelArgs, i: int, available: set[str]) -> dict[str, str]:
    p = f"{_prefix(available)}layers.{i}."
    names = {}
    for short, long in (("q", "self_attn.q_proj"), ("k", "self_attn.k_proj"), ("v", "self_attn.v_proj"),
                        ("o", "self_attn.out_proj"), ("attn_norm", "self_attn_layer_norm"),
                        ("ffn_norm", "final_layer_norm"), ("up", "fc1"), ("down", "fc2")):
        names[short] = p + long + ".weight"
        if p + long + ".bias" in available:
            names[short + "_bias"] = p + long + ".bias"
    return names


def global_tensor_names(args: ModelArgs, available: set[str]) -> dict[str, str]:
    p = _prefix(available)
    names = {"embed": p + "embed_tokens.weight", "positions": p + "embed_positions.weight"}
    optional = {"final_norm": "final_layer_norm.weight", "final_norm_bias": "final_layer_norm.bias",
                "project_in": "project_in.weight", "project_out": "project_out.weight"}
    names.update({k: p + v for k, v in optional.items() if p + v in available})
    if "lm_head.weight" in available:
        names["lm_head"] = "lm_head.weight"
    return names


def embed(args: ModelArgs, g: dict, tokens, positions, xp):
    x = g["embed"][xp.array(tokens)]
    if "project_in" in g:
        x = linear(x, g["project_in"])
    return x + g["positions"][xp.array(positions + POSITION_OFFSET)]


def attention_block(args: ModelArgs, w: dict, x, cache, positions, xp):
    h, n = args.head_dim, args.num_attention_heads
    q = split_heads(linear(x, w["q"], w.get("q_bias")), n, h)
    k = split_heads(linear(x, w["k"], w.get("k_bias")), n, h)
    v = split_heads(linear(x, w["v"], w.get("v_bias")), n, h)
    return linear(attention(q, k, v, cache, positions, h ** -0.5, xp), w["o"], w.get("o_bias"))


def ffn_activation(args: ModelArgs, w: dict, x, xp):
    """Each neuron's coefficient on its fc2 column; where it is zero the neuron's weights are not needed."""
    return relu(linear(x, w["up"], w.get("up_bias")), xp)


def ffn_down(args: ModelArgs, w: dict, a, xp):
    return linear(a, w["down"], w.get("down_bias"))


def ffn(args: ModelArgs, w: dict, x, xp):
    return ffn_down(args, w, ffn_activation(args, w, x, xp), xp)


def block(args: ModelArgs, w: dict, x, cache, positions, xp, ffn_fn=ffn):
    eps = args.layer_norm_eps
    attn_norm = (w["attn_norm"], w.get("attn_norm_bias"))
    ffn_norm = (w["ffn_norm"], w.get("ffn_norm_bias"))
    if args.do_layer_norm_before:
        x = x + attention_block(args, w, layer_norm(x, *attn_norm, eps), cache, positions, xp)
        return x + ffn_fn(args, w, layer_norm(x, *ffn_norm, eps), xp)
    x = layer_norm(x + attention_block(args, w, x, cache, positions, xp), *attn_norm, eps)
    return layer_norm(x + ffn_fn(args, w, x, xp), *ffn_norm, eps)


def head(args: ModelArgs, g: dict, h, xp):
    if "final_norm" in g:
        h = layer_norm(h, g["final_norm"], g.get("final_norm_bias"), args.layer_norm_eps)
    if "project_out" in g:
        h = linear(h, g["project_out"])
    return linear(h, g.get("lm_head", g["embed"]))


def kv_shape(args: ModelArgs) -> tuple[int, int]:
    return args.num_attention_heads, args.head_dim
