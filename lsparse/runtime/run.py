"""`lsparse run`: stream generated text from a checkpoint (dense) or a flash image (any mode), then report."""

from __future__ import annotations

import json
import sys

from lsparse.errors import LsparseError
from lsparse.image.image import Image
from lsparse.model import architecture
from lsparse.runtime.generate import stream_generate
from lsparse.runtime.options import DecodeOptions


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template is not None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        # The template writes the BOS token itself where the model wants one.
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def _load_checkpoint(spec: str, revision, tokenizer_file, backend):
    from lsparse.model import load_model
    from lsparse.model.backend import default_backend
    from lsparse.source import resolve
    checkpoint = resolve(spec, revision, tokenizer_file)
    if checkpoint.tokenizer is None:
        raise LsparseError(f"{checkpoint.location}: no tokenizer found (for a llama2.c file, pass --tokenizer)")
    backend = backend or default_backend()
    return load_model(checkpoint, backend), checkpoint.tokenizer, checkpoint.location, backend


def run(spec: str, prompt: str, max_tokens: int, options: DecodeOptions | None, sample, *, chat: bool = True,
        revision: str | None = None, tokenizer: str | None = None, backend: str | None = None,
        as_json: bool = False, out=None) -> dict:
    """`options` None: dense decoding of a checkpoint (every weight in RAM); else decoding from an image.
    Text streams to `out` (None: standard output as it is when called)."""
    out = out or sys.stdout
    if options is None:
        model, tok, where, backend = _load_checkpoint(spec, revision, tokenizer, backend)
        ids = encode_prompt(tok, prompt, chat)
    else:
        from lsparse.runtime.load import load_image
        image = Image.open(spec)
        ids = encode_prompt(image.tokenizer(), prompt, chat)
        context = min(len(ids) + max_tokens, architecture(image.manifest.config)[1].max_position_embeddings)
        model, tok = load_image(image, options.but(context=context))
        backend, where = model.kernels.name, spec
    text, tokens, last = [], [], None
    try:
        for response in stream_generate(model, tok, ids, max_tokens, sample):
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
              "finish_reason": last.finish_reason}
    if options is not None:
        result["memory_plan"] = model.memory_plan.report()
        result["ram_budget"] = options.ram_budget
        if options.mode != "dense":
            result["flash"] = model.flash_report()
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
