from __future__ import annotations

import numpy as np
import pytest

from lsparse.errors import LsparseError
from lsparse.runtime.sampling import make_sampler


def test_greedy_takes_the_argmax():
    logits = np.array([0.1, 3.0, -2.0, 2.9])
    assert make_sampler(0.0)(logits) == 1


def test_seed_reproduces_and_temperature_spreads():
    logits = np.zeros(50)
    a = [make_sampler(1.0, seed=7)(logits) for _ in range(1)]
    sampler_a, sampler_b = make_sampler(1.0, seed=7), make_sampler(1.0, seed=7)
    draws_a = [sampler_a(logits) for _ in range(100)]
    assert draws_a == [sampler_b(logits) for _ in range(100)]
    assert len(set(draws_a)) > 20 and a[0] == draws_a[0]


def test_top_p_keeps_only_the_nucleus():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    sampler = make_sampler(1.0, top_p=0.7, seed=0)
    assert {sampler(logits) for _ in range(300)} == {0, 1}


@pytest.mark.parametrize("temp,top_p", [(-1.0, 1.0), (1.0, 0.0), (1.0, 1.5)])
def test_bad_options_are_refused(temp, top_p):
    with pytest.raises(LsparseError):
        make_sampler(temp, top_p)
