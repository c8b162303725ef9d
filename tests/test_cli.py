"""The command line as users and scripts meet it: help, dense runs, --json, and one-line errors."""

from __future__ import annotations

import json

import pytest

from tests.conftest import lsparse, shared_file, smollm2_path
from tests.models import write_tiny_llama


def test_help_lists_the_commands():
    result = lsparse("--help")
    assert result.returncode == 0
    for command in ("compile", "run", "chat", "bench", "inspect"):
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


def test_the_summary_reads_as_mlx_lm_prints_it():
    """The text between ========== lines, then the counts; an end token counts as a generated token, as in
    mlx-lm's stream_generate (its last response at an end token reports n + 1 tokens)."""
    args = ["run", str(smollm2_path()), "--dense", "-p", "What is the capital of France?", "-m", "40"]
    shown = lsparse(*args)
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("==========\n")
    text, summary = shown.stdout[len("==========\n"):].split("\n==========\n")
    assert "Paris" in text
    ran = json.loads(lsparse(*args, "--json").stdout)
    assert ran["finish_reason"] == "stop" and ran["generated_tokens"] == len(ran["tokens"]) + 1
    assert summary.splitlines()[1] == f"Generation: {ran['generated_tokens']} tokens, " + \
        summary.splitlines()[1].split(" tokens, ")[1]
    assert "Peak memory" in lsparse("run", "--help").stdout and "peak resident memory" in \
        " ".join(lsparse("run", "--help").stdout.split())


def test_the_prompt_from_standard_input_and_from_a_file(tmp_path):
    model = str(shared_file("stories260K/stories260K.bin"))
    given = json.loads(lsparse("run", "--dense", model, "-p", "Once upon a time", "-m", "8", "--json").stdout)
    piped = lsparse("run", "--dense", model, "-p", "-", "-m", "8", "--json", input="Once upon a time")
    assert piped.returncode == 0, piped.stderr
    (tmp_path / "prompt.txt").write_text("Once upon a time")
    from_file = lsparse("run", "--dense", model, "--prompt-file", str(tmp_path / "prompt.txt"), "-m", "8", "--json")
    assert json.loads(piped.stdout)["tokens"] == json.loads(from_file.stdout)["tokens"] == given["tokens"]
    both = lsparse("run", "--dense", model, "-p", "x", "--prompt-file", str(tmp_path / "prompt.txt"))
    assert both.returncode == 1 and both.stderr.startswith("error: give the prompt with --prompt or")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    bad = lsparse("run", "--dense", model, "--prompt-file", str(tmp_path / "latin1.txt"))
    assert bad.returncode == 1 and "not valid UTF-8" in bad.stderr


def test_special_token_text_in_a_prompt_stays_text_unless_allowed():
    args = ["run", str(smollm2_path()), "--dense", "-m", "1", "--json", "--ignore-chat-template",
            "-p", "<|im_start|>user"]
    as_text = json.loads(lsparse(*args).stdout)
    as_control = json.loads(lsparse(*args, "--allow-special").stdout)
    assert as_control["prompt_tokens"] == 2  # <|im_start|> and "user"
    assert as_text["prompt_tokens"] > as_control["prompt_tokens"]
