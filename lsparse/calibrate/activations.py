"""Recording FFN activations on real text, and the statistics sparse inference rests on."""

from __future__ import annotations

import numpy as np

from lsparse.model.backend import to_numpy

WINDOWS = tuple(range(1, 9))
HOT_SHARES = (0.01, 0.05, 0.10, 0.20)


def record_activations(model, windows: list[list[int]]) -> list[np.ndarray]:
    """Per layer, the FFN activations of every token of every window: (tokens, d_ff) float32."""
    per_layer = [[] for _ in model.layers]
    arch = model.arch

    def recording(i):
        def ffn(args, w, x, xp):
            a = arch.ffn_activation(args, w, x, xp)
            per_layer[i].append(to_numpy(a).astype(np.float32))
            return arch.ffn_down(args, w, a, xp)
        return ffn

    fns = [recording(i) for i in range(len(model.layers))]
    for tokens in windows:
        model(tokens, model.make_cache(len(tokens)), fns)
    return [np.concatenate(chunks) for chunks in per_layer]


def thresholded_ffns(model, thresholds: list[float]) -> list:
    """FFNs that zero every activation of magnitude below the layer's threshold (CATS-style)."""
    arch = model.arch

    def thresholded(t):
        def ffn(args, w, x, xp):
            a = arch.ffn_activation(args, w, x, xp)
            return arch.ffn_down(args, w, a * (xp.abs(a) >= t), xp)
        return ffn

    return [thresholded(t) for t in thresholds]


def layer_stats(active: np.ndarray, lengths: list[int]) -> dict:
    """`active` is (tokens, d_ff) bool for consecutive windows of the given lengths."""
    d_ff = active.shape[1]
    union = {k: [] for k in WINDOWS}
    new = {k: [] for k in WINDOWS}
    start = 0
    for n in lengths:
        a = active[start:start + n]
        start += n
        u = a  # u[j] = OR of a[j .. j+k-1]
        for k in WINDOWS:
            if k > 1:
                u = u[:-1] | a[k - 1:]
            if len(u):
                union[k].append(u.sum(1))
            if len(a) > k:  # neurons token j+k uses that the k tokens before it did not
                new[k].append((a[k:] & ~u[:len(a) - k]).sum(1))
    frequency = active.sum(0)
    ranked = np.sort(frequency)[::-1]
    total = max(int(frequency.sum()), 1)
    return {
        "active_fraction": float(active.mean()),
        "window_union_fraction": {k: float(np.concatenate(union[k]).mean() / d_ff) for k in WINDOWS if union[k]},
        "new_per_token_fraction": {k: float(np.concatenate(new[k]).mean() / d_ff) for k in WINDOWS if new[k]},
        "hot_coverage": {s: float(ranked[:max(1, round(s * d_ff))].sum() / total) for s in HOT_SHARES},
        "never_active_fraction": float((frequency == 0).mean()),
    }


def average(stats: list[dict]) -> dict:
    """The mean over layers of each figure."""
    out = {}
    for key, value in stats[0].items():
        if isinstance(value, dict):
            out[key] = {k: float(np.mean([s[key][k] for s in stats])) for k in value}
        else:
            out[key] = float(np.mean([s[key] for s in stats]))
    return out
