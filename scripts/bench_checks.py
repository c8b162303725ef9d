"""What checking neuron rows on their first read costs a decode: the seconds spent in RowCheck per token,
beside the token's whole time, on any image (the 7B synthetic one: `lsparse bench synthetic:llama-7b-relu`
writes it into out/synthetic/llama-7b-relu/4bit-hot).

    python scripts/bench_checks.py out/synthetic/llama-7b-relu/4bit-hot --mode predicted --tokens 16
"""

from __future__ import annotations

import argparse
import json
import time

from lsparse.runtime import fetch
from lsparse.runtime.generate import stream_generate
from lsparse.runtime.load import load_image
from lsparse.runtime.sampling import make_sampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("image")
    p.add_argument("--mode", default="predicted")
    p.add_argument("--tokens", type=int, default=16)
    args = p.parse_args()
    spent = {"seconds": 0.0, "rows": 0}
    real = fetch.RowCheck.__call__

    def timed(self, positions, rows):
        start = time.perf_counter()
        real(self, positions, rows)
        spent["seconds"] += time.perf_counter() - start
        spent["rows"] += len(positions)

    fetch.RowCheck.__call__ = timed
    model, tok = load_image(args.image, mode=args.mode, context=args.tokens + 8)
    per_token, last = [], time.perf_counter()
    for response in stream_generate(model, tok, tok.encode("Once upon a time"), args.tokens, make_sampler(), set()):
        now = time.perf_counter()
        per_token.append({"seconds": now - last, "check_seconds": spent["seconds"]})
        spent["seconds"], last = 0.0, now
        del response
    model.close()
    checked = sum(int(f.check.checked.sum()) for f in model.ffns)
    total = sum(len(f.check.checked) for f in model.ffns)
    later = per_token[1:]
    print(json.dumps({"image": args.image, "mode": args.mode, "date": time.strftime("%Y-%m-%d"),
                      "first_token_ms": 1e3 * per_token[0]["seconds"],
                      "first_token_check_ms": 1e3 * per_token[0]["check_seconds"],
                      "later_token_ms": 1e3 * sum(t["seconds"] for t in later) / len(later),
                      "later_token_check_ms": 1e3 * sum(t["check_seconds"] for t in later) / len(later),
                      "cold_bundles_checked": checked, "cold_bundles": total}, indent=1))


if __name__ == "__main__":
    main()
