"""Checkpoints in Hugging Face layout: a local folder, or a repo id fetched from the Hub into its cache."""

from __future__ import annotations

import warnings
from pathlib import Path

from lsparse.errors import LsparseError
from lsparse.source.checkpoint import Checkpoint, read_json
from lsparse.source.safetensors_store import SafetensorsStore
from lsparse.source.tokenizer import from_folder as tokenizer_from_folder

# Only what lsparse reads: never the *.bin / *.pth / *.gguf duplicates many repos also carry.
HUB_FILES = [
    "config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "chat_template.jinja",
]


def open_folder(folder: Path) -> Checkpoint:
    if not (folder / "config.json").exists():
        raise LsparseError(f"{folder}: no config.json (expected a Hugging Face layout folder)")
    config = read_json(folder / "config.json")
    return Checkpoint(config, SafetensorsStore.from_folder(folder), tokenizer_from_folder(folder, config),
                      str(folder))


def download(repo_id: str, revision: str | None = None) -> Path:
    """Fetch a repo into the Hugging Face cache (HF_HOME, HF_ENDPOINT and HF_TOKEN are honoured as
    huggingface_hub honours them) and return its snapshot folder."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from rich.console import Console
    from tqdm import TqdmExperimentalWarning
    from tqdm.rich import tqdm as rich_tqdm

    stderr = Console(stderr=True)

    class Progress(rich_tqdm):
        """tqdm's interface, drawn by rich on stderr, so that stdout stays clean for --json."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, options={"console": stderr}, **kwargs)

    where = f"{repo_id}" + (f"@{revision}" if revision else "")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", TqdmExperimentalWarning)
            return Path(snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES,
                                          tqdm_class=Progress))
    except GatedRepoError:
        raise LsparseError(f"{where} is gated: accept its licence on the Hub and set HF_TOKEN") from None
    except RevisionNotFoundError:
        raise LsparseError(f"{where}: no such revision on the Hugging Face Hub") from None
    except RepositoryNotFoundError:
        raise LsparseError(f"{repo_id}: no such repository on the Hugging Face Hub (or it is private: "
                           "set HF_TOKEN)") from None
    except HFValidationError as e:
        raise LsparseError(f"{repo_id!r} is neither a local path nor a valid repo id ({e})") from None
    except (LocalEntryNotFoundError, OSError) as e:
        # The hub could not be reached and the cache does not hold the snapshot.
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise LsparseError(f"cannot reach the Hugging Face Hub to fetch {where} ({reason}); "
                           "download it elsewhere and pass its local folder instead") from None
