"""`lsparse run`: stream generated text from a checkpoint (dense) or a flash image (any mode), then report."""

from __future__ import annotations

import json
import sys

from lsparse.errors import LsparseError
from lsparse.image.image import Image
from lsparse.model import architecture
from lsparse.runtime.correct import stream_corrected
from lsparse.runtime.generate import storage_read_bytes, stream_generate
from lsparse.runtime.options import DecodeOptions


def load_checkpoint(spec: str, revision=None, tokenizer_file=None, backend=None):
    """(model, tokenizer, where it was found, backend): a checkpoint with every weight in RAM."""
    from lsparse.model import load_model
    from lsparse.model.backend import default_backend
    from lsparse.source import resolve
    checkpoint = resolve(spec, revision, tokenizer_file)
    if checkpoint.tokenizer is None:
        raise LsparseError(f"{checkpoint.location}: no tokenizer found (for a llama2.c file, pass --tokenizer)")
    backend = backend or default_backend()
    return load_model(checkpoint, backend), checkpoint.tokenizer, checkpoint.location, backend


def load(spec: str, options: DecodeOptions | None, context: int | None = None, revision: str | None = None,
         tokenizer: str | None = None, backend: str | None = None) -> tuple[object, object, str, str]:
    """(model, tokenizer, where it was found, what computes it): an image decoded as `options` say, its KV
    cache planned for `context` tokens (None: the options' own, capped at the model's), or (options None) a
    checkpoint with every weight in RAM."""
    if options is None:
        return load_checkpoint(spec, revision, tokenizer, backend)
    from lsparse.runtime.load import load_image
    image = spec if isinstance(spec, Image) else Image.open(spec)
    longest = architecture(image.manifest.config)[1].max_position_embeddings
    model, tok = load_image(image, options.but(context=min(context or options.context, longest)))
    return model, tok, str(image.path), model.kernels.name


def run(spec: str, prompt: str, max_tokens: int, options: DecodeOptions | None, sample, *, chat: bool = True,
        allow_special: bool = False, revision: str | None = None, tokenizer: str | None = None,
        backend: str | None = None, as_json: bool = False, out=None) -> dict:
    """`options` None: dense decoding of a checkpoint (every weight in RAM); else decoding from an image.
    Text streams to `out` (None: standard output as it is when called), between mlx-lm's separators."""
    out = out or sys.stdout
    if options is None:
        model, tok, where, backend = load_checkpoint(spec, revision, tokenizer, backend)
        ids = tok.encode_prompt(prompt, chat, allow_special)
    else:
        image = Image.open(spec)
        ids = image.tokenizer().encode_prompt(prompt, chat, allow_special)
        model, tok, _, backend = load(image, options, len(ids) + max_tokens)
        where = spec
    text, tokens, last = [], [], None
    if not as_json:
        out.write("=" * 10 + "\n")
    read_before = storage_read_bytes()
    try:
        if options is not None and options.correct_every:
            responses = stream_corrected(model, tok, ids, max_tokens, options.correct_every, options.correct_margin)
        else:
            responses = stream_generate(model, tok, ids, max_tokens, sample)
        for response in responses:
            text.append(response.text)
            tokens += [response.token] if response.finish_reason != "stop" else []
            last = response
            if not as_json and response.text:
                out.write(response.text)
                out.flush()
    finally:
        if options is not None:
            model.close()
    result = {"model": where, "mode": options.mode if options else "dense-checkpoint", "backend": backend,
              "prompt": prompt, "text": "".join(text), "tokens": tokens, "prompt_tokens": len(ids),
              "prompt_tps": last.prompt_tps, "generated_tokens": last.generation_tokens,
              "generation_tps": last.generation_tps, "peak_memory_bytes": last.peak_memory,
              "finish_reason": last.finish_reason,
              # what the kernel read from storage for this process per token, prompt included (the reader's
              # direct reads and mapped matrices' page faults): None where it is not counted
              "storage_bytes_per_token": None if read_before is None else
              (storage_read_bytes() - read_before) / max(last.generation_tokens, 1)}
    if options is not None:
        result["memory_plan"] = model.memory_plan.report()
        result["ram_budget"] = options.ram_budget
        if options.mode != "dense":  # with correction a dense pass checks several tokens in one call
            result["flash"] = model.flash_report(tokens=model.correction.emitted if options.correct_every else None)
        if options.correct_every:
            result["correction"] = model.correction.report()
    if as_json:
        out.write(json.dumps(result) + "\n")
    else:
        print_report(result, out)
        if last.finish_reason == "context":
            print(f"note: stopped after {last.generation_tokens} tokens, at the end of the model's context",
                  file=sys.stderr)
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
        out.write(f"Per token: I/O {f['io_ms_per_token']:.2f} ms waited (reads {f['read_ms_per_token']:.2f} ms, "
                  f"{f['overlap_ms_per_token']:.2f} of them behind compute), memory {f['mem_ms_per_token']:.2f} ms, "
                  f"compute {f['compute_ms_per_token']:.2f} ms\n")
    out.write(f"Peak memory: {result['peak_memory_bytes'] / 1e9:.3f} GB\n")
