"""The Llama family: Llama, Mistral, SmolLM2, and the ReLU-gated variants sparse inference targets
(ReGLU: ProSparse-Llama-2, ReluLLaMA; dReLU: TurboSparse). RMSNorm, RoPE, grouped-query attention."""

from __future__ import annotations

from dataclasses import dataclass

from lsparse.errors import LsparseError
from lsparse.model.layers import (
    apply_rope,
    attention,
    linear,
    relu,
    rms_norm,
    rope_frequencies,
    silu,
    split_heads,
)

# hidden_act -> (activation of the gate, whether the up projection is ReLU'd too). "fatrelu" is ProSparse's
# shifted ReLU: a gate value counts only above the threshold `hidden_act_param` (x if x > t else 0).
ACTIVATIONS = {"relu": ("relu", False), "fatrelu": ("relu", False), "silu": ("silu", False),
               "swish": ("silu", False), "drelu": ("relu", True)}
ROPE_TYPES = ("default", "linear", "llama3")
# A neuron's rows on flash, in file order; exact mode computes the resident gate and reads the first two.
BUNDLE = ("up", "down", "gate")
EXACT_PREFIX = 2
EXACT_PROJECTION = "gate"
# Weight matrices (out, in) an image may keep quantized as rows (compile --resident-bits): by their short names
MATRICES = ("q", "k", "v", "o", "embed", "lm_head")


@dataclass
class ModelArgs:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    hidden_act: str
    relu_threshold: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    sliding_window: int | None

    @classmethod
    def from_config(cls, config: dict) -> "ModelArgs":
        act = config.get("hidden_act", "silu")
        if config.get("mlp_bias"):
            raise LsparseError("mlp_bias (biases on the gate, up and down projections) is not supported: lsparse "
                               "would decode this model wrong")
        if act not in ACTIVATIONS:
            raise LsparseError(f"unsupported FFN activation {act!r} for a Llama-family model "
                               f"(supported: {', '.join(ACTIVATIONS)})")
        # transformers 5 writes rope_parameters; earlier versions rope_theta and rope_scaling.
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind not in ROPE_TYPES:
            raise LsparseError(f"unsupported RoPE scaling {kind!r} (supported: {', '.join(ROPE_TYPES)})")
        heads = config["num_attention_heads"]
        try:
            return cls(
                hidden_size=config["hidden_size"],
                num_hidden_layers=config["num_hidden_layers"],
                intermediate_size=config["intermediate_size"],
                num_attention_heads=heads,
                num_key_value_heads=config.get("num_key_value_heads") or heads,
                vocab_size=config["vocab_size"],
                head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                rms_norm_eps=config.get("rms_norm_eps", 1e-6),
                rope_theta=config.get("rope_theta", rope.get("rope_theta", 10000.0)),
                rope_scaling=scaling,
                hidden_act=act,
                relu_threshold=float(config.get("hidden_act_param", 0.0)) if act == "fatrelu" else 0.0,
                tie_word_embeddings=config.get("tie_word_embeddings", False),
                max_position_embeddings=config.get("max_position_embeddings", 4096),
                sliding_window=config.get("sliding_window"),
            )
        except KeyError as e:
            raise LsparseError(f"config.json lacks {e.args[0]!r}, which a Llama-family model needs") from None


LAYER_TENSORS = {
    "input_norm": "input_layernorm.weight",
    "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "post_norm": "post_attention_layernorm.weight",
    "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
}
OPTIONAL_LAYER_TENSORS = {"q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
                          "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias"}


def layer_tensor_names(args: ModelArgs, i: int, available: set[str]) -> dict[str, str]:
    names = {k: f"model.layers.{i}.{v}" for k, v in LAYER_TENSORS.items()}
    names.update({k: f"model.layers.{i}.{v}" for k, v in OPTIONAL_LAYER_TENSORS.items()
                  if f"model.layers.{i}.{v}" in available})
    return names


def global_tensor_names(args: ModelArgs, available: set[str]) -> dict[str, str]:
    names = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight"}
    if "lm_head.weight" in available and not args.tie_word_embeddings:
        names["lm_head"] = "lm_head.weight"
    return names


def embed(args: ModelArgs, g: dict, tokens, positions, xp):
    return g["embed"][xp.array(tokens)]


def attention_block(args: ModelArgs, w: dict, x, cache, positions, xp):
    h = args.head_dim
    q = split_heads(linear(x, w["q"], w.get("q_bias")), args.num_attention_heads, h)
    k = split_heads(linear(x, w["k"], w.get("k_bias")), args.num_key_value_heads, h)
    v = split_heads(linear(x, w["v"], w.get("v_bias")), args.num_key_value_heads, h)
    inv_freq = rope_frequencies(h, args.rope_theta, args.rope_scaling)
    q, k = apply_rope(q, positions, inv_freq, xp), apply_rope(k, positions, inv_freq, xp)
    out = attention(q, k, v, cache, positions, h ** -0.5, xp, args.sliding_window)
    return linear(out, w["o"], w.get("o_bias"))


def gate_activation(args: ModelArgs, gate, up, xp):
    """The coefficient on each down column, from the gate and up projections' values."""
    gate_act, relu_up = ACTIVATIONS[args.hidden_act]
    if gate_act == "silu":
        return silu(gate, xp) * up
    g = relu(gate, xp) if args.relu_threshold == 0 else gate * (gate > args.relu_threshold)
    return g * (relu(up, xp) if relu_up else up)


def ffn_activation(args: ModelArgs, w: dict, x, xp):
    """Each neuron's coefficient on its down column; where it is zero the neuron's rows are not needed."""
    return gate_activation(args, linear(x, w["gate"]), linear(x, w["up"]), xp)


def ffn_down(args: ModelArgs, w: dict, a, xp):
    return linear(a, w["down"])


def ffn(args: ModelArgs, w: dict, x, xp):
    return ffn_down(args, w, ffn_activation(args, w, x, xp), xp)


def block(args: ModelArgs, w: dict, x, cache, positions, xp, ffn_fn=ffn):
    x = x + attention_block(args, w, rms_norm(x, w["input_norm"], args.rms_norm_eps), cache, positions, xp)
    return x + ffn_fn(args, w, rms_norm(x, w["post_norm"], args.rms_norm_eps), xp)


def head(args: ModelArgs, g: dict, h, xp):
    h = rms_norm(h, g["norm"], args.rms_norm_eps)
    return linear(h, g.get("lm_head", g["embed"]))


def kv_shape(args: ModelArgs) -> tuple[int, int]:
    return args.num_key_value_heads, args.head_dim
