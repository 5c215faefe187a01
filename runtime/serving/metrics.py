"""kilnlm's serving metrics, declared once, over any metrics backend (Triton's custom metrics, Prometheus).

=======================================  =========  =========================================================
``kilnlm_kv_cache_free_blocks``          gauge      free KV-cache blocks
``kilnlm_kv_cache_total_blocks``         gauge      KV-cache blocks
``kilnlm_kv_cache_cached_blocks``        gauge      KV-cache blocks reusable by prefix hash
``kilnlm_active_requests``               gauge      requests admitted by the executor (holding KV blocks)
``kilnlm_queued_requests``               gauge      requests waiting for admission
``kilnlm_requests_finished_total``       counter    finished requests, label ``finish_reason``
``kilnlm_generated_tokens_total``        counter    generated tokens
``kilnlm_time_to_first_token_seconds``   histogram  TTFT: request arrival -> its first token (s)
``kilnlm_inter_token_latency_seconds``   histogram  ITL: between consecutive replies of a request (s)
=======================================  =========  =========================================================

Every series carries the label ``model`` (the served model's name). A backend is anything with
``family(spec) -> family`` whose families make metrics with ``metric(labels, buckets) -> metric`` (gauges
``set``, counters ``increment``, histograms ``observe``); :class:`InMemoryBackend` keeps the values in a dict
(tests, and fronts that render their own exposition).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class MetricKind(str, enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    name: str
    description: str
    kind: MetricKind


KV_CACHE_FREE_BLOCKS = MetricSpec("kilnlm_kv_cache_free_blocks", "Free KV-cache blocks", MetricKind.GAUGE)
KV_CACHE_TOTAL_BLOCKS = MetricSpec("kilnlm_kv_cache_total_blocks", "KV-cache blocks", MetricKind.GAUGE)
KV_CACHE_CACHED_BLOCKS = MetricSpec("kilnlm_kv_cache_cached_blocks", "KV-cache blocks reusable by prefix hash",
                                    MetricKind.GAUGE)
ACTIVE_REQUESTS = MetricSpec("kilnlm_active_requests", "Requests admitted by the executor (holding KV blocks)",
                             MetricKind.GAUGE)
QUEUED_REQUESTS = MetricSpec("kilnlm_queued_requests", "Requests waiting for admission", MetricKind.GAUGE)
REQUESTS_FINISHED = MetricSpec("kilnlm_requests_finished_total", "Finished requests by finish reason",
                               MetricKind.COUNTER)
GENERATED_TOKENS = MetricSpec("kilnlm_generated_tokens_total", "Generated tokens", MetricKind.COUNTER)
TIME_TO_FIRST_TOKEN = MetricSpec("kilnlm_time_to_first_token_seconds",
                                 "Time from request arrival to its first token (s)", MetricKind.HISTOGRAM)
INTER_TOKEN_LATENCY = MetricSpec("kilnlm_inter_token_latency_seconds",
                                 "Time between consecutive responses of a request (s)", MetricKind.HISTOGRAM)
ALL_METRICS = (KV_CACHE_FREE_BLOCKS, KV_CACHE_TOTAL_BLOCKS, KV_CACHE_CACHED_BLOCKS, ACTIVE_REQUESTS,
               QUEUED_REQUESTS, REQUESTS_FINISHED, GENERATED_TOKENS, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY)


class MetricsBackend(Protocol):
    def family(self, spec: MetricSpec):
        """A metric family for ``spec``; its ``metric(labels: dict[str, str], buckets=None)`` makes one
        series (``buckets``: a histogram's upper bounds in seconds)."""


@dataclasses.dataclass
class RequestTiming:
    """When a request arrived and when its last token went out (``time.monotonic`` seconds)."""

    arrival_s: float
    last_token_s: float | None = None


class Metrics:
    """The metrics of one served model. Not thread-safe: one owner (the dispatcher thread)."""

    def __init__(self, backend: MetricsBackend, model_name: str) -> None:
        self._labels = {"model": model_name}
        # Every family lives as long as its series: Triton refuses to update a metric whose MetricFamily
        # object has been deleted ("Invalid metric operation").
        self._families = {spec.name: backend.family(spec) for spec in ALL_METRICS}
        self._finished: dict[str, object] = {}

        def series(spec: MetricSpec):
            buckets = list(LATENCY_BUCKETS_S) if spec.kind is MetricKind.HISTOGRAM else None
            return self._families[spec.name].metric(labels=dict(self._labels), buckets=buckets)

        self.free_blocks = series(KV_CACHE_FREE_BLOCKS)
        self.total_blocks = series(KV_CACHE_TOTAL_BLOCKS)
        self.cached_blocks = series(KV_CACHE_CACHED_BLOCKS)
        self.active_requests = series(ACTIVE_REQUESTS)
        self.queued_requests = series(QUEUED_REQUESTS)
        self.generated_tokens = series(GENERATED_TOKENS)
        self.ttft = series(TIME_TO_FIRST_TOKEN)
        self.itl = series(INTER_TOKEN_LATENCY)

    def count_finished(self, reason: str) -> None:
        """One more finished request with ``finish_reason`` label ``reason``."""
        if reason not in self._finished:
            self._finished[reason] = self._families[REQUESTS_FINISHED.name].metric(
                labels={**self._labels, "finish_reason": reason}, buckets=None)
        self._finished[reason].increment(1)

    def observe_new_tokens(self, timing: RequestTiming, num_tokens: int, now_s: float) -> None:
        """A reply of a request carrying ``num_tokens`` new tokens left at ``now_s``: counts the tokens and
        observes TTFT (its first tokens) or ITL (later ones); updates ``timing``. No-op for 0 tokens."""
        if num_tokens <= 0:
            return
        self.generated_tokens.increment(num_tokens)
        if timing.last_token_s is None:
            self.ttft.observe(now_s - timing.arrival_s)
        else:
            self.itl.observe(now_s - timing.last_token_s)
        timing.last_token_s = now_s

    def update_stats(self, stats) -> None:
        """Refresh the gauges from ``stats``, the executor's ``IterationStats``."""
        self.free_blocks.set(float(stats.num_free_blocks))
        self.total_blocks.set(float(stats.num_total_blocks))
        self.cached_blocks.set(float(stats.num_cached_blocks))
        self.active_requests.set(float(stats.num_active_requests))
        self.queued_requests.set(float(stats.num_queued))


# ------------------------------------------------------------------------------------ in-memory backend
class _Series:
    def __init__(self, buckets: list[float] | None) -> None:
        self.value = 0.0
        self.buckets = buckets
        self.observations: list[float] = []

    def set(self, value: float) -> None:
        self.value = float(value)

    def increment(self, value: float) -> None:
        self.value += value

    def observe(self, value: float) -> None:
        self.observations.append(float(value))
        self.value += value


class _Family:
    def __init__(self, spec: MetricSpec, store: dict) -> None:
        self._spec, self._store = spec, store

    def metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> _Series:
        key = (self._spec.name, tuple(sorted(labels.items())))
        return self._store.setdefault(key, _Series(buckets))


class InMemoryBackend:
    """Keeps every series in memory: ``series`` maps ``(name, sorted label items)`` to an object with
    ``value`` (a gauge's value, a counter's total, a histogram's sum) and ``observations`` (histograms)."""

    def __init__(self) -> None:
        self.series: dict[tuple[str, tuple[tuple[str, str], ...]], _Series] = {}

    def family(self, spec: MetricSpec) -> _Family:
        return _Family(spec, self.series)

    def value(self, name: str, **labels: str) -> float:
        """The value of the series ``name`` whose labels include ``labels`` (0.0 when there is none)."""
        for (series_name, items), series in self.series.items():
            if series_name == name and set(labels.items()) <= set(items):
                return series.value
        return 0.0
