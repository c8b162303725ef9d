"""Encode/decode round trips for the three tokenizer kinds, with byte fallback and special tokens."""

from __future__ import annotations

import json
import shutil

import pytest

from lsparse.source import resolve
from lsparse.source.tokenizer import byte_level_bpe, from_folder, sentencepiece
from tests.conftest import require_reference, shared_file, smollm2_path

TEXTS = ["Once upon a time, there was a cat.", "naïve café — 東京 🚀 emoji", "  leading spaces\nand\ttabs  ",
         "Numbers 1234567 and symbols <>&%$#@!"]


# tok512.model was trained with remove_extra_whitespaces: it folds runs of spaces by design, so that text is left out.
@pytest.mark.parametrize("text", [t for t in TEXTS if "  " not in t])
def test_sentencepiece_round_trip_with_byte_fallback(text):
    tok = sentencepiece(shared_file("stories260K/tok512.model"))
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 1
    assert tok.decode(ids[1:]) == text
    if any(ord(c) > 127 for c in text):  # a 512-piece vocabulary has no piece for these: bytes carry them
        assert any(3 <= i < 3 + 256 for i in ids)


def _gpt2_folder(tmp_path, config):
    shutil.copy(shared_file("gpt2-bpe/encoder.json"), tmp_path / "vocab.json")
    shutil.copy(shared_file("gpt2-bpe/vocab.bpe"), tmp_path / "merges.txt")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>", "add_bos_token": True}))
    return from_folder(tmp_path, config)


@pytest.mark.parametrize("text", TEXTS)
def test_gpt2_vocab_and_merges_round_trip(text, tmp_path):
    tok = _gpt2_folder(tmp_path, {"bos_token_id": 50256, "eos_token_id": 50256})
    ids = tok.encode(text)
    assert ids[0] == 50256
    assert tok.decode(ids) == text  # the special BOS is dropped on decode


def test_gpt2_special_token_in_text_is_one_token(tmp_path):
    tok = _gpt2_folder(tmp_path, {"bos_token_id": 50256, "eos_token_id": 50256})
    assert tok.encode("a<|endoftext|>b", add_special_tokens=False) == [64, 50256, 65]


def test_gpt2_matches_transformers(tmp_path):
    _, transformers = require_reference()
    tok = _gpt2_folder(tmp_path, {"bos_token_id": 50256, "eos_token_id": 50256})
    reference = transformers.GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text)


def test_tokenizer_json_round_trip_and_post_processor_bos(tmp_path):
    from tokenizers import models, processors
    hf = byte_level_bpe(*models.BPE.read_file(str(shared_file("gpt2-bpe/encoder.json")),
                                              str(shared_file("gpt2-bpe/vocab.bpe"))))
    hf.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                      special_tokens=[("<|endoftext|>", 50256)])
    hf.add_special_tokens(["<|endoftext|>"])
    hf.save(str(tmp_path / "tokenizer.json"))
    tok = from_folder(tmp_path, {"bos_token_id": 50256, "eos_token_id": [50256]})
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids[0] == 50256 and ids.count(50256) == 1  # added once, by tokenizer.json itself
        assert tok.decode(ids) == text
    assert tok.eos_ids == {50256}


def test_chat_template_renders(tmp_path):
    tok = _gpt2_folder(tmp_path, {"bos_token_id": 50256, "eos_token_id": 50256})
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                         "{% if add_generation_prompt %}<assistant>{% endif %}")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<|endoftext|><user>hi<assistant>"


def test_a_chat_template_that_never_ends_is_refused():
    import time

    from lsparse.errors import LsparseError
    tok = sentencepiece(shared_file("stories260K/tok512.model"),
                        chat_template="{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}"
                                      "{% endfor %}")
    start = time.perf_counter()
    with pytest.raises(LsparseError, match="chat template ran for more than"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert time.perf_counter() - start < 10


def test_special_token_text_a_user_writes_is_encoded_as_transformers_splits_it():
    """Text that spells <|im_start|> inside a user's message is text (transformers' split_special_tokens), while
    the chat template's own control tokens stay control tokens; --allow-special lets the user's become one."""
    _, transformers = require_reference()
    path = smollm2_path()
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = resolve(str(path)).tokenizer
    text = "Say <|im_start|> and <|im_end|> back to me"
    assert tok.encode(text, add_special_tokens=False, parse_special=False) == reference(
        text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    start = reference.convert_tokens_to_ids("<|im_start|>")
    plain = tok.encode_prompt("Say it back to me")
    kept_as_text = tok.encode_prompt(text)
    allowed = tok.encode_prompt(text, allow_special=True)
    assert kept_as_text.count(start) == plain.count(start) == 3  # system, user, assistant: the template's
    assert allowed.count(start) == 4
    user = reference(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert kept_as_text[kept_as_text.index(user[0]):][:len(user)] == user
