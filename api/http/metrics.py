"""Prometheus metrics of one app (its own registry, so several apps in a process, as in
tests, never share counters). Engine state (KV pages, encoder cache, admission) is read
at scrape time by a collector; request-side events are counted as they happen."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, GCCollector, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from api.http.registry import ModelRegistry
from engine import frozen_objects

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _EngineCollector(Collector):
    def __init__(self, models: ModelRegistry):
        self.models = models

    def collect(self) -> Iterator[Any]:
        in_flight = GaugeMetricFamily(
            "pie_media_requests_in_flight", "Admitted requests per model", labels=["model"]
        )
        capacity = GaugeMetricFamily(
            "pie_media_max_concurrency", "Admission limit per model", labels=["model"]
        )
        pages = GaugeMetricFamily(
            "pie_media_kv_pages", "KV pages by state (used, shared, cached, free)", labels=["model", "state"]
        )
        contexts = GaugeMetricFamily(
            "pie_media_running_contexts", "Open contexts per model", labels=["model"]
        )
        kv_rows = GaugeMetricFamily(
            "pie_media_kv_capacity_rows",
            "Rows of K/V the model's page pool holds (grows with an int8/fp8 --kv-cache-dtype)",
            labels=["model", "kv_dtype"],
        )
        cache = CounterMetricFamily(
            "pie_media_encoder_cache", "Encoder-cache lookups by result", labels=["model", "result"]
        )
        cache_bytes = GaugeMetricFamily(
            "pie_media_encoder_cache_bytes",
            "Bytes the encoder cache holds: media embeddings, and prepared encoder inputs "
            "(each within its budget: --encoder-cache-mib, --prepared-cache-mib)",
            labels=["model", "kind"],
        )
        passes = CounterMetricFamily("pie_media_engine_passes", "Batched forward passes", labels=["model"])
        steps = CounterMetricFamily(
            "pie_media_engine_steps", "Context steps served by those passes", labels=["model"]
        )
        overlapped = CounterMetricFamily(
            "pie_media_engine_overlapped_passes",
            "Passes handed to the forward worker while the one before still ran (decode steps "
            "submitted ahead of their tokens; on by default on CUDA, PIE_MEDIA_OVERLAP)",
            labels=["model"],
        )
        fed = CounterMetricFamily(
            "pie_media_engine_device_fed_passes",
            "Graph decode passes launched before the pass whose argmax they take as token ids had "
            "reached the host (with the overlap on CUDA; PIE_MEDIA_DEVICE_FEED)",
            labels=["model"],
        )
        staged = CounterMetricFamily(
            "pie_media_engine_staged_passes",
            "Hand-built passes (inferlets' forward passes) staged while the pass before ran: "
            "hit (the next execute was that pass and skipped the queue) or miss (dropped)",
            labels=["model", "result"],
        )
        engine_tokens = CounterMetricFamily(
            "pie_media_engine_tokens", "Tokens the engine computed, by kind", labels=["model", "kind"]
        )
        drafts = CounterMetricFamily(
            "pie_media_draft_tokens",
            "Speculative decoding: tokens proposed for verification (drafters' guesses and a "
            "grammar's forced tokens) and those accepted",
            labels=["model", "result"],
        )
        speech = _SpeechFamilies()
        for served in self.models:
            in_flight.add_metric([served.name], served.in_flight)
            capacity.add_metric([served.name], served.max_concurrency)
            if served.kind == "speech":
                _speech_state(served, pages, contexts, passes, steps, engine_tokens)
                speech.add(served)
                continue
            if served.kind != "chat":
                continue
            m = served.model.metrics()  # the engine's own snapshot (engine/metrics.py)
            for state, value in (
                ("used", m.pages_used),
                ("shared", m.pages_shared),
                ("cached", m.pages_cached),
                ("free", m.pages_free),
            ):
                pages.add_metric([served.name, state], value)
            contexts.add_metric([served.name], m.open_contexts)
            kv_rows.add_metric([served.name, m.kv_dtype], m.kv_capacity_rows)
            cache.add_metric([served.name, "hit"], m.encoder_cache_hits)
            cache.add_metric([served.name, "miss"], m.encoder_cache_misses)
            cache_bytes.add_metric([served.name, "embeddings"], m.encoder_cache_bytes)
            cache_bytes.add_metric([served.name, "prepared"], m.prepared_cache_bytes)
            passes.add_metric([served.name], m.passes)
            steps.add_metric([served.name], m.steps)
            overlapped.add_metric([served.name], m.overlapped_passes)
            fed.add_metric([served.name], m.device_fed_passes)
            staged.add_metric([served.name, "hit"], m.staged_hits)
            staged.add_metric([served.name, "miss"], m.staged_misses)
            engine_tokens.add_metric([served.name, "prompt"], m.prompt_tokens)
            engine_tokens.add_metric([served.name, "generated"], m.generated_tokens)
            drafts.add_metric([served.name, "proposed"], m.drafted_tokens)
            drafts.add_metric([served.name, "accepted"], m.accepted_draft_tokens)
        yield from (in_flight, capacity, pages, contexts, kv_rows, cache, cache_bytes, passes, steps)
        yield from (engine_tokens, drafts, overlapped, fed, staged)
        yield from speech.families()


class _ServerStateCollector(Collector):
    """Server-wide state read at scrape time: the decoded-media cache's bytes
    (``media_refs.DecodedMediaCache``) and the inferlet runs still going."""

    def __init__(self, decoded_cache_bytes: Callable[[], int], inferlet_runs: Callable[[], int]):
        self.decoded_cache_bytes = decoded_cache_bytes
        self.inferlet_runs = inferlet_runs

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily(
            "pie_media_decoded_media_cache_bytes",
            "Bytes of decoded images and audio kept for repeats (--decoded-media-cache-mib)",
            value=self.decoded_cache_bytes(),
        )
        yield GaugeMetricFamily(
            "pie_media_inferlet_runs_running", "Inferlet runs not finished", value=self.inferlet_runs()
        )


class _FrozenHeapCollector(Collector):
    """How many objects the startup freeze took out of the garbage collector's walks
    (``engine/startup_heap.py``); prometheus-client's ``GCCollector`` beside it counts
    the collections by generation."""

    def collect(self) -> Iterator[Any]:
        yield GaugeMetricFamily(
            "pie_media_gc_frozen_objects",
            "Objects frozen out of garbage collection at startup (0: not frozen)",
            value=frozen_objects(),
        )


def _speech_state(served: Any, pages: Any, contexts: Any, passes: Any, steps: Any, tokens: Any) -> None:
    """A speech model's engine state: its pages, running streams, passes, rows and frames."""
    model = served.model
    pool = model.pool_stats()
    for state, value in (
        ("used", pool.in_use),
        ("shared", pool.shared),
        ("cached", pool.cached),
        ("free", pool.free),
    ):
        pages.add_metric([served.name, state], value)
    contexts.add_metric([served.name], model.capacity.streams)
    passes.add_metric([served.name], model.scheduler.stats.passes)
    steps.add_metric([served.name], model.scheduler.stats.steps)
    tokens.add_metric([served.name, "prompt"], model.stats.prompt_rows)
    tokens.add_metric([served.name, "prompt_reused"], model.stats.reused_rows)
    tokens.add_metric([served.name, "generated"], model.stats.frames)


class _SpeechFamilies:
    """A speech model's admission and real-time state (``speech.admission``,
    ``speech.frame_timing``): what fits and why, admissions by result and bound, the
    measured frame time per batch size, and each stream's real-time margin (audio seconds
    generated per wall second; below 1 a listener hears gaps)."""

    def __init__(self) -> None:
        self.served = False
        self.fit = GaugeMetricFamily(
            "pie_media_speech_streams_fit",
            "Speech streams that fit at once now, by the bound that sets it (pages, time, max_streams)",
            labels=["model", "bound"],
        )
        self.admitted = CounterMetricFamily(
            "pie_media_speech_admitted", "Speech streams admitted", labels=["model"]
        )
        self.refused = CounterMetricFamily(
            "pie_media_speech_refused",
            "Speech requests refused (429 at once, or when their wait's deadline passed), by the "
            "bound met: pages, time (would fall behind real time), max_streams, queue (full)",
            labels=["model", "reason"],
        )
        self.waited = CounterMetricFamily(
            "pie_media_speech_waited",
            "Speech requests that queued for admission, by the bound they first met",
            labels=["model", "reason"],
        )
        self.timed_out = CounterMetricFamily(
            "pie_media_speech_wait_timeouts",
            "Speech requests whose wait for admission passed its deadline (429), by the bound last met",
            labels=["model", "reason"],
        )
        self.waiting = GaugeMetricFamily(
            "pie_media_speech_waiting",
            "Speech requests waiting for admission now (queued whole files, blocking callers)",
            labels=["model"],
        )
        self.longest_wait = GaugeMetricFamily(
            "pie_media_speech_longest_wait_seconds",
            "How long the longest-waiting speech request has waited for admission so far (0: none waits)",
            labels=["model"],
        )
        self.waits = HistogramMetricFamily(
            "pie_media_speech_admission_wait_seconds",
            "Seconds each queued speech request waited before it was admitted",
            labels=["model"],
        )
        self.frame_seconds = GaugeMetricFamily(
            "pie_media_speech_frame_pass_seconds",
            "Measured wall time of a frame pass (one frame for every stream in it), by batch size",
            labels=["model", "batch"],
        )
        self.frame_audio = GaugeMetricFamily(
            "pie_media_speech_frame_audio_seconds", "Audio length of one frame", labels=["model"]
        )
        self.predicted = GaugeMetricFamily(
            "pie_media_speech_predicted_realtime_margin",
            "Frame audio length over the frame pass time predicted at the running batch size "
            "(>= 1: every running stream keeps real time)",
            labels=["model"],
        )
        self.running = GaugeMetricFamily(
            "pie_media_speech_stream_realtime_margin",
            "Real-time margin of the running streams (audio s generated per wall s since the "
            "stream's first frame): the slowest and the mean",
            labels=["model", "stat"],
        )
        self.behind = GaugeMetricFamily(
            "pie_media_speech_streams_behind_realtime",
            "Running speech streams generating slower than real time",
            labels=["model"],
        )
        self.finished = HistogramMetricFamily(
            "pie_media_speech_realtime_margin",
            "Real-time margin of each finished speech stream (audio s generated per wall s)",
            labels=["model"],
        )

    def add(self, served: Any) -> None:
        model, name = served.model, served.name
        capacity = model.capacity
        headroom = capacity.headroom()
        self.fit.add_metric([name, headroom.bound], headroom.fit)
        self.served = True
        self.admitted.add_metric([name], capacity.admitted)
        for reason, n in capacity.refused.items():
            self.refused.add_metric([name, reason], n)
        for reason, n in capacity.waited.items():
            self.waited.add_metric([name, reason], n)
        for reason, n in capacity.timed_out.items():
            self.timed_out.add_metric([name, reason], n)
        waiting = capacity.waiting()
        self.waiting.add_metric([name], waiting.count)
        self.longest_wait.add_metric([name], waiting.longest_s)
        self.waits.add_metric([name], _buckets(capacity.waits), sum_value=capacity.waits.total)
        timing = model.timing
        self.frame_audio.add_metric([name], timing.frame_seconds)
        for batch, (seconds, _) in timing.table().items():
            self.frame_seconds.add_metric([name, str(batch)], seconds)
        predicted = timing.predict(max(1, capacity.streams))
        if predicted:
            self.predicted.add_metric([name], timing.frame_seconds / predicted)
        margins = model.pace.running_margins()
        if margins:
            self.running.add_metric([name, "min"], min(margins))
            self.running.add_metric([name, "mean"], sum(margins) / len(margins))
        self.behind.add_metric([name], sum(m < 1.0 for m in margins))
        hist = model.pace.finished
        self.finished.add_metric([name], _buckets(hist), sum_value=hist.total)

    def families(self) -> tuple[Any, ...]:
        if not self.served:
            return ()
        return (
            self.fit,
            self.admitted,
            self.refused,
            self.waited,
            self.timed_out,
            self.waiting,
            self.longest_wait,
            self.waits,
            self.frame_seconds,
            self.frame_audio,
            self.predicted,
            self.running,
            self.behind,
            self.finished,
        )


def _buckets(hist: Any) -> list[tuple[str, int]]:
    """An ``engine.Histogram``'s cumulative buckets in Prometheus' shape."""
    cumulative, buckets = 0, []
    for bound, count in zip((*hist.bounds, float("inf")), hist.counts, strict=True):
        cumulative += count
        buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), cumulative))
    return buckets


class ServiceMetrics:
    def __init__(
        self,
        models: ModelRegistry,
        decoded_cache_bytes: Callable[[], int] = lambda: 0,
        inferlet_runs: Callable[[], int] = lambda: 0,
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pie_media_http_requests",
            "HTTP requests by route and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.media_errors = Counter("pie_media_errors", "Typed errors by code", ["code"], registry=r)
        # per key, by the key's name from the key file (never the key itself)
        self.key_requests = Counter(
            "pie_media_key_requests", "Authenticated /v1 requests by key name", ["key"], registry=r
        )
        self.key_tokens = Counter(
            "pie_media_key_tokens", "Prompt plus generated tokens by key name", ["key"], registry=r
        )
        self.key_limited = Counter(
            "pie_media_key_limited",
            "Requests refused (429) at a per-key limit, by key name and limit",
            ["key", "limit"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pie_media_prompt_tokens", "Prompt tokens (media included)", ["model"], registry=r
        )
        self.generated_tokens = Counter(
            "pie_media_generated_tokens", "Generated tokens", ["model"], registry=r
        )
        self.ttft = Histogram(
            "pie_media_time_to_first_token_seconds",
            "Request start to first token",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pie_media_inter_token_latency_seconds",
            "Time between tokens of one choice",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.speech_ttfa = Histogram(
            "pie_media_speech_time_to_first_audio_seconds",
            "Speech request start to its first audio chunk",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        r.register(_EngineCollector(models))
        r.register(_ServerStateCollector(decoded_cache_bytes, inferlet_runs))
        r.register(_FrozenHeapCollector())
        GCCollector(registry=r)  # python_gc_collections_total{generation=...} and friends

    def render(self) -> bytes:
        return generate_latest(self.registry)
