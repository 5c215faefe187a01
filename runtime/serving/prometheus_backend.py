"""prometheus-client as a :class:`~kilnlm.runtime.serving.metrics.Metrics` backend: every family in one
``CollectorRegistry`` that the owner renders (``kilnlm serve``'s ``GET /metrics``).

(Stand-in until the metrics module's own ``PrometheusBackend`` lands; the same ``family(spec)`` API.)
"""

from __future__ import annotations

from kilnlm.runtime.serving.metrics import MetricKind, MetricSpec


class _Series:
    def __init__(self, child) -> None:
        self._child = child

    def set(self, value: float) -> None:
        self._child.set(value)

    def increment(self, value: float) -> None:
        self._child.inc(value)

    def observe(self, value: float) -> None:
        self._child.observe(value)


class _Family:
    """One prometheus-client metric, made on the first series (its label names and buckets are the first
    series'; every series of a kilnlm family has the same label names)."""

    def __init__(self, spec: MetricSpec, registry) -> None:
        self._spec, self._registry = spec, registry
        self._metric = None

    def metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> _Series:
        if self._metric is None:
            import prometheus_client

            kind = {MetricKind.GAUGE: prometheus_client.Gauge, MetricKind.COUNTER: prometheus_client.Counter,
                    MetricKind.HISTOGRAM: prometheus_client.Histogram}[self._spec.kind]
            extra = {"buckets": buckets} if self._spec.kind is MetricKind.HISTOGRAM and buckets else {}
            self._metric = kind(self._spec.name, self._spec.description, labelnames=sorted(labels),
                                registry=self._registry, **extra)
        return _Series(self._metric.labels(**labels))


class PrometheusBackend:
    """Metric families in ``registry`` (a fresh ``prometheus_client.CollectorRegistry`` when None: no
    process-global registry); :meth:`exposition` renders them in Prometheus' text format."""

    def __init__(self, registry=None) -> None:
        import prometheus_client

        self.registry = registry if registry is not None else prometheus_client.CollectorRegistry()

    def family(self, spec: MetricSpec) -> _Family:
        return _Family(spec, self.registry)

    def exposition(self) -> tuple[bytes, str]:
        """``(body, content type)`` of every series in the registry, Prometheus' text format."""
        import prometheus_client

        return prometheus_client.generate_latest(self.registry), prometheus_client.CONTENT_TYPE_LATEST
