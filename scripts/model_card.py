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
    from lsparse.bench.quality import perplexity, read_documents, token_windows
    from lsparse.calibrate.stats import compute_stats
    from lsparse.model import load_model
    from lsparse.model.summary import describe
    from lsparse.source import resolve

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


def card(name: str, m: dict, training: dict) -> str:
    a, t = m["args"], training["args"]
    layers = ", ".join(f"{z:.1%}" for z in m["exact_zero_fraction_per_layer"])
    windows = ", ".join(f"k={k}: {v:.1%}" for k, v in m["window_union_fraction"].items())
    hot = ", ".join(f"top {float(k):.0%}: {v:.1%}" for k, v in m["hot_coverage"].items())
    return f"""# {name}

lsparse's built-in default model (`builtin:{name}`): a Llama-architecture decoder with a ReLU-gated FFN
(ReGLU, the form of ProSparse-Llama-2: `down(relu(gate(x)) * up(x))`), trained by lsparse itself so that
sparsity, windowing, prediction and paging can be measured on a real sparse model.

| | |
|---|---|
| layers, d_model, d_ff | {a['num_hidden_layers']}, {a['hidden_size']}, {a['intermediate_size']} |
| heads, KV heads | {a['num_attention_heads']}, {a['num_key_value_heads']} |
| vocabulary, context | {a['vocab_size']}, {a['max_position_embeddings']} |
| parameters | {m['parameters']:,} (FFN {m['ffn_share']:.1%}), fp32 safetensors, tied embeddings |
| tokenizer | stories260K's 512-piece SentencePiece model, converted to tokenizer.json |

## Measured on held-out text

Text: `{m['held_out_text']}` (100 TinyStories validation stories, never used in training), {m['held_out_tokens']:,}
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

Distillation from the real stories260K (karpathy/tinyllamas, in `../shared/data/stories260K`) with
ProSparse's ingredients: a ReLU activation from the start, and a progressive L1 penalty on the
activations, off for the first {float(t['l1_start']):.0%} of training, then raised by 1.5x every
{t['l1_every']} steps while the training batches were less than {float(t['target_zero']):.0%} zeros.
Training text: stories sampled from the teacher at temperature 1 as training went ({t['sample_batch']}
at a time, each seen {t['reuse']} times), {t['steps']} steps of {t['batch']} sequences of {t['seq']} tokens
(about {t['steps'] * t['batch'] * t['seq'] / 1e6:.1f} M tokens); loss: cross-entropy against the teacher's full
next-token distribution plus the L1 term. AdamW (betas 0.9, 0.95), peak learning rate {t['lr']}, cosine
decay, gradient clipping at 1. Seed {t['seed']}; torch {training['torch']} on {t['threads']} CPU threads;
{training['minutes']:.0f} minutes on a 2-core x86-64 machine.

Reproduce: `python scripts/train_builtin.py --out lsparse/builtin/{name}` then the measurement command above
(`training.json` holds the arguments and the training log).
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
