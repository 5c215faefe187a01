"""kilnlm.runtime.serving.metrics: TensorRT-LLM's families, labels and values, the stats update, per-reply
observations, the in-memory and prometheus-client backends; then the values against known activity through
the real dispatcher and executor on the tiny eager engine. No tritonserver needed."""

from __future__ import annotations

import threading
import time

import pytest

from kilnlm.runtime.executor import Executor, ExecutorConfig, IterationStats
from kilnlm.runtime.request import FinishReason, Response
from kilnlm.runtime.serving.dispatcher import RequestDispatcher
from kilnlm.runtime.serving.metrics import (ALL_METRICS, LATENCY_BUCKETS_S, TOKEN_COUNT_BUCKETS, InMemoryBackend,
                                            MetricKind, Metrics, PrometheusBackend, RequestTiming)
from kilnlm.runtime.serving.request_parsing import json_reader
from kilnlm.runtime.tokenizer import Tokenizer

MODEL = {"model": "m", "version": "1"}
WAIT_S = 60.0


def test_families_carry_tensorrt_llms_names_and_labels():
    assert {spec.name: (spec.kind, spec.label_names) for spec in ALL_METRICS} == {
        "nv_trt_llm_request_metrics": (MetricKind.GAUGE, ("model", "version", "request_type")),
        "nv_trt_llm_kv_cache_block_metrics": (MetricKind.GAUGE, ("model", "version", "kv_cache_block_type")),
        "nv_trt_llm_inflight_batcher_metrics": (MetricKind.GAUGE,
                                                ("model", "version", "inflight_batcher_specific_metric")),
        "nv_trt_llm_general_metrics": (MetricKind.GAUGE, ("model", "version", "general_type")),
        "nv_llm_input_token_len": (MetricKind.HISTOGRAM, ("model", "version", "response_metric_type")),
        "nv_llm_output_token_len": (MetricKind.HISTOGRAM, ("model", "version", "response_metric_type")),
        "kilnlm_time_to_first_token_seconds": (MetricKind.HISTOGRAM, ("model", "version")),
        "kilnlm_inter_token_latency_seconds": (MetricKind.HISTOGRAM, ("model", "version")),
        "kilnlm_queue_time_seconds": (MetricKind.HISTOGRAM, ("model", "version")),
        "kilnlm_e2e_request_latency_seconds": (MetricKind.HISTOGRAM, ("model", "version")),
        "kilnlm_requests_finished_total": (MetricKind.COUNTER, ("model", "version", "finish_reason")),
        "kilnlm_generated_tokens_total": (MetricKind.COUNTER, ("model", "version")),
        "kilnlm_kv_cache_cached_blocks": (MetricKind.GAUGE, ("model", "version")),
        "kilnlm_speculative_decoding_metrics": (MetricKind.GAUGE, ("model", "version", "spec_decoding_metric")),
    }


STATS = IterationStats(num_active_requests=3, max_num_active_requests=8, num_queued=2, num_free_blocks=12,
                       num_total_blocks=16, num_cached_blocks=5, tokens_per_block=4, num_iterations=41,
                       last_num_tokens=20, last_num_seqs=4, last_num_context_requests=1, last_num_context_tokens=17,
                       last_num_generation_requests=3, last_num_paused_requests=1, num_reused_blocks=6,
                       num_needed_blocks=10, total_draft_tokens=8, total_accepted_draft_tokens=6,
                       timestamp_s=1_700_000_000.25)
EXPECTED_GAUGES = {
    ("nv_trt_llm_request_metrics", "request_type"): {"active": 3, "max": 8, "scheduled": 4, "context": 1, "waiting": 2},
    ("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type"): {
        "max": 16, "free": 12, "used": 4, "tokens_per": 4, "fraction": 0.25, "reused": 6, "alloc_total": 10,
        "alloc_new": 4},
    ("nv_trt_llm_inflight_batcher_metrics", "inflight_batcher_specific_metric"): {
        "total_context_tokens": 17, "generation_requests": 3, "micro_batch_id": 0, "paused_requests": 1},
    ("nv_trt_llm_general_metrics", "general_type"): {"iteration_counter": 41, "timestamp": 1_700_000_000_250_000},
    ("kilnlm_speculative_decoding_metrics", "spec_decoding_metric"): {
        "total_draft_tokens": 8, "total_accepted_draft_tokens": 6, "acceptance_rate": 0.75},
}


def test_update_stats_sets_every_gauge():
    backend = InMemoryBackend()
    Metrics(backend, "m").update_stats(STATS)
    for (name, label), values in EXPECTED_GAUGES.items():
        for value, expected in values.items():
            assert backend.value(name, **MODEL, **{label: value}) == expected, (name, value)
    assert backend.value("kilnlm_kv_cache_cached_blocks", **MODEL) == 5


def test_finished_requests_are_counted_per_finish_reason():
    backend = InMemoryBackend()
    metrics = Metrics(backend, "m")
    for reason in ("length", "stop", "length", "cancelled"):
        metrics.count_finished(reason)
    assert backend.value("kilnlm_requests_finished_total", **MODEL, finish_reason="length") == 2.0
    assert backend.value("kilnlm_requests_finished_total", **MODEL, finish_reason="stop") == 1.0
    assert backend.value("kilnlm_requests_finished_total", **MODEL, finish_reason="cancelled") == 1.0
    assert backend.value("kilnlm_requests_finished_total", **MODEL, finish_reason="end_id") == 0.0


def response(token_ids: list[int], finished: bool = False, queue_time_s: float | None = 0.125,
             num_generated_tokens: int = 0) -> Response:
    return Response(7, token_ids, "", finished, FinishReason.LENGTH if finished else None, 9, num_generated_tokens,
                    queue_time_s=queue_time_s)


def test_replies_observe_ttft_itl_queue_time_latency_and_token_lengths():
    backend = InMemoryBackend()
    metrics = Metrics(backend, "m")
    timing = RequestTiming(arrival_s=100.0)
    metrics.observe_response(timing, response([], queue_time_s=None), now_s=100.1)  # nothing yet
    metrics.observe_response(timing, response([1, 2]), now_s=100.5)
    metrics.observe_response(timing, response([3]), now_s=100.75)
    metrics.observe_response(timing, response([4], finished=True, num_generated_tokens=4), now_s=101.0)
    assert timing.last_token_s == 101.0
    assert backend.value("kilnlm_generated_tokens_total", **MODEL) == 4.0
    observations = {name: backend.find(name, **MODEL).observations for name in (
        "kilnlm_time_to_first_token_seconds", "kilnlm_inter_token_latency_seconds", "kilnlm_queue_time_seconds",
        "kilnlm_e2e_request_latency_seconds", "nv_llm_input_token_len", "nv_llm_output_token_len")}
    expected = {"kilnlm_time_to_first_token_seconds": [0.5], "kilnlm_inter_token_latency_seconds": [0.25, 0.25],
                "kilnlm_queue_time_seconds": [0.125], "kilnlm_e2e_request_latency_seconds": [1.0],
                "nv_llm_input_token_len": [9.0], "nv_llm_output_token_len": [4.0]}
    assert observations.keys() == expected.keys()
    for name, values in expected.items():
        assert observations[name] == pytest.approx(values), name
    assert backend.find("nv_llm_input_token_len", response_metric_type="total_input_tokens").buckets == \
        list(TOKEN_COUNT_BUCKETS)
    assert backend.find("nv_llm_output_token_len", response_metric_type="total_output_tokens") is not None
    assert backend.find("kilnlm_time_to_first_token_seconds").buckets == list(LATENCY_BUCKETS_S)


def test_prometheus_backend_exposes_the_same_values():
    backend = PrometheusBackend()
    metrics = Metrics(backend, "m")
    Metrics(backend, "other")  # a second model shares the registry's families
    metrics.update_stats(STATS)
    metrics.observe_response(RequestTiming(arrival_s=0.0), response([1], finished=True, num_generated_tokens=1), 0.02)
    metrics.count_finished("length")
    sample = backend.registry.get_sample_value
    for (name, label), values in EXPECTED_GAUGES.items():
        for value, expected in values.items():
            assert sample(name, {**MODEL, label: value}) == expected, (name, value)
    assert sample("kilnlm_time_to_first_token_seconds_count", MODEL) == 1
    assert sample("kilnlm_time_to_first_token_seconds_bucket", {**MODEL, "le": "0.025"}) == 1
    assert sample("kilnlm_time_to_first_token_seconds_bucket", {**MODEL, "le": "0.01"}) == 0
    assert sample("nv_llm_output_token_len_bucket", {**MODEL, "response_metric_type": "total_output_tokens",
                                                     "le": "10.0"}) == 1
    assert sample("kilnlm_requests_finished_total", {**MODEL, "finish_reason": "length"}) == 1
    text = backend.render().decode()
    assert 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="fraction",model="m",version="1"} 0.25' in text
    assert "# TYPE kilnlm_queue_time_seconds histogram" in text


# --------------------------------------------------------------- through the dispatcher and the executor
class Client:
    """A dispatcher client that records its final reply."""

    def __init__(self) -> None:
        self.final = None
        self.done = threading.Event()

    def send(self, reply) -> None:
        if reply.final:
            self.final = reply
            self.done.set()

    def send_error(self, message: str, kind) -> None:
        self.final = message
        self.done.set()

    def is_cancelled(self) -> bool:
        return False

    def close(self) -> None:
        self.done.set()


class MemoryReader:
    def __init__(self) -> None:
        self.backend = InMemoryBackend()

    def value(self, name: str, **labels) -> float:
        return self.backend.value(name, model="tiny", version="1", **labels)

    def count(self, name: str, **labels) -> int:
        series = self.backend.find(name, model="tiny", version="1", **labels)
        return len(series.observations) if series is not None else 0


class PrometheusReader:
    def __init__(self) -> None:
        self.backend = PrometheusBackend()

    def value(self, name: str, **labels) -> float:
        return self.backend.registry.get_sample_value(name, {"model": "tiny", "version": "1", **labels}) or 0.0

    def count(self, name: str, **labels) -> int:
        return int(self.value(name + "_count", **labels))


def wait_until(condition) -> None:
    deadline_s = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline_s, "timed out"
        time.sleep(0.02)


@pytest.fixture
def serve(make_eager_engine, rt_tokenizer_dir):
    """``serve(reader) -> (dispatcher, executor)`` on the tiny eager engine (blocks of 4 tokens)."""
    dispatchers = []

    def make(reader):
        executor = Executor(make_eager_engine(tokens_per_block=4), Tokenizer.from_dir(rt_tokenizer_dir), ExecutorConfig())
        dispatcher = RequestDispatcher(executor, Metrics(reader.backend, "tiny"), default_max_tokens=4)
        dispatchers.append(dispatcher)
        return dispatcher, executor

    yield make
    for dispatcher in dispatchers:
        dispatcher.shutdown()


def run(dispatcher, texts: list[str], max_tokens: int) -> list:
    clients = [Client() for _ in texts]
    for text, client in zip(texts, clients):
        dispatcher.submit(json_reader({"text_input": text, "max_tokens": max_tokens}), client)
    for client in clients:
        assert client.done.wait(WAIT_S)
    return [client.final for client in clients]


def num_shared_full_blocks(a: list[int], b: list[int], tokens_per_block: int = 4) -> int:
    """Full blocks of ``b``'s prompt (all but its last token) that equal ``a``'s."""
    num_common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return min(num_common, len(b) - 1) // tokens_per_block


@pytest.mark.parametrize("reader_type", [MemoryReader, PrometheusReader])
def test_metrics_follow_known_activity(serve, reader_type):
    reader = reader_type()
    dispatcher, executor = serve(reader)
    prefix = "The quick brown fox jumps over the lazy dog while the cat watches from the old wooden fence. "
    first, *others = [prefix + s for s in ("Alpha", "Bravo", "Charlie", "Delta", "Echo")]
    replies = run(dispatcher, [first], max_tokens=3)  # its full prompt blocks are cached once it finished
    replies += run(dispatcher, others, max_tokens=3)
    n = 1 + len(others)
    assert all(not isinstance(r, str) for r in replies), replies

    # One TTFT, queue time, end-to-end latency and prompt length per request; the finish reasons counted.
    wait_until(lambda: reader.count("kilnlm_e2e_request_latency_seconds") == n)
    for name in ("kilnlm_time_to_first_token_seconds", "kilnlm_queue_time_seconds"):
        assert reader.count(name) == n, name
    assert reader.count("nv_llm_input_token_len", response_metric_type="total_input_tokens") == n
    prompts = [executor.tokenizer.encode(t) for t in [first, *others]]
    assert reader.value("nv_llm_input_token_len_sum" if reader_type is PrometheusReader else "nv_llm_input_token_len",
                        response_metric_type="total_input_tokens") == sum(map(len, prompts))
    num_generated = sum(len(r.token_ids) for r in replies)
    assert reader.value("kilnlm_generated_tokens_total") == num_generated
    assert sum(reader.value("kilnlm_requests_finished_total", finish_reason=r) for r in ("length", "end_id")) == n

    # The prefix reuse the KV-cache manager counted: each later prompt reused the first's full blocks.
    expected_reused = sum(num_shared_full_blocks(prompts[0], p) for p in prompts[1:])
    expected_needed = sum(-(-len(p) // 4) for p in prompts)
    assert expected_reused >= 4 * len(others)
    assert (executor.kv_manager.num_reused_blocks, executor.kv_manager.num_needed_blocks) == (expected_reused,
                                                                                              expected_needed)
    block_value = lambda kind: reader.value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type=kind)  # noqa: E731
    wait_until(lambda: block_value("alloc_total") == expected_needed)
    assert block_value("reused") == expected_reused
    assert block_value("alloc_new") == expected_needed - expected_reused
    stats = executor.stats()
    assert block_value("max") == stats.num_total_blocks and block_value("tokens_per") == 4
    assert reader.value("nv_trt_llm_request_metrics", request_type="max") == 4
    wait_until(lambda: reader.value("nv_trt_llm_general_metrics", general_type="iteration_counter")
               == executor.stats().num_iterations)
