"""`lsparse chat`."""

from __future__ import annotations

from typing import Optional

import typer

from lsparse.cli.app import app
from lsparse.cli.run import (
    ALLOW_SPECIAL,
    BACKEND,
    BUFFERED,
    DENSE,
    KERNELS,
    LOOKAHEAD,
    MODE,
    MODEL,
    PACKED,
    RAM_BUDGET,
    READERS,
    REVISION,
    SEED,
    TEMP,
    THRESHOLD,
    TOKENIZER,
    TOP_P,
    WINDOW,
    decode_choice,
    utf8,
)
from lsparse.runtime.options import DecodeOptions

CHAT_HELP = (
    "A conversation with a flash image or (with --dense) a checkpoint, through its chat template.\n\n"
    "Type a message and Enter; the reply streams. /reset forgets the conversation, /stats shows the last turn's "
    "costs as `lsparse run` reports a generation (Peak memory: this process's peak resident memory), /exit or "
    "Ctrl-D ends. The KV cache keeps the conversation: a turn computes only the tokens it adds. A model without "
    "a chat template continues one text, each message appended to it.")


@app.command(help=CHAT_HELP)
def chat(
    model: str = MODEL,
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="The system message the "
                                                "conversation starts with (where the chat template has one)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", min=1, help="Most tokens a reply may have."),
    max_kv_size: int = typer.Option(DecodeOptions.context, "--max-kv-size", min=2, help="Tokens the conversation "
                                    "may hold (the KV cache, planned in the RAM budget); capped at the model's "
                                    "context."),
    allow_special: bool = ALLOW_SPECIAL,
    dense: bool = DENSE,
    mode: Optional[str] = MODE,
    window: Optional[int] = WINDOW,
    threshold: Optional[float] = THRESHOLD,
    temp: float = TEMP,
    top_p: float = TOP_P,
    seed: Optional[int] = SEED,
    revision: Optional[str] = REVISION,
    tokenizer: Optional[str] = TOKENIZER,
    backend: Optional[str] = BACKEND,
    buffered: bool = BUFFERED,
    ram_budget: Optional[str] = RAM_BUDGET,
    lookahead: bool = LOOKAHEAD,
    kernels: Optional[str] = KERNELS,
    packed: bool = PACKED,
    readers: Optional[int] = READERS,
):
    from lsparse.runtime.chat import Chat, converse
    from lsparse.runtime.run import load
    from lsparse.runtime.sampling import make_sampler
    options = decode_choice(model, dense, mode, window, threshold, ram_budget, kernels, packed, readers, buffered,
                            lookahead, revision, tokenizer, backend)
    loaded, tok, _, _ = load(model, options, max_kv_size, revision, tokenizer, backend)
    context = min(max_kv_size, loaded.context_length)
    try:
        converse(Chat(loaded, tok, context, system_prompt and utf8(system_prompt), allow_special), max_tokens,
                 make_sampler(temp, top_p, seed))
    finally:
        if options is not None:
            loaded.close()
