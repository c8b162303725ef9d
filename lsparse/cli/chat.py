"""`lsparse chat`."""

from __future__ import annotations

from typing import Optional

import typer

from lsparse.cli.app import app
from lsparse.cli.model_options import ModelChoice, model_options, utf8
from lsparse.runtime.options import DecodeOptions

CHAT_HELP = (
    "A conversation with a flash image or (with --dense) a checkpoint, through its chat template.\n\n"
    "Type a message and Enter; the reply streams. /reset forgets the conversation, /stats shows the last turn's "
    "costs as `lsparse run` reports a generation (Peak memory: this process's peak resident memory), /exit or "
    "Ctrl-D ends. The KV cache keeps the conversation: a turn computes only the tokens it adds. A model without "
    "a chat template continues one text, each message appended to it.")


@app.command(help=CHAT_HELP)
@model_options
def chat(
    system_prompt: Optional[str] = typer.Option(None, "--system-prompt", help="The system message the "
                                                "conversation starts with (where the chat template has one)."),
    max_tokens: int = typer.Option(256, "--max-tokens", "-m", min=1, help="Most tokens a reply may have."),
    max_kv_size: int = typer.Option(DecodeOptions.context, "--max-kv-size", min=2, help="Tokens the conversation "
                                    "may hold (the KV cache, planned in the RAM budget); capped at the model's "
                                    "context."),
    *,
    choice: ModelChoice,
):
    from lsparse.runtime.chat import Chat, converse
    from lsparse.runtime.run import load
    options = choice.decode_options()
    model, tok, _, _ = load(choice.model, options, max_kv_size, choice.revision, choice.tokenizer, choice.backend)
    try:
        conversation = Chat(model, tok, min(max_kv_size, model.context_length),
                            system_prompt and utf8(system_prompt), choice.allow_special)
        converse(conversation, max_tokens, choice.sampler())
    finally:
        if options is not None:
            model.close()
