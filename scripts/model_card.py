"""Measure a built-in model against its teacher on held-out text and write its model card (README.md) and
measurements.json beside its weights. Every figure in the card is computed here, by lsparse itself.

    python scripts/model_card.py lsparse/builtin/tinystories-reglu
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
SHARED = REPO.parent / "shared" / "data"


def measure(folder: Path, teacher: Path, text: Path) -> dict:
    from lsparse.calibrate.stats import compute_stats
    from lsparse.model import load_model
    from lsparse.model.perplexity import perplexity
    from lsparse.model.summary import describe
    from lsparse.source import resolve
    from lsparse.text import read_documents, token_windows

    student_ck, teacher_ck = resolve(str(folder)), resolve(str(teacher))
    docs = read_documents(text)
    windows = token_windows(student_ck.tokenizer, docs, 512)
    assert windows == token_windows(teacher_ck.tokenizer, docs, 512), "the tokenizers must agree"
    student_ppl = perplexity(load_model(student_ck, "numpy"), windows)
    teacher_ppl = perplexity(load_model(teacher_ck, "numpy"), windows)
    stats = compute_stats(str(folder), str(text), tokens=sum(len(w) for w in windows), window=512,
                          sparsity_levels=(0.9, 0.95), backend="numpy")
    summary = describe(student_ck)
    return {"date": time.strftime("%Y-%m-%d"), "held_out_text": f"../shared/{text.relative_to(SHARED.parent)}",
            "held_out_tokens": sum(len(w) for w in windows), "student_perplexity": student_ppl,
            "teacher_perplexity": teacher_ppl, "perplexity_ratio": student_ppl / teacher_ppl,
            "exact_zero_fraction": stats["exact_zero_fraction"],
            "exact_zero_fraction_per_layer": [1 - s["active_fraction"] for s in stats["layers"]],
            "window_union_fraction": stats["overall"]["window_union_fraction"],
            "new_per_token_fraction": stats["overall"]["new_per_token_fraction"],
            "hot_coverage": stats["overall"]["hot_coverage"], "parameters": summary["parameters"],
            "ffn_share": summary["ffn_share"], "args": summary["args"]}


def phases(training: dict) -> list[dict]:
    """The training records, first phase first (each later phase keeps its predecessor under "previous")."""
    chain = []
    while training:
        chain.insert(0, training)
        training = training.get("previous")
    return chain


def card(name: str, m: dict, training: dict) -> str:
    a, chain = m["args"], phases(training)
    p1, t = chain[0]["args"], chain[-1]["args"]
    layers = ", ".join(f"{z:.1%}" for z in m["exact_zero_fraction_per_layer"])
    windows = ", ".join(f"k={k}: {v:.1%}" for k, v in m["window_union_fraction"].items())
    hot = ", ".join(f"top {float(k):.0%}: {v:.1%}" for k, v in m["hot_coverage"].items())
    later = []
    for i, phase in enumerate(chain[1:], start=3):
        args = phase["args"]
        shift = (f"the ReLU becomes ProSparse's FATReLU, `x if x > t else 0`, with t set to the gate value below "
                 f"which {float(args['target_zero']):.0%} of activations fell; " if args.get("threshold_shift") else "")
        later.append(f"{i}. **{'Threshold shifting' if shift else 'Recovery'}** ({args['steps']} steps, "
                     f"{phase['minutes']:.0f} min): {shift}training goes on with the L1 weight held at "
                     f"{args['l1_fixed']}; peak learning rate {args['lr']}, cosine decay.")
    later_text = "\n".join(later)
    minutes = sum(phase["minutes"] for phase in chain)
    return f"""# {name}

lsparse's built-in default model (`builtin:{name}`): a Llama-architecture decoder with a ReLU-gated FFN
(ReGLU, the form of ProSparse-Llama-2: `down(fatrelu(gate(x)) * up(x))`), trained by lsparse itself so that
sparsity, windowing, prediction and paging can be measured on a real sparse model.

| | |
|---|---|
| layers, d_model, d_ff | {a['num_hidden_layers']}, {a['hidden_size']}, {a['intermediate_size']} |
| heads, KV heads | {a['num_attention_heads']}, {a['num_key_value_heads']} |
| vocabulary, context | {a['vocab_size']}, {a['max_position_embeddings']} |
| activation | `{a['hidden_act']}`, threshold {a['relu_threshold']:.4f} (`hidden_act_param`) |
| parameters | {m['parameters']:,} (FFN {m['ffn_share']:.1%}), fp32 safetensors, tied embeddings |
| tokenizer | stories260K's 512-piece SentencePiece model, converted to tokenizer.json |

## Measured on held-out text

Text: `{m['held_out_text']}` (100 TinyStories validation stories, never trained on), {m['held_out_tokens']:,}
tokens in windows of at most 512; measured {m['date']} with `python scripts/model_card.py lsparse/builtin/{name}`.

| figure | value | target |
|---|---|---|
| FFN activations exactly zero, per token, mean over layers | {m['exact_zero_fraction']:.1%} | at least 85% |
| perplexity | {m['student_perplexity']:.3f} | |
| teacher (stories260K) perplexity, same windows | {m['teacher_perplexity']:.3f} | |
| ratio to the teacher | {m['perplexity_ratio']:.3f} | at most 1.15 |

Exact zeros per layer: {layers}.
Distinct neurons used by the last k tokens (share of d_ff, mean over layers): {windows}.
Share of all activations made by the most frequent neurons: {hot}.

## Recipe

ProSparse's steps, scaled down, with distillation from the real stories260K (karpathy/tinyllamas, in
`../shared/data/stories260K`; dim 64, 5 layers, SwiGLU with d_ff 172); {minutes:.0f} minutes of training in all.

1. **Activation substitution.** The student starts as the teacher: the same embeddings, attention and FFN
   weights, with ReLU where the teacher had SiLU; the FFN widened to d_ff {a['intermediate_size']} (new neurons start
   with a zero down column) and layers beyond the teacher's added as identities.
2. **Progressive sparsity regularization** ({p1['steps']} steps, {chain[0]['minutes']:.0f} min). An L1 penalty on the
   ReLU activations, off for the first {float(p1['l1_start']):.0%} of training, then raised by 1.5x every
   {p1['l1_every']} steps while the training batches were less than {float(p1['target_zero']):.0%} zeros (it ended
   at {chain[0]['log'][-1]['l1']:.1f}). Peak learning rate {p1['lr']}, cosine decay.
{later_text}

Training text: stories sampled from the teacher at temperature 1 as training went ({t['sample_batch']} at a time,
each seen {t['reuse']} times), batches of {t['batch']} sequences of {t['seq']} tokens; loss: cross-entropy against the
teacher's full next-token distribution plus the L1 term. AdamW (betas 0.9, 0.95), gradient clipping at 1.
Seed {t['seed']}; torch {chain[-1]['torch']} on {t['threads']} CPU threads of a 2-core x86-64 machine. The
held-out stories were never trained on; their first 20 were used to watch training (`training.json` has the logs).

Reproduce: the commands at the top of `scripts/train_builtin.py`, then the measurement command above.
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("folder", type=Path)
    p.add_argument("--teacher", type=Path, default=SHARED / "stories260K" / "stories260K.bin")
    p.add_argument("--text", type=Path, default=SHARED / "tinystories" / "validation_100.txt")
    args = p.parse_args()
    m = measure(args.folder, args.teacher, args.text)
    (args.folder / "measurements.json").write_text(json.dumps(m, indent=2) + "\n")
    training = json.loads((args.folder / "training.json").read_text())
    (args.folder / "README.md").write_text(card(args.folder.name, m, training))
    print(json.dumps({k: v for k, v in m.items() if not isinstance(v, (dict, list))}, indent=2))


if __name__ == "__main__":
    main()
