"""How to decode from an image: one dataclass, filled by the CLI (once), by bench rungs and by scripts."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from lsparse.errors import LsparseError
from lsparse.kernels.backends import KERNELS
from lsparse.runtime.reader import DEFAULT_READERS
from lsparse.sizes import parse_share, parse_size

MODES = ("exact", "predicted", "dense", "hybrid")
FLOCK_RULES = ("add", "within", "core")  # runtime/flock.py


@dataclass(frozen=True)
class DecodeOptions:
    mode: str = "exact"             # exact (the gate resident: lossless), predicted, dense or hybrid
    window: int | None = None       # keep neurons of the last `window` tokens (None: until the cache is full)
    threshold_shift: float = 0.0    # added to each layer's predictor threshold (negative: load more)
    ram_budget: int | None = None   # bytes; the plan fits in it or the run is refused. None: no limit
    context: int = 2048             # tokens the KV cache is planned for (prompt and generation)
    kernels: str = "auto"           # what computes the FFNs (lsparse/kernels/backends.py)
    readers: int = DEFAULT_READERS  # reader threads, each with one read in flight
    direct: bool = True             # O_DIRECT (F_NOCACHE on macOS): the page cache holds nothing
    lookahead: bool = False         # read the next layer's guessed neurons while this one computes
    gap_bytes: int | None = None    # read through gaps below this; None: the rule measured on the device
    bundled: bool = True            # False: each row of a neuron is a read of its own (an ablation)
    cache_bias: float = 0.0         # predicted mode: a cached neuron's score raised by this, an uncached one's lowered
    correct_every: int | None = None   # predicted mode: the dense path checks the drafts every k tokens
    correct_margin: float | None = None  # ... and sooner where the top two logits are closer than this
    flock: float | None = None      # a sequence's flock: this share of each layer's neurons, chosen from its prompt
    flock_rule: str = "add"         # add, within or core: how the flock shapes later masks (runtime/flock.py)
    kv_top_k: int | None = None     # SparQ attention (model/sparq.py): the keys a decoding step reads whole
    kv_rank: int | None = None      # ... and the key components it ranks them by [a quarter of head_dim]
    kv_ram_tokens: int | None = None  # with SparQ: the KV cache on flash, R to 2R tokens in RAM (runtime/kv_flash.py)

    def __post_init__(self):
        if self.mode not in MODES:
            raise LsparseError(f"unknown mode {self.mode!r} (choose from {', '.join(MODES)})")
        if self.kernels not in KERNELS:
            raise LsparseError(f"unknown kernels {self.kernels!r} (choose from {', '.join(KERNELS)})")
        for name in ("window", "context", "readers"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise LsparseError(f"--{name} must be at least 1, got {getattr(self, name)}")
        if not math.isfinite(self.threshold_shift):
            raise LsparseError(f"--threshold must be a finite number, got {self.threshold_shift}")
        if self.ram_budget is not None and self.ram_budget <= 0:
            raise LsparseError(f"--ram-budget must be positive, got {self.ram_budget} bytes")
        if self.correct_every is not None and (self.correct_every < 1 or self.mode != "predicted"):
            raise LsparseError("--correct-every K (at least 1) corrects predicted mode's tokens: give --mode "
                               "predicted")
        if not (math.isfinite(self.cache_bias) and self.cache_bias >= 0) or (self.cache_bias and
                                                                             self.mode != "predicted"):
            raise LsparseError(f"--cache-bias (at least 0) biases predicted mode's masks, got {self.cache_bias} in "
                               f"{self.mode} mode")
        if self.correct_margin is not None and (self.correct_every is None or not self.correct_margin >= 0):
            raise LsparseError("--correct-margin (at least 0) goes with --correct-every")
        self._check_flock()
        if (self.kv_top_k is not None and self.kv_top_k < 1) or (self.kv_rank is not None and (
                self.kv_rank < 1 or self.kv_top_k is None)):
            raise LsparseError("--kv-top-k K (at least 1) turns on SparQ attention; --kv-rank R (at least 1) goes "
                               "with it")
        if self.kv_ram_tokens is not None and (self.kv_ram_tokens < 1 or self.kv_top_k is None):
            raise LsparseError("--kv-ram-tokens R (at least 1) pages SparQ attention's KV cache to flash: give "
                               "--kv-top-k too")
        if self.gap_bytes is not None and self.gap_bytes < 0:
            raise LsparseError(f"the read-through gap must be at least 0, got {self.gap_bytes}")

    def _check_flock(self):
        if self.flock is None:
            if self.flock_rule != "add":
                raise LsparseError("--flock-rule goes with --flock SHARE")
            return
        if not 0 < self.flock <= 1:
            raise LsparseError(f"--flock is a share of each layer's neurons, above 0 and at most 1, got {self.flock}")
        if self.flock_rule not in FLOCK_RULES:
            raise LsparseError(f"unknown flock rule {self.flock_rule!r} (choose from {', '.join(FLOCK_RULES)})")
        if self.mode not in ("exact", "predicted") or (self.flock_rule == "core" and self.mode != "predicted"):
            raise LsparseError(f"--flock with rule {self.flock_rule} works in "
                               f"{'predicted' if self.flock_rule == 'core' else 'exact or predicted'} mode, "
                               f"not {self.mode}")
        if self.lookahead or self.correct_every:
            raise LsparseError("--flock does not combine with --lookahead or --correct-every")

    def but(self, **changes) -> "DecodeOptions":
        return replace(self, **changes)


def parse_budget(text: str | None, image=None) -> int | None:
    """--ram-budget as the user wrote it: bytes (512MB, 2GB), or a share of the image's model as stored (50%:
    half of Image.model_bytes()). None: no budget."""
    if text is None:
        return None
    if not text.strip():
        raise LsparseError("--ram-budget is empty (examples: 512MB, 2GB, 50%)")
    if text.strip().endswith("%"):
        share = parse_share(text, "--ram-budget")
        if not 0 < share <= 10 or image is None:
            raise LsparseError(f"--ram-budget {text}: a share must be above 0% and of an image")
        return int(share * image.model_bytes())
    return parse_size(text)
