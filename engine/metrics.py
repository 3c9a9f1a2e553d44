"""Engine metrics cheap enough to leave on: plain counters and fixed-bucket histograms
updated where the work happens (no locks beyond the GIL; a snapshot reads them)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass
class Histogram:
    """Counts per upper bound (the last slot is everything above the last bound)."""

    bounds: tuple[float, ...] = LATENCY_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0
    n: int = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.n += 1

    def quantile(self, q: float) -> float | None:
        """Upper bound of the bucket holding quantile ``q`` (None before any observation)."""
        if not self.n:
            return None
        need, seen = q * self.n, 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            seen += count
            if seen >= need:
                return bound
        return float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.total, "count": self.n}


@dataclass
class EngineCounters:
    """Updated by contexts as they work (one instance per model)."""

    generated_tokens: int = 0
    fed_back_tokens: int = 0
    """Rows of generation steps: generated tokens that went back through a forward pass (all
    but each generation's last) plus drafted rows checked (``engine.drafting``)."""
    drafted_tokens: int = 0
    """Tokens drafters (or a grammar's forced tokens) proposed for verification."""
    accepted_draft_tokens: int = 0
    """Drafted tokens the sampler agreed with (kept)."""
    staged_hits: int = 0
    """Hand-built passes (``engine.forward_pass``) that found their pass staged and already
    queued or run (Pie's pass speculation), so they skipped the queue."""
    staged_misses: int = 0
    """Staged passes dropped: the next pass was not the one predicted (or none came)."""
    ttft: Histogram = field(default_factory=Histogram)
    """First token of a generation, measured from the stream's start (prefill included)."""
    itl: Histogram = field(default_factory=Histogram)
    """Between consecutive tokens of one generation."""


@dataclass(frozen=True)
class MetricsSnapshot:
    prompt_tokens: int
    """Prompt rows the forward passes computed (prefix-cache hits are not computed)."""
    generated_tokens: int
    passes: int
    steps: int
    max_steps_in_pass: int
    rows_computed: int
    pages_used: int
    pages_shared: int
    pages_cached: int
    pages_free: int
    encoder_cache_hits: int
    encoder_cache_misses: int
    open_contexts: int
    ttft: dict[str, Any]
    itl: dict[str, Any]
    kv_capacity_rows: int = 0
    """Rows of K/V the pool holds in all (``PoolStats.capacity_rows``)."""
    kv_dtype: str = ""
    """What the pages store (``Model.load(kv_dtype=...)``)."""
    encoder_cache_bytes: int = 0
    """Bytes of media embeddings the encoder cache holds (bounded by its byte budget)."""
    prepared_cache_bytes: int = 0
    """Bytes of prepared encoder inputs it holds (a budget of their own)."""
    drafted_tokens: int = 0
    """Tokens proposed for verification: drafters' guesses and a grammar's forced tokens."""
    accepted_draft_tokens: int = 0
    """Those the model's own choice agreed with (kept without a pass of their own)."""
    overlapped_passes: int = 0
    """Passes handed to the forward worker while the one before still ran (the scheduler's
    overlap, ``engine.scheduler``)."""
    device_fed_passes: int = 0
    """Passes launched on the device before the pass whose argmax they take as token ids
    had returned it to the host (the scheduler's device feed)."""
    staged_hits: int = 0
    """Hand-built passes that found their pass already staged (``EngineCounters``)."""
    staged_misses: int = 0
    """Staged passes dropped because the next pass was another."""

    @property
    def mean_steps_per_pass(self) -> float:
        return self.steps / self.passes if self.passes else 0.0
