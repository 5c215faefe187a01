"""kilnlm.runtime.serving.metrics over the in-memory backend: names, labels, the stats update, token
counting and TTFT / ITL observations. No tritonserver needed."""

from __future__ import annotations

import pytest

from kilnlm.runtime.executor import IterationStats
from kilnlm.runtime.serving.metrics import (ALL_METRICS, LATENCY_BUCKETS_S, InMemoryBackend, MetricKind, Metrics,
                                            RequestTiming)


def test_metric_names_are_kilnlms():
    assert {spec.name: spec.kind for spec in ALL_METRICS} == {
        "kilnlm_kv_cache_free_blocks": MetricKind.GAUGE,
        "kilnlm_kv_cache_total_blocks": MetricKind.GAUGE,
        "kilnlm_kv_cache_cached_blocks": MetricKind.GAUGE,
        "kilnlm_active_requests": MetricKind.GAUGE,
        "kilnlm_queued_requests": MetricKind.GAUGE,
        "kilnlm_requests_finished_total": MetricKind.COUNTER,
        "kilnlm_generated_tokens_total": MetricKind.COUNTER,
        "kilnlm_time_to_first_token_seconds": MetricKind.HISTOGRAM,
        "kilnlm_inter_token_latency_seconds": MetricKind.HISTOGRAM,
    }


def test_update_stats_sets_the_gauges():
    backend = InMemoryBackend()
    metrics = Metrics(backend, "kilnlm")
    metrics.update_stats(IterationStats(num_active_requests=3, num_queued=2, num_free_blocks=10,
                                        num_total_blocks=16, num_cached_blocks=4))
    assert backend.value("kilnlm_kv_cache_free_blocks", model="kilnlm") == 10.0
    assert backend.value("kilnlm_kv_cache_total_blocks", model="kilnlm") == 16.0
    assert backend.value("kilnlm_kv_cache_cached_blocks", model="kilnlm") == 4.0
    assert backend.value("kilnlm_active_requests", model="kilnlm") == 3.0
    assert backend.value("kilnlm_queued_requests", model="kilnlm") == 2.0


def test_finished_requests_are_counted_per_finish_reason():
    backend = InMemoryBackend()
    metrics = Metrics(backend, "m")
    for reason in ("length", "stop", "length", "cancelled"):
        metrics.count_finished(reason)
    assert backend.value("kilnlm_requests_finished_total", model="m", finish_reason="length") == 2.0
    assert backend.value("kilnlm_requests_finished_total", model="m", finish_reason="stop") == 1.0
    assert backend.value("kilnlm_requests_finished_total", model="m", finish_reason="cancelled") == 1.0
    assert backend.value("kilnlm_requests_finished_total", model="m", finish_reason="end_id") == 0.0


def test_first_tokens_observe_ttft_later_ones_itl():
    backend = InMemoryBackend()
    metrics = Metrics(backend, "m")
    timing = RequestTiming(arrival_s=100.0)
    metrics.observe_new_tokens(timing, 0, now_s=100.1)  # nothing generated yet: nothing observed
    metrics.observe_new_tokens(timing, 2, now_s=100.5)
    metrics.observe_new_tokens(timing, 1, now_s=100.75)
    metrics.observe_new_tokens(timing, 1, now_s=101.0)
    assert timing.last_token_s == 101.0
    assert backend.value("kilnlm_generated_tokens_total", model="m") == 4.0
    ttft = backend.series[("kilnlm_time_to_first_token_seconds", (("model", "m"),))]
    itl = backend.series[("kilnlm_inter_token_latency_seconds", (("model", "m"),))]
    assert ttft.observations == pytest.approx([0.5])
    assert itl.observations == pytest.approx([0.25, 0.25])
    assert ttft.buckets == list(LATENCY_BUCKETS_S) and itl.buckets == list(LATENCY_BUCKETS_S)
