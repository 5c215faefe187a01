"""kilnlm's serving metrics, declared once, over any metrics backend (Triton's custom metrics, prometheus-client).

TensorRT-LLM's Triton backend families come first, with its names, label names and label values, so its
dashboards work unchanged; ``kilnlm_*`` names are kept only for what TensorRT-LLM does not export. Every
series carries TensorRT-LLM's labels ``model`` (the served model's name) and ``version`` (its version).

=========================================  =========  ====================================================
``nv_trt_llm_request_metrics``             gauge      label ``request_type``: ``active`` (admitted,
                                                      holding KV blocks), ``max`` (max_batch_size),
                                                      ``scheduled`` (sequences in the last step),
                                                      ``context`` (of them in the context phase),
                                                      ``waiting`` (waiting for admission)
``nv_trt_llm_kv_cache_block_metrics``      gauge      label ``kv_cache_block_type``: ``max`` (blocks in
                                                      the pool), ``free``, ``used``, ``tokens_per``
                                                      (tokens per block), ``fraction`` (used / max),
                                                      and, cumulative since start, ``reused`` (blocks
                                                      allocations took from the prefix cache),
                                                      ``alloc_total`` (blocks allocations needed: reused
                                                      + new), ``alloc_new``; prefix-cache hit rate =
                                                      reused / alloc_total
``nv_trt_llm_inflight_batcher_metrics``    gauge      label ``inflight_batcher_specific_metric``:
                                                      ``total_context_tokens`` / ``generation_requests``
                                                      / ``paused_requests`` (preempted) of the last step,
                                                      ``micro_batch_id`` (always 0: one micro-batch)
``nv_trt_llm_general_metrics``             gauge      label ``general_type``: ``iteration_counter``,
                                                      ``timestamp`` (of the last stats snapshot, in
                                                      microseconds since the epoch)
``kilnlm_speculative_decoding_metrics``    gauge      label ``spec_decoding_metric``, cumulative since
                                                      start: ``total_draft_tokens`` (verified),
                                                      ``total_accepted_draft_tokens``, ``acceptance_rate``
                                                      (accepted / verified; 0 before any draft)
``nv_llm_input_token_len``                 histogram  prompt tokens per request, label
                                                      ``response_metric_type="total_input_tokens"``
``nv_llm_output_token_len``                histogram  generated tokens per sequence, label
                                                      ``response_metric_type="total_output_tokens"``
``kilnlm_time_to_first_token_seconds``     histogram  TTFT: request arrival -> its first token (s)
``kilnlm_inter_token_latency_seconds``     histogram  ITL: between consecutive replies carrying tokens (s)
``kilnlm_queue_time_seconds``              histogram  arrival -> first admission by the scheduler (s)
``kilnlm_e2e_request_latency_seconds``     histogram  arrival -> final response of a sequence (s)
``kilnlm_requests_finished_total``         counter    finished sequences, label ``finish_reason``
``kilnlm_generated_tokens_total``          counter    generated tokens, counted as they are streamed
``kilnlm_kv_cache_cached_blocks``          gauge      KV blocks reusable by prefix hash (free or used)
=========================================  =========  ====================================================

The ``nv_*`` token histograms use TensorRT-LLM's buckets (:data:`TOKEN_COUNT_BUCKETS`), the latency ones
:data:`LATENCY_BUCKETS_S`.

The API both fronts use (the Triton model and ``kilnlm serve``), one :class:`Metrics` per served model::

    metrics = Metrics(backend, model_name, model_version="1")
    metrics.update_stats(executor.stats())              # every ~0.1 s: the gauges
    timing = RequestTiming(arrival_s=time.monotonic())   # when a request arrives
    metrics.observe_response(timing, response, time.monotonic())   # each executor Response of it
    metrics.count_finished(finish_reason)                # once per finished sequence

A backend is anything with ``family(spec) -> family`` whose families make series with
``metric(labels, buckets) -> series`` (gauges ``set``, counters ``increment``, histograms ``observe``):
:class:`InMemoryBackend` keeps the values in a dict (tests, and fronts that render their own exposition),
:class:`PrometheusBackend` registers them in a prometheus-client ``CollectorRegistry`` (``kilnlm serve``'s
``/metrics``), :class:`kilnlm.runtime.serving.triton_backend.TritonMetricsBackend` makes Triton's custom
metrics (the metrics port).
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_COUNT_BUCKETS = (10.0, 50.0, 100.0, 500.0, 1000.0)  # TensorRT-LLM's nv_llm_*_token_len buckets
MODEL_LABELS = ("model", "version")


class MetricKind(str, enum.Enum):
    GAUGE = "gauge"
    COUNTER = "counter"
    HISTOGRAM = "histogram"


@dataclasses.dataclass(frozen=True)
class MetricSpec:
    """One metric family: its name, help text, kind, label names after :data:`MODEL_LABELS` and, for a
    histogram, its bucket upper bounds (seconds or tokens)."""

    name: str
    description: str
    kind: MetricKind
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None

    @property
    def label_names(self) -> tuple[str, ...]:
        return MODEL_LABELS + self.labels


def _gauge(name: str, description: str, label: str) -> MetricSpec:
    return MetricSpec(name, description, MetricKind.GAUGE, (label,))


def _histogram(name: str, description: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()) -> MetricSpec:
    return MetricSpec(name, description, MetricKind.HISTOGRAM, labels, buckets)


REQUEST_METRICS = _gauge("nv_trt_llm_request_metrics", "TRT LLM request metrics", "request_type")
KV_CACHE_BLOCK_METRICS = _gauge("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics",
                                "kv_cache_block_type")
INFLIGHT_BATCHER_METRICS = _gauge("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight_batcher-specific metrics",
                                  "inflight_batcher_specific_metric")
GENERAL_METRICS = _gauge("nv_trt_llm_general_metrics", "General TRT LLM metrics", "general_type")
SPECULATIVE_DECODING_METRICS = _gauge("kilnlm_speculative_decoding_metrics", "Speculative decoding since start",
                                      "spec_decoding_metric")
INPUT_TOKEN_LEN = _histogram("nv_llm_input_token_len", "Prompt tokens per request", TOKEN_COUNT_BUCKETS,
                             ("response_metric_type",))
OUTPUT_TOKEN_LEN = _histogram("nv_llm_output_token_len", "Generated tokens per sequence", TOKEN_COUNT_BUCKETS,
                              ("response_metric_type",))
TIME_TO_FIRST_TOKEN = _histogram("kilnlm_time_to_first_token_seconds",
                                 "Time from request arrival to its first token (s)", LATENCY_BUCKETS_S)
INTER_TOKEN_LATENCY = _histogram("kilnlm_inter_token_latency_seconds",
                                 "Time between consecutive responses of a request (s)", LATENCY_BUCKETS_S)
QUEUE_TIME = _histogram("kilnlm_queue_time_seconds",
                        "Time from request arrival to its first admission by the scheduler (s)", LATENCY_BUCKETS_S)
E2E_REQUEST_LATENCY = _histogram("kilnlm_e2e_request_latency_seconds",
                                 "Time from request arrival to a sequence's final response (s)", LATENCY_BUCKETS_S)
REQUESTS_FINISHED = MetricSpec("kilnlm_requests_finished_total", "Finished sequences by finish reason",
                               MetricKind.COUNTER, ("finish_reason",))
GENERATED_TOKENS = MetricSpec("kilnlm_generated_tokens_total", "Generated tokens", MetricKind.COUNTER)
KV_CACHE_CACHED_BLOCKS = MetricSpec("kilnlm_kv_cache_cached_blocks", "KV-cache blocks reusable by prefix hash",
                                    MetricKind.GAUGE)
ALL_METRICS = (REQUEST_METRICS, KV_CACHE_BLOCK_METRICS, INFLIGHT_BATCHER_METRICS, GENERAL_METRICS, INPUT_TOKEN_LEN,
               OUTPUT_TOKEN_LEN, TIME_TO_FIRST_TOKEN, INTER_TOKEN_LATENCY, QUEUE_TIME, E2E_REQUEST_LATENCY,
               REQUESTS_FINISHED, GENERATED_TOKENS, KV_CACHE_CACHED_BLOCKS, SPECULATIVE_DECODING_METRICS)


def _used_blocks(s) -> int:
    return s.num_total_blocks - s.num_free_blocks


# Each gauge family's label values and how each is read from the executor's IterationStats ``s``.
STATS_GAUGES = {
    REQUEST_METRICS: {
        "active": lambda s: s.num_active_requests,
        "max": lambda s: s.max_num_active_requests,
        "scheduled": lambda s: s.last_num_seqs,
        "context": lambda s: s.last_num_context_requests,
        "waiting": lambda s: s.num_queued,
    },
    KV_CACHE_BLOCK_METRICS: {
        "max": lambda s: s.num_total_blocks,
        "free": lambda s: s.num_free_blocks,
        "used": _used_blocks,
        "tokens_per": lambda s: s.tokens_per_block,
        "fraction": lambda s: _used_blocks(s) / s.num_total_blocks if s.num_total_blocks else 0.0,
        "reused": lambda s: s.num_reused_blocks,
        "alloc_total": lambda s: s.num_needed_blocks,
        "alloc_new": lambda s: s.num_needed_blocks - s.num_reused_blocks,
    },
    INFLIGHT_BATCHER_METRICS: {
        "total_context_tokens": lambda s: s.last_num_context_tokens,
        "generation_requests": lambda s: s.last_num_generation_requests,
        "micro_batch_id": lambda s: 0,
        "paused_requests": lambda s: s.last_num_paused_requests,
    },
    GENERAL_METRICS: {
        "iteration_counter": lambda s: s.num_iterations,
        "timestamp": lambda s: round(s.timestamp_s * 1e6),
    },
    SPECULATIVE_DECODING_METRICS: {  # TensorRT-LLM's names for the counts
        "total_draft_tokens": lambda s: s.total_draft_tokens,
        "total_accepted_draft_tokens": lambda s: s.total_accepted_draft_tokens,
        "acceptance_rate": lambda s: s.total_accepted_draft_tokens / s.total_draft_tokens if s.total_draft_tokens else 0.0,
    },
}


class MetricsBackend(Protocol):
    def family(self, spec: MetricSpec):
        """A metric family for ``spec``; its ``metric(labels: dict[str, str], buckets=None)`` makes one
        series (``labels``: a value for each of ``spec.label_names``; ``buckets``: a histogram's upper
        bounds, ``spec.buckets``)."""


@dataclasses.dataclass
class RequestTiming:
    """One request's observation state: when it arrived and when its last tokens went out
    (``time.monotonic`` seconds), and whether its queue time and prompt length were observed."""

    arrival_s: float
    last_token_s: float | None = None
    queue_time_observed: bool = False
    prompt_observed: bool = False


class Metrics:
    """The metrics of one served model (see the module docstring for the families and the API).

    Not thread-safe: one owner (the dispatcher thread).
    """

    def __init__(self, backend: MetricsBackend, model_name: str, model_version: str = "1") -> None:
        self._labels = {"model": model_name, "version": str(model_version)}
        # Every family lives as long as its series: Triton refuses to update a metric whose MetricFamily
        # object has been deleted ("Invalid metric operation").
        self._families = {spec.name: backend.family(spec) for spec in ALL_METRICS}
        self._finished: dict[str, object] = {}
        self._stats_gauges = [(self._series(spec, **{spec.labels[0]: value}), read)
                              for spec, values in STATS_GAUGES.items() for value, read in values.items()]
        self.cached_blocks = self._series(KV_CACHE_CACHED_BLOCKS)
        self.generated_tokens = self._series(GENERATED_TOKENS)
        self.input_token_len = self._series(INPUT_TOKEN_LEN, response_metric_type="total_input_tokens")
        self.output_token_len = self._series(OUTPUT_TOKEN_LEN, response_metric_type="total_output_tokens")
        self.ttft = self._series(TIME_TO_FIRST_TOKEN)
        self.itl = self._series(INTER_TOKEN_LATENCY)
        self.queue_time = self._series(QUEUE_TIME)
        self.e2e_latency = self._series(E2E_REQUEST_LATENCY)

    def _series(self, spec: MetricSpec, **labels: str):
        buckets = list(spec.buckets) if spec.buckets is not None else None
        return self._families[spec.name].metric(labels={**self._labels, **labels}, buckets=buckets)

    def update_stats(self, stats) -> None:
        """Refresh the gauges from ``stats``, the executor's ``IterationStats``."""
        for series, read in self._stats_gauges:
            series.set(float(read(stats)))
        self.cached_blocks.set(float(stats.num_cached_blocks))

    def observe_response(self, timing: RequestTiming, response, now_s: float) -> None:
        """One executor ``Response`` of a request reached its client at ``now_s``: its new tokens
        (:meth:`observe_new_tokens`), the request's queue time (once, from ``response.queue_time_s``) and,
        when the response is a sequence's final one, the end-to-end latency, the generated tokens of the
        sequence and (once per request) its prompt tokens. Updates ``timing``."""
        self.observe_new_tokens(timing, len(response.token_ids), now_s)
        if response.queue_time_s is not None and not timing.queue_time_observed:
            self.queue_time.observe(response.queue_time_s)
            timing.queue_time_observed = True
        if response.finished:
            self.e2e_latency.observe(now_s - timing.arrival_s)
            self.output_token_len.observe(float(response.num_generated_tokens))
            if not timing.prompt_observed:
                self.input_token_len.observe(float(response.num_prompt_tokens))
                timing.prompt_observed = True

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

    def count_finished(self, reason: str) -> None:
        """One more finished sequence with ``finish_reason`` label ``reason``."""
        if reason not in self._finished:
            self._finished[reason] = self._series(REQUESTS_FINISHED, finish_reason=reason)
        self._finished[reason].increment(1)


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

    def find(self, name: str, **labels: str) -> _Series | None:
        """The series ``name`` whose labels include ``labels`` (None when there is none)."""
        for (series_name, items), series in self.series.items():
            if series_name == name and set(labels.items()) <= set(items):
                return series
        return None

    def value(self, name: str, **labels: str) -> float:
        """The value of the series ``name`` whose labels include ``labels`` (0.0 when there is none)."""
        series = self.find(name, **labels)
        return series.value if series is not None else 0.0


# ---------------------------------------------------------------------------------- prometheus-client
class _PrometheusSeries:
    def __init__(self, child) -> None:
        self._child = child

    def set(self, value: float) -> None:
        self._child.set(value)

    def increment(self, value: float) -> None:
        self._child.inc(value)

    def observe(self, value: float) -> None:
        self._child.observe(value)


class _PrometheusFamily:
    def __init__(self, collector) -> None:
        self._collector = collector

    def metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> _PrometheusSeries:
        return _PrometheusSeries(self._collector.labels(**labels))


class PrometheusBackend:
    """The families as prometheus-client collectors in ``registry`` (default: a new ``CollectorRegistry``,
    not the process-wide default one); histograms take their spec's buckets. Several :class:`Metrics`
    (models) may share one backend: each family is registered once. :meth:`render` is the text exposition
    a ``/metrics`` endpoint returns (content type ``prometheus_client.CONTENT_TYPE_LATEST``).

    Raises ``ImportError`` when prometheus-client is not installed (``pip install kilnlm[serve]``).
    """

    def __init__(self, registry=None) -> None:
        import prometheus_client

        self._prometheus = prometheus_client
        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()
        self._families: dict[str, _PrometheusFamily] = {}

    def family(self, spec: MetricSpec) -> _PrometheusFamily:
        if spec.name not in self._families:
            p = self._prometheus
            kind = {MetricKind.GAUGE: p.Gauge, MetricKind.COUNTER: p.Counter, MetricKind.HISTOGRAM: p.Histogram}[spec.kind]
            extra = {"buckets": spec.buckets} if spec.kind is MetricKind.HISTOGRAM else {}
            collector = kind(spec.name, spec.description, labelnames=spec.label_names, registry=self.registry, **extra)
            self._families[spec.name] = _PrometheusFamily(collector)
        return self._families[spec.name]

    def render(self) -> bytes:
        """The registry in Prometheus' text exposition format."""
        return self._prometheus.generate_latest(self.registry)
