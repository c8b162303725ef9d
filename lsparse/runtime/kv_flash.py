"""The KV cache paged to flash (SparQ's setting: a context longer than the KV budget). Each layer keeps its newest
R to 2R tokens' keys and values in RAM (R: `--kv-ram-tokens`); every R tokens the oldest R are written to a
spill file as one page. A decoding step then reads from flash only what SparQ attention uses: the query's r
chosen key components of every paged token (a page stores its keys twice, by component as well as by token,
so that a component of R tokens is one contiguous span), and the k keys and values it chose, whole. A step of
several tokens (a prompt) attends in full and reads every page back.

Spill file, one region per layer of ceil(context / R) pages; a page, float32, for R tokens:
    keys by component (kv heads, head_dim, R) | keys by token (kv heads, R, head_dim) | values (kv heads, R, head_dim)
It is created in the image's folder (the flash the image is read from) and unlinked at once: nothing is left
behind, whatever ends the process. Reads go through a FlashReader (direct I/O where the OS allows it), whole
4 KiB blocks, each block once a step.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from lsparse.errors import LsparseError
from lsparse.model.sparq import F32, SparQ, SparQCache
from lsparse.runtime.reader import ALIGN, FlashReader

READ_BUFFER_BYTES = 4 << 20  # one batch of a step's reads


def page_bytes(n_kv: int, head_dim: int, tokens: int) -> int:
    """A page: keys by component, keys by token, values, float32."""
    return 3 * n_kv * head_dim * tokens * F32


class KVSpill:
    """The spill file shared by one model's layers, and its reader. Each make_cache call takes the file over
    (a newer cache list replaces the older: a model decodes one sequence at a time)."""

    def __init__(self, folder, ram_tokens: int, sparq: SparQ, direct: bool = True):
        if ram_tokens < 1:
            raise LsparseError(f"--kv-ram-tokens must be at least 1, got {ram_tokens}")
        self.ram_tokens, self.sparq = ram_tokens, sparq
        fd, path = tempfile.mkstemp(prefix=".lsparse-kv-", dir=folder)
        try:
            self.reader = FlashReader(path, direct=direct, buffer_bytes=READ_BUFFER_BYTES)
        finally:
            os.unlink(path)
        self.fd = fd
        self.epoch = 0
        self.written = 0  # bytes written, over the model's life

    def make_cache(self, xp, n_layers: int, n_kv: int, max_len: int, head_dim: int) -> list:
        self.epoch += 1
        pages = -(-max_len // self.ram_tokens)
        region = -(-pages * page_bytes(n_kv, head_dim, self.ram_tokens) // ALIGN) * ALIGN
        os.ftruncate(self.fd, 0)  # sparse: the file takes space only where pages are written
        os.ftruncate(self.fd, n_layers * region)
        self.reader.size = n_layers * region
        return [FlashKVCache(xp, n_kv, max_len, head_dim, self, i * region) for i in range(n_layers)]

    def write(self, data: bytes, offset: int) -> None:
        os.pwrite(self.fd, data, offset)
        self.written += len(data)
        # the page leaves RAM: on disk (fdatasync), then out of the page cache that a memory cap charges
        os.fdatasync(self.fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self.fd, offset, len(data), os.POSIX_FADV_DONTNEED)

    def read_spans(self, offsets: np.ndarray, length: int) -> tuple[np.ndarray, int, int, float]:
        """(data (spans, length) bytes, bytes transferred, reads, seconds): spans of `length` bytes at these
        offsets, read as runs of whole blocks, each block once."""
        offsets = np.asarray(offsets, dtype=np.int64)
        if not len(offsets):
            return np.empty((0, length), dtype=np.uint8), 0, 0, 0.0
        first, last = offsets // ALIGN, (offsets + length - 1) // ALIGN
        candidates = first[:, None] + np.arange(length // ALIGN + 2)  # (spans, blocks a span may touch)
        blocks = np.unique(candidates[candidates <= last[:, None]])
        breaks = np.flatnonzero(np.diff(blocks) != 1) + 1
        run_first = blocks[np.r_[0, breaks]]
        run_blocks = np.diff(np.r_[0, breaks, len(blocks)])
        starts, sizes = run_first * ALIGN, run_blocks * ALIGN
        run_of = np.searchsorted(starts, offsets, side="right") - 1                     # (spans,)
        out, transferred, seconds = np.empty((len(offsets), length), dtype=np.uint8), 0, 0.0
        for a, b in self.reader.batches(sizes):
            buffer, at, n, s = self.reader.read_into(starts[a:b], sizes[a:b])
            transferred, seconds = transferred + n, seconds + s
            mine = np.flatnonzero((run_of >= a) & (run_of < b))
            place = at[run_of[mine] - a] + offsets[mine] - starts[run_of[mine]]
            out[mine] = buffer[place[:, None] + np.arange(length)]
        return out, transferred, len(starts), seconds

    def close(self) -> None:
        self.reader.close()
        os.close(self.fd)


class FlashKVCache(SparQCache):
    """A SparQCache whose older tokens lie in pages of the spill file: RAM holds positions [paged, offset)."""

    def __init__(self, xp, n_kv: int, max_len: int, head_dim: int, spill: KVSpill, base: int):
        self.page = spill.ram_tokens
        super().__init__(xp, n_kv, min(max_len, 2 * self.page), head_dim, spill.sparq)
        self.spill, self.base, self.epoch = spill, base, spill.epoch
        self.paged = 0  # tokens on flash, whole pages
        self.n_kv, self.head_dim = n_kv, head_dim
        self.page_bytes = page_bytes(n_kv, head_dim, self.page)
        self.flash_bytes = self.flash_reads = 0  # what steps read of the spill file (transferred, requests)
        self.flash_s = 0.0

    def _check(self) -> None:
        if self.epoch != self.spill.epoch:
            raise LsparseError("this KV cache's spill file was taken over by a newer cache")

    def append(self, k, v) -> None:
        self._check()
        self.value_sum = self.value_sum + v.sum(axis=1)
        done = 0
        while done < k.shape[1]:  # a page out whenever RAM holds 2R tokens
            if self.offset - self.paged == self.keys.shape[1]:
                self._page_out()
            held = self.offset - self.paged
            n = min(self.keys.shape[1] - held, k.shape[1] - done)
            self.keys[:, held:held + n], self.values[:, held:held + n] = k[:, done:done + n], v[:, done:done + n]
            self.offset, done = self.offset + n, done + n

    def _page_out(self) -> None:
        """The oldest R tokens held, written as the next page; the rest moved to the front."""
        r = self.page
        keys, values = np.asarray(self.keys[:, :r]), np.asarray(self.values[:, :r])  # (kv heads, R, d) each
        page = np.concatenate([keys.transpose(0, 2, 1).ravel(), keys.ravel(), values.ravel()]).astype(np.float32)
        self.spill.write(page.tobytes(), self.base + (self.paged // r) * self.page_bytes)
        self.keys[:, :r], self.values[:, :r] = self.keys[:, r:2 * r], self.values[:, r:2 * r]
        self.paged += r

    def update(self, k, v):
        """Several tokens at once (a prompt): appended, then every key and value, the paged ones read back."""
        self.append(k, v)
        held = self.offset - self.paged
        if not self.paged:
            return self.keys[:, :held], self.values[:, :held]
        rows = np.arange(self.paged)
        paged_keys, paged_values = self._rows(np.repeat(np.arange(self.n_kv), self.paged), np.tile(rows, self.n_kv))
        shape = (self.n_kv, self.paged, self.head_dim)
        xp = self.xp
        return (xp.concatenate([xp.array(paged_keys.reshape(shape)), self.keys[:, :held]], axis=1),
                xp.concatenate([xp.array(paged_values.reshape(shape)), self.values[:, :held]], axis=1))

    def _read(self, offsets: np.ndarray, length: int) -> np.ndarray:
        data, n, reads, seconds = self.spill.read_spans(offsets, length)
        self.flash_bytes, self.flash_reads, self.flash_s = self.flash_bytes + n, self.flash_reads + reads, \
            self.flash_s + seconds
        return data

    def _offsets(self, head: np.ndarray, position: np.ndarray, part: int) -> np.ndarray:
        """Byte offsets in the spill file of a row (of head_dim floats) at these paged positions: part 1 the
        key, part 2 the value."""
        page, i = position // self.page, position % self.page
        block = self.n_kv * self.page * self.head_dim
        return self.base + page * self.page_bytes + (part * block + (head * self.page + i) * self.head_dim) * F32

    def _rows(self, head: np.ndarray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(keys, values), each (n, head_dim) float32: paged rows read from flash."""
        out = []
        for part in (1, 2):
            data = self._read(self._offsets(head, position, part), self.head_dim * F32)
            out.append(data.view(np.float32).reshape(len(head), self.head_dim))
        return out[0], out[1]

    def key_columns(self, kv_of, top_r):
        """(heads, s, r): the paged part read component by component, the rest from RAM."""
        held = self.offset - self.paged
        ram = self.keys[kv_of[:, None, None], self.xp.arange(held)[None, :, None], top_r[:, None, :]]
        if not self.paged:
            return ram
        kv_np, top_np = np.asarray(kv_of), np.asarray(top_r)
        wanted = np.unique(kv_np[:, None] * self.head_dim + top_np)              # (kv head, component) pairs
        head, component = wanted // self.head_dim, wanted % self.head_dim
        pages = np.arange(self.paged // self.page)
        offsets = (self.base + pages[None, :] * self.page_bytes +
                   ((head * self.head_dim + component) * self.page * F32)[:, None])  # (pairs, pages)
        data = self._read(offsets.ravel(), self.page * F32)
        by_pair = data.view(np.float32).reshape(len(wanted), self.paged)          # (pairs, paged tokens)
        index = np.searchsorted(wanted, kv_np[:, None] * self.head_dim + top_np)  # (heads, r)
        paged = by_pair[index].transpose(0, 2, 1)                                # (heads, paged, r)
        return self.xp.concatenate([self.xp.array(paged), ram], axis=1)

    def chosen(self, kv_of, top):
        """Keys and values (heads, k, d) at the chosen positions: paged ones read from flash (each key-value
        head's union once), the rest from RAM."""
        xp, kv_np, top_np = self.xp, np.asarray(kv_of), np.asarray(top)
        keys = np.empty((*top_np.shape, self.head_dim), dtype=np.float32)
        values = np.empty_like(keys)
        in_ram = top_np >= self.paged
        heads = np.broadcast_to(kv_np[:, None], top_np.shape)
        keys[in_ram] = np.asarray(self.keys)[heads[in_ram], top_np[in_ram] - self.paged]
        values[in_ram] = np.asarray(self.values)[heads[in_ram], top_np[in_ram] - self.paged]
        if (~in_ram).any():
            pairs = np.unique(heads[~in_ram] * self.paged + top_np[~in_ram])
            k_rows, v_rows = self._rows(pairs // self.paged, pairs % self.paged)
            index = np.searchsorted(pairs, heads[~in_ram] * self.paged + top_np[~in_ram])
            keys[~in_ram], values[~in_ram] = k_rows[index], v_rows[index]
        return xp.array(keys), xp.array(values)
