"""Activation predictors: which neurons a token will need, known before their weights are read.

- exact: the gate projection (OPT: fc1) is kept resident and computed in full, so the mask is exact;
- svd: training-free, a rank-r SVD of that projection, scores x @ A @ B;
- lowrank: LLM in a Flash's predictor, sigmoid(relu(x @ W1) @ W2 + b), trained with MLX on a balanced
  binary cross-entropy.
A neuron is predicted active when its score exceeds the layer's threshold, chosen on the training split for
a target recall and reported on a held-out split.
"""

from __future__ import annotations

import numpy as np

KINDS = ("exact", "svd", "lowrank")


def layer_rank(rank: int, layer: int, n_layers: int) -> int:
    """Later layers fire more neurons and get more rank: from `rank` at the first layer to 2x at the last."""
    return int(round(rank * (1 + layer / max(n_layers - 1, 1))))


def threshold_for_recall(scores: np.ndarray, active: np.ndarray, recall: float) -> float:
    """The largest threshold whose predicted set (score > t) keeps `recall` of the active neurons."""
    positives = scores[active]
    if positives.size == 0:
        return float(scores.max())
    return float(np.quantile(positives, 1 - recall)) - 1e-6


def svd_predictor(projection: np.ndarray, bias: np.ndarray | None, rank: int) -> dict[str, np.ndarray]:
    u, s, vt = np.linalg.svd(projection.astype(np.float64), full_matrices=False)
    tensors = {"A": (vt[:rank].T * s[:rank]).astype(np.float32), "B": u[:, :rank].T.astype(np.float32)}
    if bias is not None:
        tensors["bias"] = bias.astype(np.float32)
    return tensors


def train_lowrank(inputs: np.ndarray, active: np.ndarray, rank: int, epochs: int = 30, batch: int = 256,
                  lr: float = 2e-3, seed: int = 0, on_epoch=None) -> dict[str, np.ndarray]:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim

    mx.random.seed(seed)
    d, d_ff = inputs.shape[1], active.shape[1]
    model = nn.Sequential(nn.Linear(d, rank, bias=False), nn.ReLU(), nn.Linear(rank, d_ff))
    positive = float(active.mean())
    pos_weight = (1 - positive) / max(positive, 1e-6)  # balance the rare positives against the negatives

    def loss_fn(m, x, y):
        logits = m(x)
        per = nn.losses.binary_cross_entropy(logits, y, with_logits=True, reduction="none")
        return (per * (1 + (pos_weight - 1) * y)).mean()

    opt = optim.Adam(learning_rate=lr)
    step = nn.value_and_grad(model, loss_fn)
    x_all, y_all = mx.array(inputs.astype(np.float32)), mx.array(active.astype(np.float32))
    rng = np.random.default_rng(seed)
    for epoch in range(epochs):
        order = mx.array(rng.permutation(len(inputs)))
        for start in range(0, len(inputs), batch):
            idx = order[start:start + batch]
            loss, grads = step(model, x_all[idx], y_all[idx])
            opt.update(model, grads)
            mx.eval(model.parameters(), opt.state)
        if on_epoch:
            on_epoch(epoch)
    return {"W1": np.array(model.layers[0].weight).T.copy(), "W2": np.array(model.layers[2].weight).T.copy(),
            "b2": np.array(model.layers[2].bias)}


def predictor_scores(kind: str, tensors: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """Scores (tokens, d_ff); for lowrank, logits (the sigmoid is monotone, so thresholds apply to logits)."""
    if kind == "svd":
        s = (x @ tensors["A"]) @ tensors["B"]
        return s + tensors["bias"] if "bias" in tensors else s
    if kind == "lowrank":
        return np.maximum(x @ tensors["W1"], 0) @ tensors["W2"] + tensors["b2"]
    raise ValueError(kind)


def prediction_quality(predicted: np.ndarray, active: np.ndarray, activations: np.ndarray) -> dict[str, float]:
    true_pos = (predicted & active).sum()
    mass = np.abs(activations)
    return {"recall": float(true_pos / max(active.sum(), 1)),
            "precision": float(true_pos / max(predicted.sum(), 1)),
            "predicted_fraction": float(predicted.mean()),
            "max_predicted_fraction": float(predicted.mean(axis=1).max()),
            "false_negative_mass": float(mass[active & ~predicted].sum() / max(mass.sum(), 1e-12))}
