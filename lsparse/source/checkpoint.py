"""A checkpoint: its config, its tensors read one at a time on demand, and its tokenizer."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from lsparse.errors import LsparseError


class TensorStore(Protocol):
    def names(self) -> list[str]: ...

    def shape(self, name: str) -> tuple[int, ...]: ...

    def get(self, name: str) -> np.ndarray:
        """The tensor as float32, read from disk now: nothing is held between calls."""
        ...


@dataclass
class Checkpoint:
    config: dict
    tensors: TensorStore
    tokenizer: object | None  # lsparse.source.tokenizer.Tokenizer
    location: str


def interleaved_to_half_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Reorder the rows of a q or k projection made for RoPE on adjacent pairs (2j, 2j+1), as llama2.c and
    GGUF store them, into the Hugging Face convention (j, j + head_dim/2), so that one RoPE serves all."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, -1).transpose(0, 2, 1, 3).reshape(w.shape)


def read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise LsparseError(f"{path}: no such file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LsparseError(f"{path}: malformed JSON ({e})") from None
    if not isinstance(value, dict):
        raise LsparseError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value
