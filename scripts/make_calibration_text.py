"""Write lsparse's default calibration text: stories sampled from the real stories260K (temperature 1,
seeded) by lsparse's own dense decoder. Generated text, so nothing of ../shared/data is copied.

    python scripts/make_calibration_text.py --out lsparse/calibrate/data/stories.txt
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--stories", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from lsparse.model import load_model
    from lsparse.runtime.generate import generate
    from lsparse.runtime.sampling import make_sampler
    from lsparse.source import resolve

    checkpoint = resolve(str(REPO.parent / "shared" / "data" / "stories260K" / "stories260K.bin"))
    model, tok = load_model(checkpoint, "numpy"), checkpoint.tokenizer
    sample = make_sampler(1.0, 1.0, args.seed)
    stories = []
    for _ in range(args.stories):
        ids = generate(model, tok, [tok.bos_id], 400, sample, {tok.bos_id, *tok.eos_ids})
        stories.append(tok.decode(ids).strip())
    args.out.write_text("\n<|endoftext|>\n".join(stories) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(stories)} stories, {sum(map(len, stories))} characters")


if __name__ == "__main__":
    main()
