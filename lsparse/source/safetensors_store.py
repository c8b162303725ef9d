"""Tensors of one or more safetensors files (a sharded checkpoint has an index), read one at a time.

The header is parsed here rather than through `safetensors.safe_open`, whose numpy and mlx readers cannot
return bfloat16, the dtype most released checkpoints use. Reading a tensor reads only its own bytes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from lsparse.errors import LsparseError
from lsparse.source.checkpoint import read_json

DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U8": "u1", "U64": "<u8", "BOOL": "?"}
MAX_HEADER = 100 * 2**20


class SafetensorsFile:
    def __init__(self, path: Path):
        self.path = path
        try:
            size = path.stat().st_size
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
                if not 0 < n <= min(size - 8, MAX_HEADER):
                    raise ValueError(f"header length {n} does not fit a file of {size} bytes")
                header = json.loads(f.read(n))
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise LsparseError(f"{path}: not a readable safetensors file ({e})") from None
        self.data_start = 8 + n
        header.pop("__metadata__", None)
        self.entries = {}
        for name, info in header.items():
            try:
                dtype = np.dtype(DTYPES[info["dtype"]])
                shape = tuple(int(d) for d in info["shape"])
                begin, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise LsparseError(f"{path}: not a readable safetensors file (bad entry for {name!r})") from None
            if end - begin != int(np.prod(shape)) * dtype.itemsize or begin < 0:
                raise LsparseError(f"{path}: not a readable safetensors file ({name!r} has inconsistent offsets)")
            if self.data_start + end > size:
                raise LsparseError(f"{path}: not a readable safetensors file (truncated: {name!r} ends at byte "
                                   f"{self.data_start + end}, the file has {size})")
            self.entries[name] = (info["dtype"], dtype, shape, begin)

    def mapped(self, name: str) -> np.ndarray:
        """The tensor in its stored dtype, mapped from the file rather than read: the OS pages it in as it is
        touched and may drop it again (see `mapping_of`)."""
        import mmap
        _, dtype, shape, begin = self.entries[name]
        start = self.data_start + begin
        aligned = start - start % mmap.ALLOCATIONGRANULARITY
        length = start - aligned + int(np.prod(shape)) * dtype.itemsize
        try:
            with open(self.path, "rb") as f:
                mapping = mmap.mmap(f.fileno(), length, offset=aligned, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise LsparseError(f"{self.path}: cannot map tensor {name!r} ({e})") from None
        return np.frombuffer(mapping, dtype=dtype, count=int(np.prod(shape)), offset=start - aligned).reshape(shape)

    def get(self, name: str, as_float: bool = True) -> np.ndarray:
        """The tensor as float32, or with `as_float=False` in its stored dtype (bfloat16 as its raw uint16)."""
        kind, dtype, shape, begin = self.entries[name]
        count = int(np.prod(shape))
        try:
            a = np.fromfile(self.path, dtype=dtype, count=count, offset=self.data_start + begin)
        except OSError as e:
            raise LsparseError(f"{self.path}: cannot read tensor {name!r} ({e})") from None
        if a.size != count:
            raise LsparseError(f"{self.path}: tensor {name!r} is truncated")
        if not as_float:
            return a.reshape(shape)
        if kind == "BF16":
            a = (a.astype(np.uint32) << 16).view(np.float32)
        return a.reshape(shape).astype(np.float32, copy=False)


class SafetensorsStore:
    def __init__(self, files: list[Path]):
        self._file_of: dict[str, SafetensorsFile] = {}
        for path in files:
            f = SafetensorsFile(path)
            self._file_of.update({name: f for name in f.entries})

    @classmethod
    def from_folder(cls, folder: Path) -> "SafetensorsStore":
        index = folder / "model.safetensors.index.json"
        if index.exists():
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise LsparseError(f"{index}: no weight_map")
            files = sorted({folder / f for f in weight_map.values()})
            missing = [f.name for f in files if not f.exists()]
            if missing:
                raise LsparseError(f"{folder}: shard(s) named in the index are missing: {', '.join(missing)}")
        else:
            files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise LsparseError(f"{folder}: no *.safetensors files (only safetensors checkpoints are read)")
        return cls(files)

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._file_of:
            raise LsparseError(f"tensor {name!r} is not in the checkpoint")
        return self._file_of[name]

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).entries[name][2]

    def get(self, name: str) -> np.ndarray:
        return self._file(name).get(name)


def mapping_of(array: np.ndarray):
    """The file mapping a tensor from SafetensorsFile.mapped lies in, or None for one read into memory. Its
    `madvise(mmap.MADV_DONTNEED)` drops the tensor's pages from this process: its resident memory falls back,
    while the OS's page cache may keep them for the next touch."""
    import mmap
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    base = base.obj if isinstance(base, memoryview) else base
    return base if isinstance(base, mmap.mmap) and hasattr(mmap, "MADV_DONTNEED") else None
