"""`lsparse run`: stream generated text from a checkpoint (dense) or a flash image (any mode), then report."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

from lsparse.errors import LsparseError
from lsparse.model import load_model
from lsparse.model.backend import default_backend
from lsparse.runtime.generate import GenerationStats, StreamingDetokenizer, generate
from lsparse.runtime.reader import DEFAULT_READERS
from lsparse.runtime.sampling import make_sampler
from lsparse.source import resolve


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template is not None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        # The template writes the BOS token itself where the model wants one.
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def is_image(spec: str) -> bool:
    return (Path(spec) / "manifest.json").exists()


def flash_report(model) -> dict:
    """Per decoded token, after the prompt: what the FFNs read and where the time went."""
    steps = model.costs.steps[1:] or model.costs.steps
    if not steps:
        return {}

    def mean(key):
        return float(np.mean([getattr(s, key) for s in steps]))

    reads = sum(s.requests for s in steps)
    lookups = sum(s.lookups for s in steps)
    dense = model.dense_ffn_bytes()
    return {"bytes_read_per_token": mean("bytes_read"), "bytes_needed_per_token": mean("bytes_needed"),
            "dense_ffn_bytes": dense, "share_of_dense_ffn": mean("bytes_read") / dense,
            "reads_per_token": mean("requests"),
            "mean_read_bytes": sum(s.bytes_read for s in steps) / reads if reads else 0.0,
            "cache_hit_rate": sum(s.hits for s in steps) / lookups if lookups else 1.0,
            "io_ms_per_token": 1e3 * mean("io_s"), "read_ms_per_token": 1e3 * mean("read_s"),
            "mem_ms_per_token": 1e3 * mean("mem_s"),
            "compute_ms_per_token": 1e3 * mean("compute_s"), "direct_io": model.reader.direct,
            "gap_bytes": model.gap["bytes"], "gap_rule": model.gap["rule"],
            "lookahead_used_per_token": mean("lookahead_used"), "lookahead_wasted_per_token": mean("lookahead_wasted")}


def run(spec: str, prompt: str, max_tokens: int, *, mode: str | None = None, window: int = 5,
        threshold_shift: float = 0.0, temp: float = 0.0, top_p: float = 1.0, seed: int | None = None,
        chat: bool = True, revision: str | None = None, tokenizer: str | None = None, backend: str | None = None,
        as_json: bool = False, direct: bool = True, ram_budget: str | None = None, lookahead: bool = False,
        kernels: str = "auto", readers: int = DEFAULT_READERS, out=sys.stdout) -> dict:
    """`mode` None: dense decoding of a checkpoint; exact, predicted, dense or hybrid: decoding from an image."""
    sample = make_sampler(temp, top_p, seed)
    if mode is None:
        checkpoint = resolve(spec, revision, tokenizer)
        if checkpoint.tokenizer is None:
            raise LsparseError(f"{checkpoint.location}: no tokenizer found (for a llama2.c file, pass --tokenizer)")
        backend = backend or default_backend()
        model, tok, where = load_model(checkpoint, backend), checkpoint.tokenizer, checkpoint.location
        ids = encode_prompt(tok, prompt, chat)
    else:
        from lsparse.image.format import load_manifest
        from lsparse.runtime.budget import parse_bytes
        from lsparse.runtime.image_model import load_image
        from lsparse.source.tokenizer import from_folder
        tok = from_folder(Path(spec), load_manifest(spec)["config"])
        ids = encode_prompt(tok, prompt, chat)
        model, _ = load_image(spec, mode, window, threshold_shift, direct=direct,
                              ram_budget=parse_bytes(ram_budget) if ram_budget else None,
                              tokens=len(ids) + max_tokens, lookahead=lookahead, kernels=kernels,
                              workers=readers)
        backend, where = model.kernels.name, spec
    stats = GenerationStats()
    detok = StreamingDetokenizer(tok)
    for token in generate(model, ids, max_tokens, sample, tok.eos_ids, stats):
        piece = detok.add(token)
        if not as_json and piece:
            out.write(piece)
            out.flush()
    result = {"model": where, "mode": mode or "dense-checkpoint", "backend": backend, "prompt": prompt,
              "text": detok.text(), "tokens": detok.tokens, **stats.as_dict()}
    if mode is not None:
        result["memory_plan"] = {k: v for k, v in model.memory_plan.items() if k != "cache_slots"}
        result["ram_budget"] = parse_bytes(ram_budget) if ram_budget else None
    if mode in ("exact", "predicted", "hybrid"):
        result["flash"] = flash_report(model)
    if mode is not None:
        model.close()
    if as_json:
        out.write(json.dumps(result) + "\n")
    else:
        print_report(result, out)
    return result


def print_report(result: dict, out) -> None:
    out.write("\n" + "=" * 10 + "\n")
    out.write(f"Prompt: {result['prompt_tokens']} tokens, {result['prompt_tps']:.3f} tokens-per-sec\n")
    out.write(f"Generation: {result['generated_tokens']} tokens, {result['generation_tps']:.3f} tokens-per-sec\n")
    f = result.get("flash")
    if f:
        out.write(f"Flash: {f['bytes_read_per_token'] / 1e3:.1f} KB read per token "
                  f"({f['share_of_dense_ffn']:.2%} of a dense step's {f['dense_ffn_bytes'] / 1e6:.2f} MB of FFN), "
                  f"{f['reads_per_token']:.1f} reads of {f['mean_read_bytes'] / 1e3:.1f} KB, cache hits "
                  f"{f['cache_hit_rate']:.1%}{'' if f['direct_io'] else ' (buffered I/O)'}\n")
        out.write(f"Per token: I/O {f['io_ms_per_token']:.2f} ms, memory {f['mem_ms_per_token']:.2f} ms, "
                  f"compute {f['compute_ms_per_token']:.2f} ms\n")
    out.write(f"Peak memory: {result['peak_memory_bytes'] / 1e9:.3f} GB\n")
