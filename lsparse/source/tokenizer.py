"""Tokenizers of the three kinds checkpoints ship: tokenizer.json, GPT-2 style vocab.json + merges.txt,
and SentencePiece models (llama2.c's stories models)."""

from __future__ import annotations

import json
import shutil
import signal
from contextlib import contextmanager
from pathlib import Path

from lsparse.errors import LsparseError
from lsparse.source.checkpoint import read_json


class Tokenizer:
    """encode/decode plus the special tokens and chat template that generation needs."""

    def __init__(self, encode_fn, decode_fn, vocab_size: int, bos_id: int | None, eos_ids: set[int],
                 add_bos: bool, chat_template: str | None = None, special: dict[str, str] | None = None,
                 save_fn=None, special_texts: frozenset[str] = frozenset()):
        self._encode = encode_fn  # (text, parse_special) -> ids
        self._decode = decode_fn
        self._save = save_fn
        self.vocab_size = vocab_size
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.special = special or {}
        self.special_texts = special_texts  # the text of every control token the encoder would parse

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of `text`, BOS first where the model wants one (`add_special_tokens`). Text that spells a
        special token (`<|im_start|>`) becomes that control token only with `parse_special`."""
        ids = list(self._encode(text, parse_special))
        if add_special_tokens and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids.insert(0, self.bos_id)
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._decode(list(ids))

    def save(self, folder: Path) -> None:
        """Write the tokenizer into a folder that `from_folder` reads back (a compiled image carries one)."""
        self._save(folder)
        config = {**self.special, "add_bos_token": self.add_bos}
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")

    def encode_prompt(self, prompt: str, chat: bool = True, allow_special: bool = False) -> list[int]:
        """A user's prompt as the model should see it: through the chat template as one user turn where the
        tokenizer has one and `chat`, else as plain text. Special-token text the user wrote stays text unless
        `allow_special` (llama.cpp's default)."""
        if chat and self.chat_template is not None:
            return self.encode_messages([{"role": "user", "content": prompt}], allow_special)
        return self.encode(prompt, parse_special=allow_special)

    def encode_messages(self, messages: list[dict], allow_special: bool = False) -> list[int]:
        """A conversation through the chat template, ending where the assistant's next turn begins. The
        template's own control tokens are parsed; the messages' text is parsed only with `allow_special`."""
        contents = [m["content"] for m in messages]
        if allow_special or not any(t in c for c in contents for t in self.special_texts):
            # The template writes the BOS token itself where the model wants one.
            return self.encode(self.apply_chat_template(messages), add_special_tokens=False)
        marks = [f"\x00{i}\x00" for i in range(len(messages))]  # where each message's text goes
        rendered = self.apply_chat_template([{**m, "content": mark} for m, mark in zip(messages, marks, strict=True)])
        if any(rendered.count(mark) != 1 for mark in marks):
            raise LsparseError("the chat template changes the messages' text, so special-token text in them "
                               "cannot be kept as text; pass --allow-special to let it become control tokens")
        ids = []
        for mark, content in zip(marks, contents, strict=True):
            template_text, rendered = rendered.split(mark)
            ids += self.encode(template_text, add_special_tokens=False) + \
                self.encode(content, add_special_tokens=False, parse_special=False)
        return ids + self.encode(rendered, add_special_tokens=False)

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.chat_template is None:
            raise LsparseError("this tokenizer has no chat template")
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        try:
            with time_limit(TEMPLATE_SECONDS, "the chat template"):
                return env.from_string(self.chat_template).render(
                    messages=messages, add_generation_prompt=True,
                    bos_token=self.special.get("bos_token", ""), eos_token=self.special.get("eos_token", ""))
        except TemplateError as e:
            raise LsparseError(f"the chat template failed: {e}") from None


TEMPLATE_SECONDS = 2.0  # a real template renders in milliseconds; a template that loops for ever must not hang


@contextmanager
def time_limit(seconds: float, what: str):
    """An LsparseError if the block runs longer than `seconds` (a timer signal; in the main thread only, where
    Python runs signal handlers, and only where the OS has interval timers)."""
    import threading
    if not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expired(signum, frame):
        raise LsparseError(f"{what} ran for more than {seconds:g} s; refused")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _token_text(value) -> str | None:
    """Special tokens appear in tokenizer_config.json as strings or as {"content": ...} objects."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def from_folder(folder: Path, config: dict) -> Tokenizer | None:
    """The tokenizer of a Hugging Face layout folder, or None when it ships none."""
    tok_config = read_json(folder / "tokenizer_config.json") if (folder / "tokenizer_config.json").exists() else {}
    special = {k: _token_text(tok_config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
    special = {k: v for k, v in special.items() if v}
    chat_template = tok_config.get("chat_template")
    if isinstance(chat_template, list):  # a list of named templates: take the default one
        chat_template = next((t["template"] for t in chat_template if t.get("name") == "default"), None)
    if chat_template is None and (folder / "chat_template.jinja").exists():
        chat_template = (folder / "chat_template.jinja").read_text(encoding="utf-8")

    if (folder / "tokenizer.json").exists():
        from tokenizers import Tokenizer as HFTokenizer
        try:
            hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise LsparseError(f"{folder / 'tokenizer.json'}: not a readable tokenizer ({e})") from None
        # tokenizer.json's post-processor adds BOS where the model wants one, as in transformers; an
        # add_bos_token in tokenizer_config.json adds it where the post-processor does not.
        return wrap_hf(hf, config, special, chat_template, add_bos=bool(tok_config.get("add_bos_token", False)),
                       post_processor_adds=True)
    if (folder / "vocab.json").exists() and (folder / "merges.txt").exists():
        from tokenizers import models
        try:
            vocab, merges = models.BPE.read_file(str(folder / "vocab.json"), str(folder / "merges.txt"))
        except Exception as e:
            raise LsparseError(f"{folder}: unreadable vocab.json/merges.txt ({e})") from None
        hf = byte_level_bpe(vocab, merges, specials=list(special.values()))
        return wrap_hf(hf, config, special, chat_template, add_bos=bool(tok_config.get("add_bos_token", True)))
    if (folder / "tokenizer.model").exists():
        return sentencepiece(folder / "tokenizer.model", chat_template=chat_template)
    return None


def wrap_hf(hf, config: dict, special: dict, chat_template: str | None, add_bos: bool,
            post_processor_adds: bool = False) -> Tokenizer:
    """A `tokenizers.Tokenizer` with the special tokens a config names."""
    def token_id(text):
        return hf.token_to_id(text) if text else None

    bos_id = config.get("bos_token_id", token_id(special.get("bos_token")))
    eos = config.get("eos_token_id", token_id(special.get("eos_token")))
    eos_ids = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())

    def encode(text, parse_special=True):
        hf.encode_special_tokens = not parse_special
        return hf.encode(text, add_special_tokens=post_processor_adds).ids

    specials = frozenset(t.content for t in hf.get_added_tokens_decoder().values() if t.special)
    return Tokenizer(encode, lambda ids: hf.decode(ids, skip_special_tokens=True), hf.get_vocab_size(),
                     bos_id, eos_ids, add_bos, chat_template, special,
                     save_fn=lambda folder: hf.save(str(folder / "tokenizer.json")), special_texts=specials)


def byte_level_bpe(vocab: dict[str, int], merges: list[tuple[str, str]], specials: list[str] = (),
                   digits_apart: bool = False):
    """GPT-2's byte-level BPE (also OPT's and SmolLM2's); `digits_apart` splits numbers into single digits
    first, as SmolLM2's tokenizer does."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    hf = HFTokenizer(models.BPE(vocab, merges))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                        if digits_apart else byte_level)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(list(specials))
    return hf


def sentencepiece(path: Path, chat_template: str | None = None) -> Tokenizer:
    import sentencepiece as spm
    try:
        sp = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError) as e:
        raise LsparseError(f"{path}: not a SentencePiece model ({e})") from None
    bos = sp.bos_id() if sp.bos_id() >= 0 else None
    eos = {sp.eos_id()} if sp.eos_id() >= 0 else set()
    special = {"bos_token": sp.id_to_piece(bos) if bos is not None else "",
               "eos_token": sp.id_to_piece(sp.eos_id()) if eos else ""}
    return Tokenizer(lambda text, parse_special=True: sp.encode(text), lambda ids: sp.decode(ids), sp.get_piece_size(),
                     bos, eos, add_bos=True, chat_template=chat_template, special=special,
                     save_fn=lambda folder: shutil.copyfile(path, folder / "tokenizer.model"))
