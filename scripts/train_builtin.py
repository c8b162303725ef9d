"""Train lsparse's built-in default model: a Llama-architecture model with a ReLU-gated FFN (ReGLU, the form
of ProSparse-Llama-2: down(relu(gate(x)) * up(x))), distilled from the real stories260K.

Recipe (ProSparse and knowledge distillation, scaled down):
- data: TinyStories-style text sampled from the teacher (stories260K, temperature 1) as training goes, so
  that no text is reused and nothing of the held-out TinyStories validation split is seen;
- loss: cross-entropy against the teacher's full next-token distribution, plus ProSparse's progressive L1
  penalty on the ReLU activations: zero at first, then raised step by step, by a factor each time the
  training batches are less sparse than the target, so that the weight found is the smallest that works;
- the tokenizer is the teacher's (512 SentencePiece pieces), written as tokenizer.json.

Everything is seeded; torch is a training-time tool here, never a runtime dependency of lsparse.

    python scripts/train_builtin.py --out /tmp/phase1                                  # ~30 min on 2 cores
    python scripts/train_builtin.py --resume /tmp/phase1 --threshold-shift --target-zero 0.87 \
        --l1-fixed 2.0 --steps 500 --lr 5e-4 --out /tmp/phase2                      # ~10 min
    python scripts/train_builtin.py --resume /tmp/phase2 --l1-fixed 0.3 --steps 700 --lr 5e-4 \
        --out lsparse/builtin/tinystories-reglu                                       # ~15 min
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = REPO.parent / "shared" / "data"


@dataclass
class Shape:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    max_position_embeddings: int
    hidden_act: str
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    hidden_act_param: float = 0.0  # ProSparse's FATReLU threshold (hidden_act "fatrelu")


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(pos, head_dim, theta):
    """cos and sin for Hugging Face's convention: rotate (j, j + head_dim/2)."""
    inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ang = pos[:, None].float() * inv[None]
    return torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()


def rope(x, cos, sin):
    hd = x.shape[-1]
    return x * cos + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * sin


class Attention(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.s, hd = s, s.hidden_size // s.num_attention_heads
        self.q_proj = nn.Linear(s.hidden_size, s.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(s.hidden_size, s.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(s.num_attention_heads * hd, s.hidden_size, bias=False)

    def forward(self, x, cos, sin, cache=None):
        b, t, _ = x.shape
        s, hd = self.s, self.s.hidden_size // self.s.num_attention_heads
        q = self.q_proj(x).view(b, t, s.num_attention_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, s.num_key_value_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, s.num_key_value_heads, hd).transpose(1, 2)
        q, k = rope(q, cos, sin), rope(k, cos, sin)
        if cache is not None:  # preallocated: {"k": (b, kv, max, hd), "v": ..., "n": filled}
            n = cache["n"]
            cache["k"][:, :, n:n + t], cache["v"][:, :, n:n + t] = k, v
            cache["n"] = n + t
            k, v = cache["k"][:, :, :n + t], cache["v"][:, :, :n + t]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=t > 1, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.act, self.threshold = s.hidden_act, s.hidden_act_param
        self.gate_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.up_proj = nn.Linear(s.hidden_size, s.intermediate_size, bias=False)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=False)

    def forward(self, x, acts=None):
        g = self.gate_proj(x)
        if self.act == "silu":
            g = F.silu(g)
        else:  # ReLU, shifted by the threshold once one is set (ProSparse's threshold shifting)
            g = F.relu(g) if self.threshold == 0 else g * (g > self.threshold)
        if acts is not None:
            acts.append(g)
        return self.down_proj(g * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = Attention(s)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = MLP(s)

    def forward(self, x, cos, sin, cache=None, acts=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache)
        return x + self.mlp(self.post_attention_layernorm(x), acts)


class Decoder(nn.Module):
    def __init__(self, s: Shape):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(Layer(s) for _ in range(s.num_hidden_layers))
        self.norm = RMSNorm(s.hidden_size, s.rms_norm_eps)


class Llama(nn.Module):
    """Tied embeddings; parameter names are those of transformers' LlamaForCausalLM."""

    def __init__(self, s: Shape):
        super().__init__()
        self.shape = s
        self.model = Decoder(s)

    def forward(self, idx, pos0=0, caches=None, acts=None):
        s = self.shape
        cos, sin = rope_tables(torch.arange(pos0, pos0 + idx.shape[1]), s.hidden_size // s.num_attention_heads,
                               s.rope_theta)
        x = self.model.embed_tokens(idx)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, None if caches is None else caches[i], acts)
        return self.model.norm(x) @ self.model.embed_tokens.weight.T


def load_teacher() -> Llama:
    from lsparse.source import resolve
    ck = resolve(str(SHARED / "stories260K" / "stories260K.bin"))
    c = ck.config
    teacher = Llama(Shape(c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"],
                          c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"],
                          c["max_position_embeddings"], "silu"))
    state = {name: torch.from_numpy(ck.tensors.get(name)) for name in ck.tensors.names()}
    teacher.load_state_dict(state, strict=True)
    return teacher.eval()


@torch.no_grad()
def sample_teacher(teacher: Llama, batch: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`batch` sequences of `length` tokens from BOS, temperature 1; stories follow one another, each
    starting with BOS, as in the packed data the teacher was trained on."""
    s = teacher.shape
    shape = (batch, s.num_key_value_heads, length, s.hidden_size // s.num_attention_heads)
    caches = [{"k": torch.zeros(shape), "v": torch.zeros(shape), "n": 0} for _ in teacher.model.layers]
    tokens = torch.ones((batch, length), dtype=torch.long)
    for t in range(length - 1):
        logits = teacher(tokens[:, t:t + 1], pos0=t, caches=caches)[:, -1]
        gumbel = -torch.log(-torch.log(torch.rand(logits.shape, generator=gen).clamp_min(1e-20)))
        tokens[:, t + 1] = torch.argmax(logits + gumbel, -1)  # a sample at temperature 1 (Gumbel-max)
    return tokens


@torch.no_grad()
def init_from_teacher(student: Llama, teacher: Llama) -> None:
    """ProSparse's starting point: the teacher's weights, with ReLU where it had SiLU. The FFN is widened to
    d_ff (new neurons start with a zero down column, so they change nothing yet) and layers beyond the
    teacher's start as identities (zero output projections)."""
    s, t = student.state_dict(), teacher.state_dict()
    n = teacher.shape.intermediate_size
    for name, value in s.items():
        if name not in t:  # an added layer: leave its attention and FFN outputs at zero
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                value.zero_()
            continue
        src = t[name]
        if "down_proj" in name:
            value.zero_()
            value[:, :n] = src
        elif "gate_proj" in name or "up_proj" in name:
            value[:n] = src
        else:
            value.copy_(src)


@torch.no_grad()
def shift_threshold(student: Llama, teacher: Llama, target_zero: float, gen: torch.Generator) -> float:
    """The gate value below which `target_zero` of the ReLU activations fall, on freshly sampled text."""
    tokens = sample_teacher(teacher, 16, 257, gen)
    acts = []
    student(tokens, acts=acts)
    values = torch.cat([a.flatten() for a in acts])
    return float(torch.quantile(values[torch.randperm(len(values), generator=gen)[:1_000_000]], target_zero))


def evaluate(student: Llama, windows: list[list[int]]) -> tuple[float, list[float]]:
    """Perplexity on held-out windows and the per-layer fraction of exactly-zero FFN activations."""
    nll, count, zeros, total = 0.0, 0, None, 0
    with torch.no_grad():
        for w in windows:
            acts = []
            idx = torch.tensor([w])
            logits = student(idx, acts=acts)[0, :-1]
            nll += F.cross_entropy(logits, idx[0, 1:], reduction="sum").item()
            count += len(w) - 1
            z = [(a[0] == 0).float().sum().item() for a in acts]
            zeros = z if zeros is None else [a + b for a, b in zip(zeros, z, strict=True)]
            total += len(w) * student.shape.intermediate_size
    return math.exp(nll / count), [z / total for z in zeros]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--ffn-mult", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--l1-init", type=float, default=1e-3, help="first weight of the L1 activation penalty")
    p.add_argument("--l1-start", type=float, default=0.15, help="share of training before the L1 penalty")
    p.add_argument("--l1-every", type=int, default=50, help="steps between adjustments of the L1 weight")
    p.add_argument("--target-zero", type=float, default=0.9, help="zero fraction the L1 weight aims at")
    p.add_argument("--sample-batch", type=int, default=256, help="teacher sequences sampled at once")
    p.add_argument("--reuse", type=int, default=2, help="steps that see each sampled sequence")
    p.add_argument("--resume", type=Path, help="continue from a model this script exported (a second phase)")
    p.add_argument("--threshold-shift", action="store_true",
                   help="with --resume: shift the ReLU threshold (FATReLU) to the gate value below which "
                        "--target-zero of activations fall, then train on with it")
    p.add_argument("--l1-fixed", type=float, help="hold the L1 weight at this value")
    p.add_argument("--init", choices=("teacher", "random"), default="teacher",
                   help="teacher: start from the teacher's weights with ReLU in place of SiLU (ProSparse's "
                        "activation substitution), d_ff widened and one identity layer added; random: from scratch")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=100)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    teacher = load_teacher()
    if args.init == "teacher":
        t = teacher.shape
        args.d_model, args.heads, args.kv_heads = t.hidden_size, t.num_attention_heads, t.num_key_value_heads
        args.layers = max(args.layers, t.num_hidden_layers)
    shape = Shape(args.d_model, args.layers, args.ffn_mult * args.d_model, args.heads, args.kv_heads,
                  teacher.shape.vocab_size, teacher.shape.max_position_embeddings, "relu")
    student = Llama(shape)
    for name, prm in student.named_parameters():
        if prm.dim() == 2:
            nn.init.normal_(prm, std=0.02 if "embed" in name else 1 / math.sqrt(prm.shape[1]))
    if args.resume:
        from safetensors.numpy import load_file
        state = load_file(str(args.resume / "model.safetensors"))
        student.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})
        args.l1_start = 0.0  # the penalty goes on from where the first phase left it
        l1_from = json.loads((args.resume / "training.json").read_text())["log"][-1]["l1"]
        shape.hidden_act_param = json.loads((args.resume / "config.json").read_text()).get("hidden_act_param", 0.0)
        if args.threshold_shift:
            shape.hidden_act_param = shift_threshold(student, teacher, args.target_zero, gen)
        for layer in student.model.layers:
            layer.mlp.threshold = shape.hidden_act_param
        print(json.dumps({"relu_threshold": shape.hidden_act_param}), flush=True)
    elif args.init == "teacher":
        init_from_teacher(student, teacher)
    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)

    from lsparse.source.tokenizer import sentencepiece
    from lsparse.text import read_documents, token_windows
    tok = sentencepiece(SHARED / "stories260K" / "tok512.model")
    held_out = token_windows(tok, read_documents(SHARED / "tinystories" / "validation_100.txt"), 512)

    def batches():
        while True:
            sampled = sample_teacher(teacher, args.sample_batch, args.seq + 1, gen)
            for _ in range(args.reuse):
                yield from sampled[torch.randperm(len(sampled), generator=gen)].split(args.batch)

    data = batches()
    log = []
    l1, zero_window = (l1_from if args.resume else 0.0), []
    start = time.time()
    warmup = max(1, min(100, args.steps // 10))
    for step in range(1, args.steps + 1):
        lr = args.lr * min(step / warmup, 0.5 * (1 + math.cos(math.pi * (step - warmup) / (args.steps - warmup))))
        for group in opt.param_groups:
            group["lr"] = lr
        # ProSparse: the L1 weight starts once the model has learnt the task, then rises in stages.
        if args.l1_fixed is not None:
            l1 = args.l1_fixed
        elif step > args.l1_start * args.steps and step % args.l1_every == 0:
            if not l1:
                l1 = args.l1_init
            elif np.mean(zero_window) < args.target_zero:
                l1 *= 1.5
            zero_window = []
        tokens = next(data)
        with torch.no_grad():
            target = torch.softmax(teacher(tokens[:, :-1]), -1)
        acts = []
        logits = student(tokens[:, :-1], acts=acts)
        kd = -(target * torch.log_softmax(logits, -1)).sum(-1).mean()
        sparsity_loss = torch.stack([a.mean() for a in acts]).mean()
        zero_window.append(float(np.mean([(a == 0).float().mean().item() for a in acts])))
        loss = kd + l1 * sparsity_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        if step % args.eval_every == 0 or step == args.steps:
            ppl, zero = evaluate(student, held_out[:20])
            entry = {"step": step, "minutes": (time.time() - start) / 60, "kd": kd.item(), "l1": l1,
                     "held_out_ppl_20_stories": ppl, "zero_fraction": float(np.mean(zero))}
            log.append(entry)
            print(json.dumps(entry), flush=True)

    minutes = (time.time() - start) / 60
    export(student, shape, args, minutes, log)


def sentencepiece_to_tokenizer_json(path: Path):
    """A SentencePiece BPE model as a `tokenizers` BPE with the same pieces, merges (derived from the piece
    ranks), byte fallback and whitespace folding (remove_extra_whitespaces), and BOS added first."""
    import sentencepiece as spm
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors

    sp = spm.SentencePieceProcessor(model_file=str(path))
    vocab = {sp.id_to_piece(i): i for i in range(sp.get_piece_size())}
    merges = []
    for piece, rank in vocab.items():
        pairs = [(piece[:k], piece[k:], rank) for k in range(1, len(piece))
                 if piece[:k] in vocab and piece[k:] in vocab]
        merges += sorted(pairs, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges = [(a, b) for a, b, _ in sorted(merges, key=lambda m: m[2])]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token=sp.id_to_piece(sp.unk_id()), fuse_unk=True,
                               byte_fallback=True))
    tok.normalizer = normalizers.Sequence([
        normalizers.Replace(Regex(" {2,}"), " "), normalizers.Replace(Regex(r"\A +| +\z"), ""),
        normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = [sp.id_to_piece(i) for i in (sp.unk_id(), sp.bos_id(), sp.eos_id())]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    bos = sp.id_to_piece(sp.bos_id())
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, sp.bos_id())])
    return tok, {"bos_token": bos, "eos_token": specials[2], "unk_token": specials[0]}


def export(student: Llama, shape: Shape, args, minutes: float, log: list[dict]) -> None:
    from safetensors.numpy import save_file

    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().numpy().astype(np.float32) for k, v in student.state_dict().items()}
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **asdict(shape),
              "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2}
    if shape.hidden_act_param > 0:
        config["hidden_act"] = "fatrelu"
    else:
        del config["hidden_act_param"]
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    # The teacher's SentencePiece model, converted to tokenizer.json (the SentencePiece file itself stays in
    # ../shared/data); test_builtin checks that both encode held-out text identically.
    tok, special = sentencepiece_to_tokenizer_json(SHARED / "stories260K" / "tok512.model")
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(special, indent=2) + "\n")
    training = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                "minutes": minutes, "torch": torch.__version__, "log": log}
    if args.resume:  # keep the whole history: the first phase's record travels with the model
        training["previous"] = json.loads((args.resume / "training.json").read_text())
    (out / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    print(f"wrote {out} after {minutes:.1f} minutes")


if __name__ == "__main__":
    main()
