"""The checkpoint resolver: local folders (sharded or not), llama2.c files, built-ins, the Hub through a local
stand-in, and the one-line errors for bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from lsparse.errors import LsparseError
from lsparse.model import load_model
from lsparse.source import resolve
from tests.conftest import lsparse, shared_file
from tests.hub_standin import COMMIT, serve_repo
from tests.models import TINY_LLAMA, write_tiny_llama


def test_sharded_folder_reads_like_single_file(tmp_path):
    single = resolve(str(write_tiny_llama(tmp_path / "one")))
    sharded = resolve(str(write_tiny_llama(tmp_path / "three", shards=3)))
    assert sorted(single.tensors.names()) == sorted(sharded.tensors.names())
    for name in single.tensors.names():
        np.testing.assert_array_equal(single.tensors.get(name), sharded.tensors.get(name))
    assert sharded.tensors.shape("model.layers.0.mlp.up_proj.weight") == (128, 32)


def test_bfloat16_tensors_are_read(tmp_path):
    import mlx.core as mx
    folder = write_tiny_llama(tmp_path / "m")
    w = np.arange(6, dtype=np.float32).reshape(2, 3)
    mx.save_safetensors(str(folder / "extra.safetensors"), {"extra.weight": mx.array(w).astype(mx.bfloat16)})
    np.testing.assert_array_equal(resolve(str(folder)).tensors.get("extra.weight"), w)


def test_llama2c_file_is_recognised(tmp_path):
    checkpoint = resolve(str(shared_file("stories260K/stories260K.bin")))
    assert checkpoint.config["num_hidden_layers"] == 5 and checkpoint.config["tie_word_embeddings"]
    assert checkpoint.tensors.shape("model.layers.4.mlp.down_proj.weight") == (64, 172)
    truncated = tmp_path / "truncated.bin"
    truncated.write_bytes(shared_file("stories260K/stories260K.bin").read_bytes()[:-4])
    with pytest.raises(LsparseError, match="not a checkpoint lsparse reads"):
        resolve(str(truncated))


@pytest.mark.parametrize("damage,message", [
    ("truncate", "not a readable safetensors file"),
    ("header", "not a readable safetensors file"),
])
def test_damaged_safetensors_is_one_clear_error(tmp_path, damage, message):
    folder = write_tiny_llama(tmp_path / "m")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 100] if damage == "truncate" else data[:8] + b"{garbage" + data[16:])
    with pytest.raises(LsparseError, match=message):
        load_model(resolve(str(folder)), "numpy")


def test_malformed_config_names_the_file(tmp_path):
    folder = write_tiny_llama(tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    with pytest.raises(LsparseError, match="config.json: malformed JSON"):
        resolve(str(folder))


@pytest.mark.parametrize("change,message", [
    ({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox"},
     "unsupported architecture GPTNeoXForCausalLM .supported: LlamaForCausalLM, MistralForCausalLM, OPTForCausalLM"),
    ({"hidden_act": "gelu"}, "unsupported FFN activation 'gelu' .* .supported: relu, fatrelu, silu, swish, drelu"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "unsupported RoPE scaling 'yarn'"),
])
def test_unsupported_models_name_what_is_supported(tmp_path, change, message):
    folder = write_tiny_llama(tmp_path / "m", {**TINY_LLAMA, **change})
    with pytest.raises(LsparseError, match=message):
        load_model(resolve(str(folder)), "numpy")


def test_missing_tensor_is_named(tmp_path):
    folder = write_tiny_llama(tmp_path / "m")
    (folder / "config.json").write_text(json.dumps({**TINY_LLAMA, "num_hidden_layers": 3}))
    with pytest.raises(LsparseError, match="model.layers.2.* is missing"):
        load_model(resolve(str(folder)), "numpy")


def test_unknown_paths_and_builtins():
    with pytest.raises(LsparseError, match="no such file or folder"):
        resolve("./does/not/exist")
    with pytest.raises(LsparseError, match="no built-in model 'nope'"):
        resolve("builtin:nope")


def test_hub_download_through_a_local_standin(tmp_path):
    repo = write_tiny_llama(tmp_path / "repo", tokenizer=shared_file("stories260K/tok512.model"))
    (repo / "pytorch_model.bin").write_bytes(b"not wanted")  # a duplicate that must not be fetched
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_TOKEN": "hf_secret", "HF_HUB_DISABLE_TELEMETRY": "1"}
    with serve_repo(repo, revisions=("main", "v1")) as (endpoint, log):
        result = lsparse("inspect", "org/model", "--revision", "v1", "--json", env={**env, "HF_ENDPOINT": endpoint})
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["args"]["num_hidden_layers"] == 2 and summary["tokenizer"]["vocab_size"] == 512
    snapshot = tmp_path / "hf" / "hub" / "models--org--model" / "snapshots" / COMMIT
    assert sorted(p.name for p in snapshot.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model"]
    assert any("/revision/v1" in path for _, path, _ in log)
    fetched = [auth for method, path, auth in log if "/resolve/" in path]
    assert fetched and all(auth == "Bearer hf_secret" for auth in fetched)

    # Offline afterwards: the cache serves the same revision.
    offline = lsparse("inspect", "org/model", "--revision", "v1", "--json",
                      env={**env, "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert offline.returncode == 0, offline.stderr


def test_unreachable_hub_is_one_line_and_suggests_a_local_path(tmp_path):
    result = lsparse("run", "--dense", "org/model", env={"HF_HOME": str(tmp_path / "hf"),
                                                          "HF_ENDPOINT": "http://127.0.0.1:9"})
    assert result.returncode == 1
    assert result.stderr.startswith("error: cannot reach the Hugging Face Hub to fetch org/model")
    assert "local folder" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unknown_repo_on_the_hub(tmp_path):
    with serve_repo(write_tiny_llama(tmp_path / "repo")) as (endpoint, _):
        result = lsparse("inspect", "org/other", env={"HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": endpoint})
    assert result.returncode == 1 and "no such repository" in result.stderr


def test_tensors_lsparse_would_not_use_are_refused_not_dropped(tmp_path):
    """A Llama with mlp_bias decodes wrong without its FFN biases: refused by name, in dense mode and compile."""
    from safetensors.numpy import save_file
    folder = write_tiny_llama(tmp_path / "m", tokenizer=shared_file("stories260K/tok512.model"))
    save_file({"model.layers.0.mlp.up_proj.bias": np.zeros(128, np.float32)}, str(folder / "extra.safetensors"))
    for args in (["run", "--dense", str(folder), "-m", "2"], ["compile", str(folder), "-o", str(tmp_path / "i")]):
        done = lsparse(*args)
        assert done.returncode == 1 and "model.layers.0.mlp.up_proj.bias" in done.stderr, done.stderr
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "mlp_bias": True}))
    done = lsparse("run", "--dense", str(folder), "-m", "2")
    assert done.returncode == 1 and "mlp_bias" in done.stderr and "Traceback" not in done.stderr


def test_a_llama2c_header_claiming_huge_sizes_is_refused_by_its_file_size(tmp_path):
    import time
    path = tmp_path / "huge.bin"
    path.write_bytes(np.array([64, 172, 2**31 - 1, 8, 4, 512, 512], dtype=np.int32).tobytes())
    start = time.perf_counter()
    with pytest.raises(LsparseError, match="not a checkpoint lsparse reads"):
        resolve(str(path))
    assert time.perf_counter() - start < 1  # refused from its size, with nothing built from the header


def test_the_llama2c_size_rule_is_the_layouts():
    from lsparse.source.llama2c import _floats, _layout
    for header in [(64, 172, 5, 8, 4, 512, 512), (48, 128, 3, 6, 2, -100, 64)]:
        shapes = _layout(*header[:5], abs(header[5]), header[6], header[5] > 0)
        assert _floats(*header) == sum(int(np.prod(s)) for _, s in shapes)
