"""`lsparse chat` as a user meets it, through a pseudo-terminal: SmolLM2-Instruct through its chat template, the
built-in model (no template) from an image; and the KV cache a conversation keeps, against a fresh one."""

from __future__ import annotations

import os
import re
import select
import subprocess
import time

import numpy as np
import pytest

from lsparse.image.compile import CompileOptions, compile_image
from lsparse.runtime.chat import Chat
from lsparse.runtime.generate import stream_generate
from lsparse.runtime.run import load_checkpoint
from tests.conftest import LSPARSE, smollm2_path

PROMPT = ">> "


class Terminal:
    """A command on a pseudo-terminal: lines typed into it, its output read up to a marker."""

    def __init__(self, *args: str):
        master, slave = os.openpty()
        self.proc = subprocess.Popen([str(LSPARSE), *args], stdin=slave, stdout=slave, stderr=slave,
                                     start_new_session=True, env={**os.environ, "TERM": "dumb"})
        os.close(slave)
        self.fd, self.seen = master, ""

    def expect(self, marker: str, timeout: float = 120) -> str:
        """The output up to `marker` (consumed), or a failure showing what came instead."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.fd], [], [], max(left, 0))
            if not ready:
                pytest.fail(f"no {marker!r} within {timeout} s; the terminal shows:\n{self.seen}")
            try:
                chunk = os.read(self.fd, 4096).decode("utf-8", "replace")
            except OSError:  # the command ended and closed the terminal
                pytest.fail(f"the command ended before {marker!r}; the terminal shows:\n{self.seen}")
            self.seen += chunk.replace("\r\n", "\n")
        before, self.seen = self.seen.split(marker, 1)
        return before

    def say(self, line: str) -> str:
        """Type a line; what the command printed before its next prompt, the echoed line left out."""
        os.write(self.fd, (line + "\n").encode())
        return self.expect(PROMPT).split(line, 1)[-1].strip()

    def close(self) -> int:
        try:
            return self.proc.wait(timeout=60)
        finally:
            os.close(self.fd)


def test_three_turns_with_smollm2_through_a_terminal():
    chat = Terminal("chat", str(smollm2_path()), "--dense", "-m", "32")
    chat.expect(PROMPT)
    assert "Paris" in chat.say("What is the capital of France?")
    assert "Rome" in chat.say("And of Italy?")
    stats = chat.say("/stats")
    fed = int(re.search(r"Prompt: (\d+) tokens", stats).group(1))
    held = int(re.search(r"KV cache: (\d+) tokens", stats).group(1))
    assert "==========" in stats and "Generation:" in stats and "Peak memory:" in stats
    assert 0 < fed < held  # the second turn fed only what the first had not computed
    assert chat.say("Name another city there.")
    os.write(chat.fd, b"/exit\n")
    assert chat.close() == 0


def test_a_turn_from_the_kept_cache_is_the_turn_from_scratch():
    """The second turn, computed on the cache the first left, against the whole conversation computed afresh."""
    model, tok, _, _ = load_checkpoint(str(smollm2_path()), backend="numpy")
    greedy = lambda logprobs: int(np.argmax(logprobs))  # noqa: E731
    chat = Chat(model, tok, 256, system_prompt="You answer in one sentence.")
    list(chat.say("What is the capital of France?", 16, greedy))
    kept = list(chat.say("And of Italy?", 16, greedy))
    conversation = tok.encode_messages(chat.messages[:-1])
    assert conversation[:3] == tok.encode("<|im_start|>system\nYou answer", add_special_tokens=False)[:3]
    assert 0 < chat.fed < len(conversation)
    fresh = list(stream_generate(model, tok, conversation, 16, greedy))
    assert [r.token for r in kept] == [r.token for r in fresh]
    np.testing.assert_allclose(kept[0].logprobs, fresh[0].logprobs, atol=1e-3)


@pytest.fixture(scope="module")
def builtin_image(tmp_path_factory):
    image = tmp_path_factory.mktemp("chat") / "image"
    compile_image("builtin:tinystories-reglu", str(image), CompileOptions(calib_tokens=2048, predictor="svd",
                                                                          rank=16))
    return image


def test_the_builtin_model_continues_its_story_and_forgets_it_on_reset(builtin_image):
    chat = Terminal("chat", str(builtin_image), "--mode", "predicted", "-m", "24")
    chat.expect(PROMPT)
    first = chat.say("Once upon a time")
    assert first
    assert chat.say("The dog said")
    stats = chat.say("/stats")
    assert "Flash:" in stats and "KB read per token" in stats
    assert "forgotten" in chat.say("/reset")
    assert chat.say("Once upon a time") == first  # a fresh conversation: the same greedy story
    os.write(chat.fd, b"\x04")  # Ctrl-D ends it too
    assert chat.close() == 0
