"""What each token cost: bytes and reads from flash, cache hits, and where the time went (L_io, L_mem,
L_compute, as LLM in a Flash reports them)."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class TokenCost:
    """What the FFNs cost, summed over layers, for one forward call."""
    bytes_needed: int = 0
    bytes_read: int = 0
    requests: int = 0
    lookups: int = 0
    hits: int = 0
    io_s: float = 0.0          # waiting for reads
    read_s: float = 0.0        # the reads themselves, some of it while the hot neurons were computed
    mem_s: float = 0.0         # cache bookkeeping and placing rows
    compute_s: float = 0.0
    lookahead_used: int = 0    # needed neurons that a lookahead read had already brought
    lookahead_wasted: int = 0  # neurons read ahead that the layer did not need
    missed: int = 0            # active neurons the predictor left out (known only where masks are replayed)
    attention_bytes: int = 0       # keys and values SparQ attention read (model/sparq.py)
    attention_full_bytes: int = 0  # ... and what full attention would have read at those steps
    kv_flash_bytes: int = 0        # read of the KV cache's pages on flash (runtime/kv_flash.py), whole blocks
    kv_flash_reads: int = 0
    kv_flash_s: float = 0.0


@dataclass
class CostLog:
    steps: list = field(default_factory=list)

    def start(self) -> TokenCost:
        self.steps.append(TokenCost())
        return self.steps[-1]

    @property
    def now(self) -> TokenCost:
        return self.steps[-1]


@contextmanager
def timed(cost: TokenCost, phase: str):
    """Adds the block's seconds to one of the cost's time fields (io_s, mem_s, compute_s, read_s)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        setattr(cost, phase, getattr(cost, phase) + time.perf_counter() - start)


def flash_report(steps: list[TokenCost], dense_ffn_bytes: int, tokens: int | None = None) -> dict:
    """Per decoded token, after the prompt's first step: what the FFNs read and where the time went. A step is
    a call of the model, one token each, unless `tokens` says how many the steps decoded (correction: a dense
    pass checks several in one call)."""
    if not steps:
        return {}
    prompt_bytes = steps[0].bytes_read  # the prompt's call (with a flock: the burst)
    steps = steps[1:] or steps

    def mean(key):
        return float(sum(getattr(s, key) for s in steps) / (tokens or len(steps)))

    reads = sum(s.requests for s in steps)
    lookups = sum(s.lookups for s in steps)
    return {"prompt_bytes_read": prompt_bytes, "bytes_read_per_token": mean("bytes_read"),
            "bytes_needed_per_token": mean("bytes_needed"),
            "dense_ffn_bytes": dense_ffn_bytes, "share_of_dense_ffn": mean("bytes_read") / dense_ffn_bytes,
            "reads_per_token": mean("requests"),
            "mean_read_bytes": sum(s.bytes_read for s in steps) / reads if reads else 0.0,
            "cache_hit_rate": sum(s.hits for s in steps) / lookups if lookups else 1.0,
            "io_ms_per_token": 1e3 * mean("io_s"), "read_ms_per_token": 1e3 * mean("read_s"),
            # reads hidden behind compute (hot neurons computed meanwhile, reads started a layer ahead)
            "overlap_ms_per_token": max(0.0, 1e3 * (mean("read_s") - mean("io_s"))),
            "mem_ms_per_token": 1e3 * mean("mem_s"), "compute_ms_per_token": 1e3 * mean("compute_s"),
            "lookahead_used_per_token": mean("lookahead_used"),
            "lookahead_wasted_per_token": mean("lookahead_wasted"), "missed_per_token": mean("missed"),
            "attention_bytes_per_token": mean("attention_bytes"),
            "attention_full_bytes_per_token": mean("attention_full_bytes"),
            "kv_flash_bytes_per_token": mean("kv_flash_bytes"), "kv_flash_reads_per_token": mean("kv_flash_reads"),
            "kv_flash_ms_per_token": 1e3 * mean("kv_flash_s")}
