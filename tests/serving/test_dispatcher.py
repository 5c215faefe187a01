"""kilnlm.runtime.serving.dispatcher with a scripted executor and recording clients: replies in order,
errors (the client's and kilnlm's), cancellation, and the metrics it keeps. No engine, no tritonserver."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from kilnlm.runtime.errors import QueueFullError, RequestError
from kilnlm.runtime.executor import IterationStats
from kilnlm.runtime.request import FinishReason, Response
from kilnlm.runtime.serving.dispatcher import RequestDispatcher
from kilnlm.runtime.serving.metrics import InMemoryBackend, Metrics
from kilnlm.runtime.serving.request_parsing import json_reader
from kilnlm.runtime.serving.responses import ErrorKind, Reply

WAIT_S = 10.0


class Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


class ScriptedExecutor:
    """Executor stand-in: ``submit`` records the request; its responses are pushed by the test."""

    def __init__(self) -> None:
        self.tokenizer = Tokenizer()
        self.submitted: list[tuple[list[int], object]] = []
        self.cancelled: list[int] = []
        self.streams: dict[int, queue.SimpleQueue] = {}
        self.submit_error: Exception | None = None
        self.is_shut_down = False

    def submit(self, prompt_ids, params) -> int:
        if self.submit_error is not None:
            raise self.submit_error
        params.validate(vocab_size=1000)
        request_id = len(self.submitted)
        self.submitted.append((prompt_ids, params))
        self.streams[request_id] = queue.SimpleQueue()
        return request_id

    def push(self, request_id: int, text: str, token_ids: list[int], finish_reason=None, error=None) -> None:
        self.streams[request_id].put(Response(request_id, token_ids, text, finish_reason is not None,
                                              finish_reason, 1, len(token_ids), error))

    def fail(self, request_id: int, exc: Exception) -> None:
        self.streams[request_id].put(exc)

    def stream(self, request_id: int):
        while True:
            item = self.streams[request_id].get(timeout=WAIT_S)
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finished:
                return

    def cancel(self, request_id: int) -> None:
        self.cancelled.append(request_id)
        self.push(request_id, "", [], FinishReason.CANCELLED)

    def stats(self) -> IterationStats:
        return IterationStats(num_free_blocks=5, num_total_blocks=8)

    def shutdown(self) -> None:
        self.is_shut_down = True


class RecordingClient:
    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.cancel_requested = False
        self.done = threading.Event()
        self.threads: set[str] = set()

    def send(self, reply: Reply) -> None:
        self.threads.add(threading.current_thread().name)
        self.events.append(("reply", reply))
        if reply.final:
            self.done.set()

    def send_error(self, message: str, kind: ErrorKind) -> None:
        self.threads.add(threading.current_thread().name)
        self.events.append(("error", message, kind))
        self.done.set()

    def is_cancelled(self) -> bool:
        self.threads.add(threading.current_thread().name)
        return self.cancel_requested

    def close(self) -> None:
        self.events.append(("close",))
        self.done.set()


@pytest.fixture
def served():
    executor = ScriptedExecutor()
    backend = InMemoryBackend()
    dispatcher = RequestDispatcher(executor, Metrics(backend, "kilnlm"), default_max_tokens=16)
    yield executor, dispatcher, backend
    dispatcher.shutdown()
    assert executor.is_shut_down


def wait_until(condition) -> None:
    deadline_s = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline_s, "timed out"
        time.sleep(0.01)


def test_streamed_replies_arrive_in_order_from_the_dispatcher_thread(served):
    executor, dispatcher, backend = served
    client = RecordingClient()
    dispatcher.submit(json_reader({"text_input": "ab", "stream": True, "max_tokens": 3}), client)
    prompt_ids, params = executor.submitted[0]
    assert prompt_ids == [97, 98] and params.max_tokens == 3
    executor.push(0, "x", [120])
    executor.push(0, "y", [121], FinishReason.LENGTH)
    assert client.done.wait(WAIT_S)
    assert client.events == [("reply", Reply("x", (120,))), ("reply", Reply("y", (121,), "length", final=True))]
    assert client.threads == {"kilnlm-dispatcher"}
    wait_until(lambda: backend.value("kilnlm_requests_finished_total", finish_reason="length") == 1.0)
    assert backend.value("kilnlm_generated_tokens_total") == 2.0
    wait_until(lambda: backend.value("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max") == 8.0)  # stats


def test_non_streamed_request_gets_one_final_reply(served):
    executor, dispatcher, _ = served
    client = RecordingClient()
    dispatcher.submit(json_reader({"text_input": "Q"}), client)
    assert executor.submitted[0][1].max_tokens == 16  # the model's default
    executor.push(0, " A", [1])
    executor.push(0, "!", [2], FinishReason.END_ID)
    assert client.done.wait(WAIT_S)
    assert client.events == [("reply", Reply("Q A!", (1, 2), "end_id", final=True))]


@pytest.mark.parametrize("body, message", [
    ({"text_input": ""}, "'text_input' must be a non-empty UTF-8 string"),
    ({"text_input": "Hi", "top_p": 1.5}, "top_p is 1.5: it must be in (0, 1] (1 disables top-p)"),
])
def test_bad_requests_get_the_clients_error(served, body, message):
    executor, dispatcher, _ = served
    client = RecordingClient()
    dispatcher.submit(json_reader(body), client)
    assert client.done.wait(WAIT_S)
    assert client.events == [("error", message, ErrorKind.INVALID_REQUEST)]
    assert executor.submitted == []


def test_submit_and_executor_failures_are_internal_errors(served):
    executor, dispatcher, backend = served
    executor.submit_error = RequestError("prompt has 9000 tokens: lower it")
    refused = RecordingClient()
    dispatcher.submit(json_reader({"text_input": "Hi"}), refused)
    executor.submit_error = QueueFullError("the executor's queue is full")
    busy = RecordingClient()
    dispatcher.submit(json_reader({"text_input": "Hi"}), busy)
    executor.submit_error = RuntimeError("engine gone")
    broken = RecordingClient()
    dispatcher.submit(json_reader({"text_input": "Hi"}), broken)
    executor.submit_error = None
    lost, failed = RecordingClient(), RecordingClient()
    dispatcher.submit(json_reader({"text_input": "Hi"}), lost)
    dispatcher.submit(json_reader({"text_input": "Hi", "stream": True}), failed)
    executor.fail(0, RuntimeError("stream broke"))
    executor.push(1, "", [], FinishReason.ERROR, error="forward failed")
    for client in (refused, busy, broken, lost, failed):
        assert client.done.wait(WAIT_S)
    assert busy.events == [("error", "the executor's queue is full", ErrorKind.UNAVAILABLE)]
    assert refused.events == [("error", "prompt has 9000 tokens: lower it", ErrorKind.INVALID_REQUEST)]
    assert broken.events == [("error", "kilnlm could not submit the request: engine gone", ErrorKind.INTERNAL)]
    assert lost.events == [("error", "kilnlm executor error: stream broke", ErrorKind.INTERNAL)]
    assert failed.events == [("error", "kilnlm executor error: forward failed", ErrorKind.INTERNAL)]
    wait_until(lambda: backend.value("kilnlm_requests_finished_total", finish_reason="error") == 2.0)


def test_a_cancelled_client_is_closed_once_and_its_request_cancelled(served):
    executor, dispatcher, backend = served
    client = RecordingClient()
    dispatcher.submit(json_reader({"text_input": "Hi", "stream": True}), client)
    executor.push(0, "x", [120])
    wait_until(lambda: len(client.events) == 1)
    client.cancel_requested = True
    assert client.done.wait(WAIT_S)
    wait_until(lambda: backend.value("kilnlm_requests_finished_total", finish_reason="cancelled") == 1.0)
    assert executor.cancelled == [0]
    assert client.events == [("reply", Reply("x", (120,))), ("close",)]  # nothing after the close


def test_tensorrt_llm_protocol_ends_a_request_after_every_sequence_and_never_polls_it_again():
    """num_return_sequences 2: the final flag comes with the second sequence's last reply, and the client
    is not touched once it is sent (tritonserver crashes on a sender used after its final response)."""
    import numpy as np

    from kilnlm.runtime.serving.trtllm import LLMProtocol

    class TwoSequences(ScriptedExecutor):
        def stream(self, request_id):
            for _ in range(2):  # the scripted stream ends at each finished response
                yield from super().stream(request_id)

    class WatchedClient(RecordingClient):
        polled_after_final = False

        def is_cancelled(self) -> bool:
            self.polled_after_final |= self.done.is_set()
            return super().is_cancelled()

    executor = TwoSequences()
    dispatcher = RequestDispatcher(executor, Metrics(InMemoryBackend(), "tensorrt_llm"), default_max_tokens=16,
                                   protocol=LLMProtocol())
    client = WatchedClient()
    tensors = {"input_ids": np.array([[5, 6]], dtype=np.int32), "request_output_len": np.array([[2]]),
               "streaming": np.array([[True]]), "num_return_sequences": np.array([[2]])}
    dispatcher.submit(tensors.get, client)
    executor.streams[0].put(Response(0, [7], "a", True, FinishReason.LENGTH, 2, 1, sequence_index=0))
    executor.streams[0].put(Response(0, [8], "b", True, FinishReason.LENGTH, 2, 1, sequence_index=1))
    assert client.done.wait(WAIT_S)
    time.sleep(0.2)  # a few cancellation polls
    finals = [event[1].final for event in client.events]
    assert finals == [False, True]
    assert [event[1].outputs["sequence_index"].tolist() for event in client.events] == [[[0]], [[1]]]
    assert not client.polled_after_final, "is_cancelled() called after the final reply"
    dispatcher.shutdown()
