"""What a checkpoint holds: architecture, dimensions, and how its weights divide between components."""

from __future__ import annotations

from dataclasses import asdict

import numpy as np

from lsparse.model import architecture
from lsparse.source.checkpoint import Checkpoint

FFN_KEYS = ("gate", "up", "down", "up_bias", "down_bias")


def describe(checkpoint: Checkpoint) -> dict:
    arch, args = architecture(checkpoint.config)
    available = set(checkpoint.tensors.names())
    counts = {"embedding_and_head": 0, "attention": 0, "ffn": 0, "norms": 0}

    def size(name):
        return int(np.prod(checkpoint.tensors.shape(name)))

    for short, name in arch.global_tensor_names(args, available).items():
        counts["norms" if "norm" in short else "embedding_and_head"] += size(name)
    for i in range(args.num_hidden_layers):
        for short, name in arch.layer_tensor_names(args, i, available).items():
            kind = "ffn" if short in FFN_KEYS else "norms" if "norm" in short else "attention"
            counts[kind] += size(name) if name in available else 0
    total = sum(counts.values())
    tok = checkpoint.tokenizer
    return {
        "location": checkpoint.location,
        "architecture": arch.__name__.rsplit(".", 1)[-1],
        "args": asdict(args),
        "parameters": total,
        "parameters_by_component": counts,
        "ffn_share": counts["ffn"] / total if total else 0.0,
        "fp16_bytes": 2 * total,
        "tokenizer": None if tok is None else {"vocab_size": tok.vocab_size, "bos_id": tok.bos_id,
                                               "eos_ids": sorted(tok.eos_ids),
                                               "chat_template": tok.chat_template is not None},
    }


def print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{summary['location']}[/bold]: {summary['architecture']}, "
                  f"{summary['parameters'] / 1e6:.2f} M parameters ({summary['fp16_bytes'] / 2**20:.1f} MiB in fp16)")
    table = Table("component", "parameters", "share")
    for kind, n in summary["parameters_by_component"].items():
        table.add_row(kind, f"{n:,}", f"{n / summary['parameters']:.1%}")
    console.print(table)
    args = Table("argument", "value")
    for k, v in summary["args"].items():
        args.add_row(k, str(v))
    console.print(args)
