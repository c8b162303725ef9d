"""What a synthetic image replays: the built-in model's FFN masks on lsparse's calibration text, split as
compile splits it. The first part (compile's training tokens) decides the synthetic layers' hot sets and
co-activation order; the held-out rest is replayed while decoding, so that the layout is measured on tokens it
was not built from. With `predicted`, also the masks the built-in model's own trained low-rank predictor gives
on the held-out tokens: a synthetic run then reads its false positives and misses what it misses."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

TRACE_MODEL = "builtin:tinystories-reglu"


@dataclass
class Recording:
    layout: np.ndarray               # (layout tokens, layers, d_ff) bool: the masks hot sets and order come from
    replay: np.ndarray               # (replay tokens, layers, d_ff) bool: the true masks replayed while decoding
    predicted: np.ndarray | None     # (replay tokens, layers, d_ff) bool: the predictor's masks, or None
    ahead: np.ndarray | None         # the same, each layer's predictor on the previous layer's FFN input (the
                                     # lookahead's guess, Deja Vu); layer 0 has none and repeats its prediction
    tokenizer: object
    predictor_recall: float | None   # of the predicted masks against the true ones


def _predictor_image(folder: Path) -> Path:
    """The built-in model compiled with its trained low-rank predictor (once, kept in `folder`)."""
    from lsparse.image.compile import CompileOptions, compile_image
    from lsparse.image.image import is_image
    image = folder / "trace-model"
    if not is_image(image):
        compile_image(TRACE_MODEL, str(image), CompileOptions(force=True))
    return image


def record(predicted: bool, folder: Path) -> Recording:
    """The built-in model's masks on the calibration text (and its predictor's, with `predicted`)."""
    from lsparse.calibrate.layerwise import calibrate_layers
    from lsparse.calibrate.predictors import predictor_scores
    from lsparse.image.compile import CompileOptions, calibration_windows
    from lsparse.image.image import Image
    from lsparse.source import resolve
    checkpoint = resolve(TRACE_MODEL)
    windows, train_n = calibration_windows(checkpoint.tokenizer, CompileOptions())
    image = Image.open(_predictor_image(folder)) if predicted else None
    true, guessed, ahead, before = [], [], [], None
    for cal in calibrate_layers(checkpoint, windows):
        true.append(cal.activations != 0)  # (tokens, d_ff): a ReLU model's zeros are exact
        if image is not None:
            threshold = image.manifest.layers[cal.index].predictor_threshold
            tensors = {k: v.astype(np.float32) for k, v in image.layer_tensors(cal.index).items()
                       if k in ("W1", "W2", "b2")}
            guessed.append(predictor_scores("lowrank", tensors, cal.inputs[train_n:]) > threshold)
            ahead.append(guessed[-1] if before is None else predictor_scores("lowrank", tensors, before) > threshold)
            before = cal.inputs[train_n:]
    masks = np.stack(true, axis=1)
    pred = np.stack(guessed, axis=1) if guessed else None
    recall = float((pred & masks[train_n:]).sum() / max(masks[train_n:].sum(), 1)) if pred is not None else None
    return Recording(masks[:train_n], masks[train_n:], pred, np.stack(ahead, axis=1) if ahead else None,
                     checkpoint.tokenizer, recall)
