"""The Python API (lsparse/__init__.py, docs/API.md): the page's sweep example run as written, and load,
generate and stream_generate against the command line's own results."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import lsparse
from tests.conftest import REPO, smollm2_path
from tests.conftest import lsparse as lsparse_cli


@pytest.mark.slow  # compiles the built-in model and decodes it three times: about 45 s
def test_the_api_pages_sweep_runs_as_written(tmp_path):
    page = (REPO / "docs" / "API.md").read_text()
    example = re.search(r"## A sweep.*?```python\n(.*?)```", page, re.S).group(1)
    done = subprocess.run([sys.executable, "-c", example], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    header, *rows = done.stdout.strip().splitlines()
    assert header.split() == ["budget", "MB", "tok/s", "KB", "read/token", "peak", "MB"]
    table = [[float(v) for v in row.split()] for row in rows]
    assert len(table) == 3
    budgets = [row[0] for row in table]
    assert budgets == sorted(budgets) and budgets[0] < budgets[-1]
    assert all(row[1] > 0 for row in table)
    assert table[-1][2] <= table[0][2]  # a larger neuron cache never reads more for the same tokens


def test_generate_gives_the_text_lsparse_run_prints():
    path = str(smollm2_path())
    model, tokenizer = lsparse.load(path, backend="numpy")
    prompt = tokenizer.encode_prompt("What is the capital of France?")
    text = lsparse.generate(model, tokenizer, prompt, max_tokens=24)
    ran = lsparse_cli("run", path, "--dense", "--backend", "numpy", "-p", "What is the capital of France?",
                      "-m", "24", "--json")
    assert ran.returncode == 0, ran.stderr
    assert text == json.loads(ran.stdout)["text"] and "Paris" in text
    responses = list(lsparse.stream_generate(model, tokenizer, prompt, max_tokens=24))
    assert "".join(r.text for r in responses) == text
    assert responses[-1].finish_reason == "stop" and responses[-1].generation_tokens == len(responses)
