"""SparQ attention (Ribar et al. 2023, "SparQ Attention: Bandwidth-Efficient LLM Inference"): a decoding step
reads r of each key's head_dim components, those where the query is largest, to approximate the attention
scores; then only the k keys and values those scores rank highest, whole. The values it leaves out enter
through their mean, weighted by the share of the approximate attention they would have had.

A SparQCache is a KVCache whose one-token steps attend this way once it holds more than k keys (a prompt's
tokens, several at a time, attend in full); it counts the bytes each such step reads of the cache (per
key-value head, the key columns and whole keys and values that any of its query heads chose), against what full
attention reads (every key and value).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from lsparse.errors import LsparseError
from lsparse.model.layers import KVCache, softmax

F32 = 4


@dataclass(frozen=True)
class SparQ:
    rank: int   # r: the query's largest components whose key columns are read
    top_k: int  # k: the keys (and their values) read whole

    def __post_init__(self):
        if self.rank < 1 or self.top_k < 1:
            raise LsparseError(f"SparQ needs a rank and a top k of at least 1, got {self.rank} and {self.top_k}")


def rank_for(kv_rank: int | None, head_dim: int) -> int:
    """The key components a step ranks by: `kv_rank` (None: a quarter of the head's), at most the head's."""
    return min(kv_rank or max(1, head_dim // 4), head_dim)


class SparQCache(KVCache):
    def __init__(self, xp, n_kv_heads: int, max_len: int, head_dim: int, sparq: SparQ):
        super().__init__(xp, n_kv_heads, max_len, head_dim)
        self.sparq, self.xp = sparq, xp
        self.rank = min(sparq.rank, head_dim)
        self.value_sum = xp.zeros((n_kv_heads, head_dim), dtype=xp.float32)  # for the values' mean
        self.bytes_read = 0  # of keys and values, over SparQ's steps
        self.bytes_full = 0  # what full attention reads at those steps

    def append(self, k, v) -> None:
        self.value_sum = self.value_sum + v.sum(axis=1)
        super().append(k, v)

    def applies(self, t: int, s: int, window: int | None) -> bool:
        """Whether a step of t queries over s keys attends SparQ's way."""
        return t == 1 and s > self.sparq.top_k and window is None

    def attend(self, q, scale: float):
        """q (heads, 1, head_dim) over the keys and values held (kv heads, s, head_dim) -> (1, heads * head_dim)."""
        xp, k, s = self.xp, self.sparq.top_k, self.offset
        n_heads, _, d = q.shape
        n_kv = self.keys.shape[0]
        kv_of = xp.array(np.arange(n_heads) // (n_heads // n_kv))  # (heads,) each query head's key-value head
        qf = q[:, 0, :]                                               # (heads, d)
        top_r = xp.argpartition(-xp.abs(qf), self.rank - 1, axis=-1)[:, : self.rank]  # (heads, r)
        columns = self.key_columns(kv_of, top_r)                      # (heads, s, r)
        q_r = xp.take_along_axis(qf, top_r, axis=-1)                  # (heads, r)
        # the approximate scores' temperature: the share of |q| the r components hold (SparQ's correction)
        share = xp.abs(q_r).sum(-1) / xp.maximum(xp.abs(qf).sum(-1), 1e-30)
        approx = softmax((columns @ q_r[..., None])[..., 0] / xp.sqrt(d * share)[:, None], xp)  # (heads, s)
        top = xp.argpartition(-approx, k - 1, axis=-1)[:, :k]        # (heads, k)
        alpha = xp.take_along_axis(approx, top, axis=-1).sum(-1)      # (heads,)
        chosen_keys, chosen_values = self.chosen(kv_of, top)          # (heads, k, d) each
        probs = softmax((chosen_keys @ qf[..., None])[..., 0] * scale, xp)  # (heads, k)
        mean = (self.value_sum / s)[kv_of]                            # (heads, d)
        out = alpha[:, None] * (probs[:, None, :] @ chosen_values)[:, 0] + (1 - alpha)[:, None] * mean
        # what the step reads: per key-value head, the key columns and the keys and values its query heads chose
        columns, rows = (np.asarray(i).reshape(n_kv, n_heads // n_kv, -1) for i in (top_r, top))
        self.bytes_read += sum(len(np.unique(c)) * s + 2 * len(np.unique(r)) * d
                               for c, r in zip(columns, rows, strict=True)) * F32
        self.bytes_full += n_kv * 2 * s * d * F32
        return out.reshape(1, n_heads * d)

    def key_columns(self, kv_of, top_r):
        """(heads, s, r): each query head's r chosen components of every key held, gathered where they lie (no
        head's copy of its group's keys)."""
        s = self.offset
        return self.keys[kv_of[:, None, None], self.xp.arange(s)[None, :, None], top_r[:, None, :]]

    def chosen(self, kv_of, top):
        """(keys, values), each (heads, k, d): the whole keys and values at each query head's k positions."""
        return self.keys[kv_of[:, None], top], self.values[kv_of[:, None], top]
