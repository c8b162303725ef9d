"""lsparse against llama.cpp, end to end at a few layers: both decode under the same hard caps. Skips, saying
why, where llama-cpp-python or the cgroup memory controller is absent (LSPARSE_LLAMA_PYTHON names a Python
that has llama-cpp-python, when this one has not)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.conftest import lsparse


def llama_python() -> str:
    from lsparse.bench import memcap
    from lsparse.bench.peer import llama_cpp_params_supported
    python = os.environ.get("LSPARSE_LLAMA_PYTHON", sys.executable)
    if not llama_cpp_params_supported(python):
        pytest.skip(f"{python} has no llama-cpp-python (pip install 'lsparse[peer]', or set LSPARSE_LLAMA_PYTHON)")
    if not memcap.available():
        pytest.skip("hard memory caps need root and the cgroup v1 memory controller")
    return python


@pytest.mark.slow
def test_both_decode_under_the_same_caps(tmp_path):
    python = llama_python()
    done = lsparse("bench", "synthetic:llama-2-7b", "--against", "llama.cpp", "--layers", "2", "--budgets", "3,2",
                   "--tokens", "6", "--rounds", "1", "--llama-python", python, "--variants", str(tmp_path),
                   "--json", "--csv", str(tmp_path / "rows.csv"), "--plot", str(tmp_path / "plot.png"), timeout=1800)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    capped = [r for r in result["rows"] if r["cap_bytes"]]
    assert {r["engine"] for r in capped} == {"lsparse", "llama.cpp (mmap)"} and len(capped) == 4
    for r in capped:
        assert r["failed"] is None and r["tokens_per_second"] > 0, r
        assert r["peak_bytes"] <= r["cap_bytes"]
    for r in capped:  # the kernel's count of lsparse's reads holds at least its reader's own
        if r["engine"] == "lsparse":
            assert r["bytes_read_per_token"] >= r["neuron_bytes_per_token"] > 0
    assert (tmp_path / "rows.csv").read_text().count("\n") == len(result["rows"]) + 1
    assert (tmp_path / "plot.png").stat().st_size > 0
