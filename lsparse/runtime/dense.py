"""`lsparse run --dense`: every weight in RAM, streaming output, an mlx-lm style summary."""

from __future__ import annotations

import json
import sys

from lsparse.errors import LsparseError
from lsparse.model import load_model
from lsparse.model.backend import default_backend
from lsparse.runtime.generate import GenerationStats, StreamingDetokenizer, generate
from lsparse.runtime.sampling import make_sampler
from lsparse.source import resolve


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat and tokenizer.chat_template is not None:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
        # The template writes the BOS token itself where the model wants one.
        return tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.encode(prompt)


def run_dense(spec: str, prompt: str, max_tokens: int, *, temp: float = 0.0, top_p: float = 1.0,
              seed: int | None = None, chat: bool = True, revision: str | None = None,
              tokenizer: str | None = None, backend: str | None = None, as_json: bool = False) -> dict:
    sample = make_sampler(temp, top_p, seed)
    checkpoint = resolve(spec, revision, tokenizer)
    if checkpoint.tokenizer is None:
        raise LsparseError(f"{checkpoint.location}: no tokenizer found (for a llama2.c file, pass --tokenizer)")
    backend = backend or default_backend()
    model = load_model(checkpoint, backend)
    tok = checkpoint.tokenizer
    ids = encode_prompt(tok, prompt, chat)
    stats = GenerationStats()
    detok = StreamingDetokenizer(tok)
    for token in generate(model, ids, max_tokens, sample, tok.eos_ids, stats):
        piece = detok.add(token)
        if not as_json and piece:
            sys.stdout.write(piece)
            sys.stdout.flush()
    result = {"model": checkpoint.location, "backend": backend, "prompt": prompt, "text": detok.text(),
              "tokens": detok.tokens, **stats.as_dict()}
    if as_json:
        print(json.dumps(result))
    else:
        print("\n" + "=" * 10)
        print(f"Prompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.3f} tokens-per-sec")
        print(f"Generation: {stats.generated_tokens} tokens, {stats.generation_tps:.3f} tokens-per-sec")
        print(f"Peak memory: {stats.peak_memory_bytes / 1e9:.3f} GB")
    return result
