"""Where checkpoints come from: one resolver for every kind of source."""

from __future__ import annotations

import re
from pathlib import Path

from lsparse.errors import LsparseError
from lsparse.source.builtin import builtin_folder
from lsparse.source.checkpoint import Checkpoint
from lsparse.source.gguf_checkpoint import open_gguf
from lsparse.source.hf import download, open_folder
from lsparse.source.llama2c import open_llama2c, read_header

REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve(spec: str, revision: str | None = None, tokenizer: str | None = None) -> Checkpoint:
    """`builtin:NAME`, a local folder in Hugging Face layout, a GGUF file, a llama2.c file, or a Hub repo id."""
    if spec.startswith("builtin:"):
        return open_folder(builtin_folder(spec.removeprefix("builtin:")))
    path = Path(spec).expanduser()
    if path.is_dir():
        return open_folder(path)
    if path.is_file():
        if path.suffix == ".gguf":
            return open_gguf(path)
        if read_header(path) is not None:
            return open_llama2c(path, Path(tokenizer) if tokenizer else None)
        raise LsparseError(f"{path}: not a checkpoint lsparse reads (a Hugging Face folder, a llama2.c .bin "
                           "file, or builtin:NAME)")
    if REPO_ID.match(spec) and not spec.startswith((".", "/", "~")):
        return open_folder(download(spec, revision))
    raise LsparseError(f"{spec}: no such file or folder")


__all__ = ["Checkpoint", "resolve"]
