"""The real stories260K, read from its llama2.c file, must generate what llama2.c itself generates."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from lsparse.model import load_model
from lsparse.source import resolve
from tests.conftest import shared_file

FIXTURE = Path(__file__).parent / "data" / "stories260k_llama2c_greedy.txt"  # how it was made: data/README.md


@pytest.mark.parametrize("backend", ["numpy", "mlx"])
def test_greedy_200_steps_match_llama2c(backend):
    checkpoint = resolve(str(shared_file("stories260K/stories260K.bin")))
    model = load_model(checkpoint, backend)
    cache = model.make_cache(200)
    token, generated = checkpoint.tokenizer.bos_id, []
    for _ in range(199):  # llama2.c's 200 steps: the BOS position, then 199 sampled tokens
        token = int(np.argmax(np.array(model([token], cache))[-1]))
        generated.append(token)
    expected = [int(t) for t in FIXTURE.read_text().split()]
    assert generated == expected
    assert checkpoint.tokenizer.decode(generated).startswith("Once upon a time, there was a little girl named Lily.")


def test_prefill_equals_step_by_step():
    """A prompt processed at once must give the logits of the same tokens fed one by one."""
    model = load_model(resolve(str(shared_file("stories260K/stories260K.bin"))), "numpy")
    tokens = [1, 403, 407, 261, 378, 432, 383, 286]
    whole = model(tokens, model.make_cache(16))
    cache = model.make_cache(16)
    one_by_one = np.concatenate([model([t], cache) for t in tokens])
    np.testing.assert_allclose(whole, one_by_one, atol=1e-4)
