"""Generation: one response per token with its costs, counts as mlx-lm counts them, and streamed text that
equals the whole decode while each step decodes only a few tokens."""

from __future__ import annotations

import numpy as np
import pytest

from lsparse.runtime.generate import StreamingDetokenizer, stream_generate
from lsparse.runtime.sampling import make_sampler
from lsparse.source import resolve
from lsparse.source.tokenizer import sentencepiece
from tests.conftest import shared_file

TEXT = "Once upon a time, naïve café — 東京 🚀 there was a cat.\nIt sat on the mat. The end."


class Counting:
    """A tokenizer whose decode calls are counted by the tokens each was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.sizes = tokenizer, []

    def decode(self, ids):
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids)


@pytest.mark.parametrize("kind", ["sentencepiece", "tokenizer.json"])
def test_streamed_text_is_the_whole_decode_in_constant_work_per_token(kind):
    tok = sentencepiece(shared_file("stories260K/tok512.model")) if kind == "sentencepiece" \
        else resolve("builtin:tinystories-reglu").tokenizer
    ids = tok.encode(TEXT * 4, add_special_tokens=False)
    counting = Counting(tok)
    stream = StreamingDetokenizer(counting)
    text = "".join(stream.add(t) for t in ids) + stream.flush()
    assert text == tok.decode(ids) and len(ids) > 100
    assert max(counting.sizes) <= 8  # a split character's bytes at most, never the whole list


def test_each_token_is_a_response_with_its_cost():
    import tempfile

    from lsparse.image.compile import CompileOptions, compile_image
    from lsparse.runtime.load import load_image
    with tempfile.TemporaryDirectory() as tmp:
        compile_image("builtin:tinystories-reglu", f"{tmp}/image", CompileOptions(predictor="svd", calib_tokens=1024))
        model, tok = load_image(f"{tmp}/image", mode="exact", context=64)
        prompt = tok.encode("Once upon a time")
        responses = list(stream_generate(model, tok, prompt, 12, make_sampler()))
        model.close()
    assert [r.generation_tokens for r in responses] == list(range(1, len(responses) + 1))
    assert responses[-1].finish_reason in ("stop", "length") and all(r.finish_reason is None for r in responses[:-1])
    assert all(r.cost is not None and r.cost.lookups > 0 for r in responses[:-1])
    assert all(r.prompt_tokens == len(prompt) and r.peak_memory > 0 for r in responses)
    for r in responses:  # the sampled token is the most likely one, and its log-probabilities are normalised
        assert r.token == int(np.argmax(r.logprobs)) and np.exp(r.logprobs).sum() == pytest.approx(1.0)


def test_an_end_token_counts_as_mlx_lm_counts_it():
    """mlx-lm's last response on an end token counts that token; its text is empty."""
    checkpoint = resolve("builtin:tinystories-reglu")
    from lsparse.model import load_model
    model = load_model(checkpoint, "numpy")
    tok = checkpoint.tokenizer
    prompt = tok.encode("Once upon a time")
    free = list(stream_generate(model, tok, prompt, 40, make_sampler(), stop_ids=set()))
    stop = free[5].token
    ended = list(stream_generate(model, tok, prompt, 40, make_sampler(), stop_ids={stop}))
    first = next(i for i, r in enumerate(free) if r.token == stop)
    assert len(ended) == first + 1 and ended[-1].finish_reason == "stop" and ended[-1].text == ""
    assert ended[-1].generation_tokens == first + 1
