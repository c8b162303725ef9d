"""Text as lsparse measures and calibrates on it: files of documents cut into token windows."""

from __future__ import annotations

from pathlib import Path

from lsparse.errors import LsparseError

DOCUMENT_SEPARATOR = "<|endoftext|>"  # TinyStories' separator; other files are one document


def read_documents(path: Path) -> list[str]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise LsparseError(f"{path}: cannot read text ({e})") from None
    return [d.strip() for d in text.split(DOCUMENT_SEPARATOR) if d.strip()]


def token_windows(tokenizer, documents: list[str], window: int) -> list[list[int]]:
    """Each document encoded (with BOS where the tokenizer adds one) and cut into windows of at most
    `window` tokens; every window after the first starts without BOS, as in llama.cpp's perplexity."""
    windows = []
    for doc in documents:
        ids = tokenizer.encode(doc)
        windows += [ids[i:i + window] for i in range(0, len(ids), window) if len(ids[i:i + window]) > 1]
    return windows


def limit_tokens(windows: list[list[int]], tokens: int) -> list[list[int]]:
    """The first windows, the last one cut, holding at most `tokens` tokens; windows too short to predict
    anything from are dropped."""
    out, total = [], 0
    for w in windows:
        if total >= tokens:
            break
        out.append(w[: tokens - total])
        total += len(out[-1])
    return [w for w in out if len(w) > 1]
