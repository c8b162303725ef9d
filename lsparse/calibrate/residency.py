"""Which neurons stay in RAM (hot, as in PowerInfer) and which stay on flash (cold).

A hot neuron saves its bundle's read on every token it fires, so activation frequency ranks first. Ties,
and neurons of similar frequency, are ordered by a Wanda-style importance: the neuron's mean activation
magnitude times the norm of its down column, and the magnitude of its input rows weighted by the input
channel norms (|W_ij| * ||X_j||, Wanda's score, summed over the row).
"""

from __future__ import annotations

import numpy as np


def wanda_row_scores(rows: np.ndarray, input_norms: np.ndarray) -> np.ndarray:
    """sum_j |W_nj| * ||X_j|| for each row n of an input projection."""
    return np.abs(rows) @ input_norms


def neuron_scores(active: np.ndarray, activations: np.ndarray, input_rows: list[np.ndarray],
                  down: np.ndarray, input_norms: np.ndarray) -> dict[str, np.ndarray]:
    """Per neuron: frequency, mean |activation|, Wanda-style importance, and the combined residency score.
    `down` is (d_model, d_ff); `input_rows` the (d_ff, d_model) projections feeding the neuron."""
    frequency = active.mean(0)
    magnitude = np.abs(activations).mean(0)
    contribution = magnitude * np.linalg.norm(down, axis=0)
    wanda = sum(wanda_row_scores(r, input_norms) for r in input_rows)
    importance = contribution / max(contribution.mean(), 1e-12) + wanda / max(wanda.mean(), 1e-12)
    # Frequency decides; importance only separates neurons of (nearly) equal frequency.
    score = frequency * (1 + 0.05 * importance / max(importance.max(), 1e-12))
    return {"frequency": frequency, "magnitude": magnitude, "wanda": wanda, "score": score}


def hot_set(score: np.ndarray, fraction: float) -> np.ndarray:
    """Indices of the top `fraction` of neurons by score, ascending."""
    k = int(round(fraction * len(score)))
    return np.sort(np.argsort(-score, kind="stable")[:k])
