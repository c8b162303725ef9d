"""The command line as users and scripts meet it: help, dense runs, --json, and one-line errors."""

from __future__ import annotations

import json

import pytest

from tests.conftest import lsparse, shared_file
from tests.models import write_tiny_llama


def test_help_lists_the_commands():
    result = lsparse("--help")
    assert result.returncode == 0
    for command in ("compile", "run", "bench", "inspect"):
        assert command in result.stdout


def test_bench_refuses_what_is_not_an_image_in_one_line(tmp_path):
    result = lsparse("bench", str(tmp_path), "--text", "x.txt")
    assert result.returncode == 1
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1


def test_dense_run_json_is_greedy_and_reproducible():
    model = str(shared_file("stories260K/stories260K.bin"))
    first = lsparse("run", "--dense", model, "-p", "Once upon a time", "-m", "40", "--json")
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["generated_tokens"] == len(out["tokens"]) == 40
    assert out["text"].startswith(", there was a little girl")
    assert out["generation_tps"] > 0 and out["peak_memory_bytes"] > 0
    again = json.loads(lsparse("run", "--dense", model, "-p", "Once upon a time", "-m", "40", "--json").stdout)
    assert again["tokens"] == out["tokens"]


def test_dense_run_streams_text_and_prints_the_summary():
    result = lsparse("run", "--dense", str(shared_file("stories260K/stories260K.bin")), "-m", "20",
                     "--temp", "0.8", "--top-p", "0.9", "--seed", "3")
    assert result.returncode == 0, result.stderr
    assert "Generation: 20 tokens" in result.stdout and "Peak memory:" in result.stdout


def test_prompt_longer_than_the_context(tmp_path):
    folder = write_tiny_llama(tmp_path / "m", tokenizer=shared_file("stories260K/tok512.model"))
    result = lsparse("run", "--dense", str(folder), "-p", "word " * 200)
    assert result.returncode == 1
    assert result.stderr.startswith("error: the prompt is") and "context is 64 tokens" in result.stderr
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback():
    result = lsparse("--debug", "run", "--dense", "./missing")
    assert result.returncode != 0 and "Traceback" in result.stderr


@pytest.mark.parametrize("args,message", [
    (["run", "--dense", "./missing"], "error: ./missing: no such file or folder"),
    (["run", "--dense", "builtin:none"], "error: no built-in model 'none'"),
    (["inspect", "./missing"], "error: ./missing: no such file or folder"),
])
def test_bad_input_is_one_line(args, message):
    result = lsparse(*args)
    assert result.returncode == 1
    assert result.stderr.strip() == result.stderr.strip().splitlines()[0]
    assert result.stderr.startswith(message)


def test_inspect_json_counts_parameters(tmp_path):
    folder = write_tiny_llama(tmp_path / "m")
    summary = json.loads(lsparse("inspect", str(folder), "--json").stdout)
    d, f, layers = 32, 128, 2
    assert summary["parameters_by_component"]["ffn"] == layers * 3 * d * f
    assert summary["parameters"] == sum(summary["parameters_by_component"].values())
