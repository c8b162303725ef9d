"""`lsparse inspect IMAGE`: what an image holds and what calibration measured."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from lsparse.image.image import Image
from lsparse.image.manifest import NEURONS, Manifest
from lsparse.source.safetensors_store import SafetensorsFile

RESIDENT_KINDS = {"hot_bundles": "hot neurons", "exact_rows": "exact gate rows", "A": "predictors", "B": "predictors",
                  "W1": "predictors", "W2": "predictors", "b2": "predictors", "bias": "predictors"}


def describe_image(image, manifest: Manifest | None = None) -> dict:
    image = Image(Path(image), manifest) if manifest is not None else Image.open(image)
    m = image.manifest
    components = {"embedding, head, norms, attention": 0, "hot neurons": 0, "exact gate rows": 0,
                  "predictors": 0, "cold neurons (flash)": 0}
    for path in sorted((image.path / "resident").glob("*.safetensors")):
        f = SafetensorsFile(path)
        for name, (_, dtype, shape, _) in f.entries.items():
            kind = RESIDENT_KINDS.get(name, "embedding, head, norms, attention")
            components[kind] += int(np.prod(shape)) * dtype.itemsize
    components["cold neurons (flash)"] = sum(layer.region.size for layer in m.layers)
    total = sum(components.values())
    layers = []
    for layer in m.layers:
        q, lay = layer.figures["predictor"], layer.figures["layout"]
        layers.append({
            "index": layer.index, "active_fraction": layer.active_fraction,
            "hot_fraction": len(layer.hot) / layer.d_ff,
            "hot_share_of_activations": layer.figures["held_out_hot_share"],
            "recall": q["recall"], "precision": q["precision"], "false_negative_mass": q["false_negative_mass"],
            "predicted_fraction": q["predicted_fraction"],
            "reads_per_token": {k: v["reads_per_token"] for k, v in lay.items()},
            "mean_read_bytes": {k: v["mean_read_bytes"] for k, v in lay.items()},
            "quantization_error": max(layer.figures["quantization_error"].values()),
        })
    return {"image": str(image.path), "source": m.source, "created": m.created,
            "quantization": {"bits": m.bundle.bits, "hot_bits": m.hot_bundle.bits, "group_size": m.bundle.group_size},
            "predictor": {"kind": m.predictor, "recall_target": m.recall_target},
            "calibration": dataclasses.asdict(m.calibration),
            "bundle_stride": m.bundle.stride, "bytes": total,
            "components": {k: {"bytes": v, "share": v / total} for k, v in components.items()},
            "neuron_file_bytes": m.files[NEURONS].size, "layers": layers,
            "quality_gate": m.layers[0].figures.get("quality_gate")}


def print_image(summary: dict) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.width = max(console.width, 124)
    q = summary["quantization"]
    tier = f" (hot neurons {q['hot_bits']}-bit)" if q["hot_bits"] != q["bits"] else ""
    console.print(f"[bold]{summary['image']}[/bold]: from {summary['source']}, {q['bits']}-bit bundles{tier} "
                  f"(groups of {q['group_size']}), {summary['bundle_stride']} bytes each; predictor "
                  f"{summary['predictor']['kind']}; calibrated on {summary['calibration']['tokens']} tokens "
                  f"({summary['calibration']['held_out_tokens']} held out for the figures below)")
    parts = Table("component", "MB", "share", box=box.SIMPLE)
    for name, c in summary["components"].items():
        parts.add_row(name, f"{c['bytes'] / 1e6:.2f}", f"{c['share']:.1%}")
    console.print(parts)
    table = Table("layer", "active", "hot", "hot cover", "recall", "precision", "FN mass", "loaded",
                  "reads/tok", "KB/read", "q-error", box=box.SIMPLE, padding=(0, 1),
                  caption="held-out tokens; reads per token and KB per read: natural order > co-activation order")
    for s in summary["layers"]:
        r, m = s["reads_per_token"], s["mean_read_bytes"]
        table.add_row(str(s["index"]), f"{s['active_fraction']:.1%}", f"{s['hot_fraction']:.0%}",
                      f"{s['hot_share_of_activations']:.1%}", f"{s['recall']:.3f}", f"{s['precision']:.3f}",
                      f"{s['false_negative_mass']:.4f}", f"{s['predicted_fraction']:.1%}",
                      f"{r['natural']:.1f}>{r['coactivation']:.1f}",
                      f"{m['natural'] / 1e3:.1f}>{m['coactivation'] / 1e3:.1f}", f"{s['quantization_error']:.4f}")
    console.print(table)
    g = summary.get("quality_gate")
    if g:
        oracle = "" if g["oracle_perplexity"] is None else (f"; oracle (the true masks at the compiled cut): "
                                                            f"{g['oracle_perplexity']:.3f}")
        console.print(f"Quality gate: recall {g['recall']} for at most {g['bound']:.1%} more perplexity than dense on "
                      f"{g['tokens']} held-out calibration tokens: deployable (predicted mode) "
                      f"{g['perplexity']:.3f} against dense {g['dense_perplexity']:.3f} "
                      f"({g['perplexity'] / g['dense_perplexity'] - 1:+.2%}), {g['used_fraction']:.1%} of the "
                      f"neurons computed per token{oracle}. The table's predictor figures are at the recall compile "
                      f"aimed at before the gate.")
