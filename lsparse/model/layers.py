"""Pieces every architecture shares, written against functions numpy and mlx.core both have.

Shapes: one sequence, no batch axis. x is (T, d); attention heads are (heads, T, head_dim).
"""

from __future__ import annotations

import math

import numpy as np


def linear(x, w, b=None):
    y = x @ w.T
    return y if b is None else y + b


def rms_norm(x, w, eps):
    return x / (((x * x).mean(axis=-1, keepdims=True) + eps) ** 0.5) * w


def layer_norm(x, w, b, eps):
    mu = x.mean(axis=-1, keepdims=True)
    xc = x - mu
    y = xc / (((xc * xc).mean(axis=-1, keepdims=True) + eps) ** 0.5)
    return y if w is None else y * w + b


def softmax(x, xp):
    e = xp.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def relu(x, xp):
    return xp.maximum(x, 0.0)


def silu(x, xp):
    return x / (1.0 + xp.exp(-x))


def rope_frequencies(head_dim: int, theta: float, scaling: dict | None) -> np.ndarray:
    """Inverse frequencies, with the `linear` and `llama3` scalings of transformers."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x, positions: np.ndarray, inv_freq: np.ndarray, xp):
    """Rotate (j, j + head_dim/2) pairs, the Hugging Face Llama convention."""
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    cos = xp.array(np.cos(np.concatenate([angles, angles], -1)).astype(np.float32))
    sin = xp.array(np.sin(np.concatenate([angles, angles], -1)).astype(np.float32))
    half = x.shape[-1] // 2
    rotated = xp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


class KVCache:
    """Keys and values of one layer, preallocated for the whole context."""
    sparq = None  # a SparQCache's (model/sparq.py) attention knobs; None: full attention

    def __init__(self, xp, n_kv_heads: int, max_len: int, head_dim: int):
        self.keys = xp.zeros((n_kv_heads, max_len, head_dim), dtype=xp.float32)
        self.values = xp.zeros((n_kv_heads, max_len, head_dim), dtype=xp.float32)
        self.offset = 0

    def append(self, k, v) -> None:
        end = self.offset + k.shape[1]
        self.keys[:, self.offset:end, :] = k
        self.values[:, self.offset:end, :] = v
        self.offset = end

    def update(self, k, v):
        """Appends k and v (kv heads, t, head_dim); every key and value held, (kv heads, s, head_dim) each."""
        self.append(k, v)
        return self.keys[:, :self.offset, :], self.values[:, :self.offset, :]


def attention(q, k, v, cache: KVCache, positions: np.ndarray, scale: float, xp, window: int | None = None):
    """Causal (optionally sliding-window) attention with grouped-query heads, through the KV cache.
    Each group of query heads is folded into the token axis so that no key/value is repeated."""
    n_heads, t, head_dim = q.shape
    if cache.sparq is not None and cache.applies(t, cache.offset + t, window):
        cache.append(k, v)
        return cache.attend(q, scale)
    keys, values = cache.update(k, v)
    n_kv, s = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    scores = (q.reshape(n_kv, group * t, head_dim) @ keys.transpose(0, 2, 1)) * scale
    key_pos = np.arange(s)
    masked = key_pos[None, :] > positions[:, None]
    if window is not None:
        masked |= key_pos[None, :] <= positions[:, None] - window
    if masked.any():
        mask = np.where(masked, -np.inf, 0.0).astype(np.float32)
        scores = scores.reshape(n_kv, group, t, s) + xp.array(mask)
    probs = softmax(scores.reshape(n_kv, group * t, s), xp)
    out = (probs @ values).reshape(n_heads, t, head_dim)
    return out.transpose(1, 0, 2).reshape(t, n_heads * head_dim)


def split_heads(x, n_heads: int, head_dim: int):
    return x.reshape(x.shape[0], n_heads, head_dim).transpose(1, 0, 2)
