"""A conversation with a model (`lsparse chat`, and scripts through lsparse.Chat): each turn goes through the
chat template, and the KV cache keeps what the conversation so far has computed, so that a turn feeds only the
tokens its rendering adds."""

from __future__ import annotations

import sys
from typing import Callable, Iterator

from lsparse.errors import LsparseError
from lsparse.runtime.generate import GenerationResponse, stream_generate
from lsparse.runtime.run import print_report

HELP = "/reset forgets the conversation, /stats shows the last turn's costs, /exit (or Ctrl-D) ends the chat"


class Chat:
    """The messages so far and a KV cache of `context` tokens holding a prefix of their rendering. A model
    whose tokenizer has no chat template continues one text: each turn's words are appended to it."""

    def __init__(self, model, tokenizer, context: int, system_prompt: str | None = None,
                 allow_special: bool = False):
        self.model, self.tokenizer, self.context, self.allow_special = model, tokenizer, context, allow_special
        self.system_prompt = system_prompt
        if system_prompt is not None and tokenizer.chat_template is None:
            raise LsparseError("this model's tokenizer has no chat template, so it has no place for a system prompt")
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        self.cache = self.model.make_cache(self.context)
        self.cached: list[int] = []  # the tokens whose keys and values the cache holds, in order
        self.last: GenerationResponse | None = None
        self.fed = 0  # tokens the last turn fed before generating (its rendering less what the cache held)
        self.steps_before = 0  # an image model's cost steps before the last turn

    def _rendered(self) -> list[int]:
        if self.tokenizer.chat_template is not None:
            return self.tokenizer.encode_messages(self.messages, self.allow_special)
        text = "".join(m["content"] if m["role"] == "assistant" or i == 0 else " " + m["content"]
                       for i, m in enumerate(self.messages))
        return self.tokenizer.encode(text, parse_special=self.allow_special)

    def say(self, text: str, max_tokens: int, sample: Callable) -> Iterator[GenerationResponse]:
        """The model's reply to `text`, a response per token (as stream_generate's)."""
        self.messages.append({"role": "user", "content": text})
        ids = self._rendered()
        keep = _common_prefix(self.cached, ids[:-1])  # at least one token is fed: its logits start the reply
        for layer in self.cache:
            layer.offset = keep
        self.fed, self.cached = len(ids) - keep, ids
        self.steps_before = len(self.model.costs.steps) if hasattr(self.model, "costs") else 0
        reply = []
        try:
            for response in stream_generate(self.model, self.tokenizer, ids[keep:], max_tokens, sample,
                                            cache=self.cache):
                reply.append(response)
                yield response
        finally:
            self._keep(reply)

    def _keep(self, reply: list[GenerationResponse]) -> None:
        """The reply, as it was shown, joins the conversation (a turn that made none is taken back); the cache
        holds every token of it but the last one sampled (every layer as far as the shortest: a turn
        interrupted mid-token)."""
        held = min(layer.offset for layer in self.cache)
        for layer in self.cache:
            layer.offset = held
        self.cached = (self.cached + [r.token for r in reply][:-1])[:held]
        if not reply:
            self.messages.pop()
            return
        self.messages.append({"role": "assistant", "content": "".join(r.text for r in reply)})
        self.last = reply[-1]


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def turn_report(chat: Chat) -> dict | None:
    """The last turn's summary, as `lsparse run` reports a generation (None before the first turn)."""
    last = chat.last
    if last is None:
        return None
    report = {"prompt_tokens": chat.fed, "prompt_tps": last.prompt_tps, "generated_tokens": last.generation_tokens,
              "generation_tps": last.generation_tps, "peak_memory_bytes": last.peak_memory,
              "cached_tokens": len(chat.cached)}
    if hasattr(chat.model, "flash_report") and chat.model.fetcher is not None:
        report["flash"] = chat.model.flash_report(since=chat.steps_before)
    return report


def converse(chat: Chat, max_tokens: int, sample: Callable, read=input, out=None) -> None:
    """The chat loop: a line read, the reply streamed; /reset, /stats, /help and /exit as HELP says."""
    out = out or sys.stdout
    out.write(f"{HELP}.\n")
    while True:
        try:
            line = read(">> ")
        except EOFError:
            out.write("\n")
            return
        command = line.strip()
        if command in ("/exit", "/quit"):
            return
        if command == "/reset":
            chat.reset()
            out.write("(the conversation is forgotten)\n")
        elif command == "/stats":
            report = turn_report(chat)
            if report is None:
                out.write("(no turn yet)\n")
            else:
                print_report(report, out)
                out.write(f"KV cache: {report['cached_tokens']} tokens of {chat.context}\n")
        elif command in ("/help", "/?"):
            out.write(f"{HELP}.\n")
        elif command:
            try:
                for response in chat.say(line, max_tokens, sample):
                    out.write(response.text)
                    out.flush()
            except LsparseError as e:  # a conversation past the context: the turn is taken back
                out.write(f"error: {e} (/reset starts again)")
            out.write("\n")
