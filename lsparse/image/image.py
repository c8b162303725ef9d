"""An image on disk, opened: its validated manifest, its resident tensors, its tokenizer and its neuron file."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from lsparse.errors import LsparseError
from lsparse.image.manifest import MANIFEST, MAX_MANIFEST_BYTES, NEURONS, Manifest


def sha256_file(path: Path, start: int = 0, size: int | None = None) -> str:
    """SHA-256 of `size` bytes of a file from `start` (None: to its end); only regular files are read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        left = size if size is not None else float("inf")
        while left > 0:
            chunk = f.read(int(min(left, 1 << 22)))
            if not chunk:
                break
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


def is_image(path) -> bool:
    return (Path(path) / MANIFEST).is_file()


class Image:
    """`Image.open(path)`: the manifest read and validated once; files read on request."""

    def __init__(self, path: Path, manifest: Manifest):
        self.path, self.manifest = Path(path), manifest
        self.neurons = self.path / NEURONS
        self._checked = False  # check_for_run has passed

    @classmethod
    def open(cls, path) -> "Image":
        path = Path(path)
        if not path.is_dir():
            raise LsparseError(f"{path}: no such image (an image is a directory made by lsparse compile)")
        file = path / MANIFEST
        if not file.is_file():
            raise LsparseError(f"{path}: not an lsparse image (no {MANIFEST})")
        if file.stat().st_size > MAX_MANIFEST_BYTES:
            raise LsparseError(f"{file}: {file.stat().st_size} bytes, more than any image's manifest")
        return cls(path, Manifest.from_json(file.read_bytes(), str(file)))

    def file(self, name: str) -> Path:
        """A file the manifest lists (its name was checked to be a plain name inside the image)."""
        return self.path / name

    def resident(self, name: str, mapped=()) -> dict[str, np.ndarray]:
        """A resident file's tensors ("globals" or "layer-NNN"): bundle bytes as uint8 and checksums as uint64
        as stored, the rest as float32; those named in `mapped` that are stored as bytes mapped from the file
        (SafetensorsFile.mapped), not read."""
        from lsparse.source.safetensors_store import SafetensorsFile
        f = SafetensorsFile(self.file(f"resident/{name}.safetensors"))
        return {t: f.mapped(t) if t in mapped and f.entries[t][0] == "U8" else
                f.get(t, as_float=f.entries[t][0] not in ("U8", "U64")) for t in f.entries}

    def layer_tensors(self, index: int, mapped=()) -> dict[str, np.ndarray]:
        """A layer's resident tensors, those every image has checked against the manifest's shapes."""
        tensors = self.resident(f"layer-{index:03d}", mapped)
        layer, b = self.manifest.layers[index], self.manifest.bundle
        shapes = {"hot_bundles": ((len(layer.hot), self.manifest.hot_bundle.stride), np.uint8),
                  "cold_row_sums": ((layer.region.count, len(b.components)), np.uint64)}
        for name, (shape, dtype) in shapes.items():
            t = tensors.get(name)
            if t is None or t.shape != shape or t.dtype != dtype:
                raise LsparseError(f"{self.path}: resident/layer-{index:03d}.safetensors has no {name} of shape "
                                   f"{shape}: not an image this lsparse wrote (compile it again)")
        return tensors

    def model_bytes(self) -> int:
        """The model as stored, as a user means it when giving a share of it: every weight of the image
        (attention, embeddings, norms, hot and cold bundles), not what lsparse adds (the exact gate's copy,
        predictors, checksums, the tokenizer, the manifest)."""
        from lsparse.source.safetensors_store import SafetensorsFile
        added = {"exact_rows", "cold_row_sums", "A", "B", "bias", "W1", "W2", "b2"}
        resident = 0
        for path in sorted((self.path / "resident").glob("*.safetensors")):
            entries = SafetensorsFile(path).entries
            resident += sum(int(np.prod(shape)) * dtype.itemsize for name, (_, dtype, shape, _) in entries.items()
                            if name not in added)
        return resident + sum(layer.region.size for layer in self.manifest.layers)

    def tokenizer(self):
        from lsparse.source.tokenizer import from_folder
        self.check_for_run()
        tokenizer = from_folder(self.path, self.manifest.config)
        if tokenizer is None:
            raise LsparseError(f"{self.path}: no tokenizer in the image; the image is damaged")
        return tokenizer

    def file_problems(self, hash_neurons: bool) -> list[str]:
        """Missing, truncated or altered files: sizes always, checksums of every file but the neuron file
        unless `hash_neurons` (its regions are checked apart, and hashing gigabytes at every start costs)."""
        problems = []
        for name, entry in self.manifest.files.items():
            path = self.file(name)
            if not path.is_file():
                problems.append(f"{name}: missing")
            elif path.stat().st_size != entry.size:
                problems.append(f"{name}: {path.stat().st_size} bytes, expected {entry.size} (truncated or altered)")
            elif (name != NEURONS or hash_neurons) and sha256_file(path) != entry.sha256:
                problems.append(f"{name}: checksum mismatch (altered)")
        return problems

    def check_for_run(self) -> None:
        """What `run` checks before it trusts an image: every file's size, and every checksum but the neuron
        file's (its rows are checked as they are first read). Once per opened image."""
        if self._checked:
            return
        problems = self.file_problems(hash_neurons=False)
        if problems:
            raise LsparseError(f"{self.path} is damaged: {problems[0]} (lsparse verify tells more)")
        self._checked = True

    def verify(self) -> list[str]:
        """Every problem found: missing, truncated or altered files and neuron regions. Empty when intact."""
        problems = self.file_problems(hash_neurons=True)
        if any(p.startswith(f"{NEURONS}: missing") or "truncated" in p for p in problems):
            return problems
        for layer in self.manifest.layers:
            r = layer.region
            if sha256_file(self.neurons, r.offset, r.size) != r.sha256:
                problems.append(f"layer {layer.index}: neuron region checksum mismatch")
        return problems
