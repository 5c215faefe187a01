"""The threads between one executor and many clients.

::

    front's thread ─submit()─▶ parse, tokenize, Executor.submit ─▶ outbox ◀─ one reader thread per
                                                                     │        request (Executor.stream)
                                                                     ▼
                                    dispatcher thread: the only one that touches clients
                                    (replies, cancellation polling, metrics, stats refresh)

Only the dispatcher thread talks to clients (send, is_cancelled): concurrent use of Triton's response
senders from several threads crashed tritonserver 2.51's python backend, as does touching a sender after
its final response. When a client's ``is_cancelled()`` turns True the request is cancelled in the executor
(which frees its KV-cache blocks) and the client closed (Triton: one empty final flag, without which it
never releases the request and the model cannot unload); the client is not used again.

A front supplies a :class:`Client` per request; the Triton adapter is
:class:`kilnlm.runtime.serving.triton_backend.TritonClient`. What a request's inputs mean and what its
replies hold is the dispatcher's :class:`RequestProtocol`: text in / text out (:class:`TextProtocol`, the default)
or TensorRT-LLM's token ids (:class:`kilnlm.runtime.serving.trtllm.LLMProtocol`, the ``tensorrt_llm``
model). A request's live state ends when the executor's stream of it ends (after every one of its ``n``
sequences finished), not at the first finished response.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from typing import Protocol

from kilnlm.runtime.errors import QueueFullError, RequestError
from kilnlm.runtime.serving.metrics import Metrics, RequestTiming
from kilnlm.runtime.serving.request_parsing import InputReader, parse_request, prepare_submission
from kilnlm.runtime.serving.responses import ErrorKind, Reply, ResponseShaper, finish_reason_name

STATS_INTERVAL_S = 0.1  # how often the gauges are refreshed from executor.stats()
CANCEL_POLL_INTERVAL_S = 0.05  # how often live requests are checked for client cancellation
JOIN_TIMEOUT_S = 5.0


class Client(Protocol):
    """One request's connection to its client. Called from the dispatcher thread only."""

    def send(self, reply: Reply) -> None:
        """Send ``reply`` (the request's last when ``reply.final``; its ``error`` is None)."""

    def send_error(self, message: str, kind: ErrorKind) -> None:
        """Send a final error of ``kind`` (the client's to fix, kilnlm busy, or kilnlm's)."""

    def is_cancelled(self) -> bool:
        """Whether the client went away (stream closed, connection dropped)."""

    def close(self) -> None:
        """End a cancelled request without a reply."""


class RequestProtocol(Protocol):
    """How a front's requests become executor requests, and responses become replies."""

    def prepare(self, read: InputReader, tokenizer):
        """``(prompt_ids, SamplingParams, shaper)``: ``shaper.add(response)`` returns a reply (with
        ``final``, ``finish_reason``, ``error``) or None. Raises ``RequestError`` for a bad request."""


class TextProtocol:
    """Text in (:func:`~kilnlm.runtime.serving.request_parsing.parse_request`), text replies
    (:class:`~kilnlm.runtime.serving.responses.ResponseShaper`)."""

    def __init__(self, default_max_tokens: int) -> None:
        self._default_max_tokens = default_max_tokens

    def prepare(self, read: InputReader, tokenizer):
        request = parse_request(read, self._default_max_tokens)
        return (*prepare_submission(request, tokenizer), ResponseShaper(request))


@dataclasses.dataclass
class _LiveRequest:
    client: Client
    shaper: object  # the protocol's shaper
    timing: RequestTiming
    cancelled: bool = False  # the client cancelled; the request is closed, the client unused
    closed: bool = False  # its final reply was sent: the client is never touched again


class RequestDispatcher:
    """Serves generate requests from one executor; see the module docstring for the threads.

    Args:
        executor: a started :class:`kilnlm.runtime.executor.Executor` (``tokenizer``, ``submit``,
            ``stream``, ``cancel``, ``stats``, ``shutdown``); :meth:`shutdown` shuts it down.
        metrics: the model's :class:`~kilnlm.runtime.serving.metrics.Metrics`.
        default_max_tokens: ``max_tokens`` of a request that sends none (the default protocol's).
        log: where problems are reported (``info`` / ``warning`` / ``error``, as ``logging.Logger``).
        protocol: what requests and replies are (default: :class:`TextProtocol`).
    """

    def __init__(self, executor, metrics: Metrics, default_max_tokens: int,
                 log: logging.Logger | None = None, protocol: RequestProtocol | None = None) -> None:
        self._executor = executor
        self._metrics = metrics
        self._protocol = protocol or TextProtocol(default_max_tokens)
        self._log = log or logging.getLogger(__name__)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._readers: set[threading.Thread] = set()
        self._thread = threading.Thread(target=self._dispatch_loop, name="kilnlm-dispatcher", daemon=True)
        self._thread.start()

    # -- the front's thread -----------------------------------------------------------------------------
    def submit(self, read: InputReader, client: Client) -> None:
        """Parse a request's inputs (``read``), tokenize and submit it; returns at once. A bad request
        gets one final error reply (not internal); a failure to submit, an internal one."""
        arrival_s = time.monotonic()
        try:
            prompt_ids, params, shaper = self._protocol.prepare(read, self._executor.tokenizer)
            request_id = self._executor.submit(prompt_ids, params)
        except QueueFullError as exc:  # busy: the client may retry later
            self._outbox.put(("refused", client, (str(exc), ErrorKind.UNAVAILABLE)))
            return
        except RequestError as exc:  # the client's to fix: say what
            self._outbox.put(("refused", client, (str(exc), ErrorKind.INVALID_REQUEST)))
            return
        except Exception as exc:  # a bug or a broken engine: report it, keep serving others
            self._log.error(f"kilnlm: submitting a request failed: {exc!r}")
            self._outbox.put(("refused", client, (f"kilnlm could not submit the request: {exc}", ErrorKind.INTERNAL)))
            return
        self._outbox.put(("submitted", request_id, _LiveRequest(client, shaper, RequestTiming(arrival_s))))
        reader = threading.Thread(target=self._read_responses, args=(request_id,), daemon=True,
                                  name=f"kilnlm-reader-{request_id}")
        self._readers.add(reader)
        reader.start()

    def shutdown(self) -> None:
        """Shut the executor down (unfinished requests end as "cancelled"), let the readers drain, stop
        the dispatcher thread."""
        self._executor.shutdown()
        for reader in list(self._readers):
            reader.join(timeout=JOIN_TIMEOUT_S)
        self._outbox.put(("stop", None, None))
        self._thread.join(timeout=JOIN_TIMEOUT_S)

    # -- reader threads (one per request): executor -> outbox -----------------------------------------
    def _read_responses(self, request_id: int) -> None:
        try:
            for response in self._executor.stream(request_id):
                self._outbox.put(("response", request_id, response))
            self._outbox.put(("ended", request_id, None))
        except Exception as exc:  # the executor lost this request: the dispatcher tells the client
            self._outbox.put(("failed", request_id, exc))
        finally:
            self._readers.discard(threading.current_thread())

    # -- the dispatcher thread: outbox -> clients -------------------------------------------------------
    def _dispatch_loop(self) -> None:
        """Send replies as responses arrive; every CANCEL_POLL_INTERVAL_S check live requests for client
        cancellation; every STATS_INTERVAL_S refresh the gauges."""
        live: dict[int, _LiveRequest] = {}
        next_poll_s = next_stats_s = 0.0
        while True:
            try:
                event = self._outbox.get(timeout=CANCEL_POLL_INTERVAL_S)
            except queue.Empty:
                event = None
            if event is not None:
                kind, key, payload = event
                if kind == "stop":
                    return
                try:
                    self._handle(live, kind, key, payload)
                except Exception as exc:  # never let one request take the dispatcher down
                    self._log.error(f"kilnlm: handling {kind} of request {key} failed: {exc!r}")
            now_s = time.monotonic()
            if now_s >= next_poll_s:
                next_poll_s = now_s + CANCEL_POLL_INTERVAL_S
                self._poll_cancellation(live)
            if now_s >= next_stats_s:
                next_stats_s = now_s + STATS_INTERVAL_S
                try:
                    self._metrics.update_stats(self._executor.stats())
                except Exception as exc:
                    self._log.warning(f"kilnlm: reading executor stats failed: {exc!r}")

    def _handle(self, live: dict[int, _LiveRequest], kind: str, key, payload) -> None:
        if kind == "refused":
            message, error_kind = payload
            key.send_error(message, error_kind)
            return
        if kind == "submitted":
            live[key] = payload
            return
        state = live.get(key)
        if state is None:
            return
        if kind == "failed":
            del live[key]
            self._metrics.count_finished("error")
            if not (state.cancelled or state.closed):
                state.client.send_error(f"kilnlm executor error: {payload}", ErrorKind.INTERNAL)
            return
        if kind == "ended":  # the executor's stream of the request ended (every sequence finished)
            del live[key]
            if state.cancelled:
                self._metrics.count_finished("cancelled")
            elif not state.closed:  # the protocol expected more responses: end the client's stream anyway
                self._log.warning(f"kilnlm: request {key} ended before its final reply was sent")
                state.client.close()
            return
        response = payload  # kind == "response"
        self._metrics.observe_response(state.timing, response, time.monotonic())
        if state.cancelled or state.closed:  # wait for the end of the executor's stream
            return
        reply = state.shaper.add(response)
        if response.finished:  # one sequence's end (finished sequences are counted per sequence)
            self._metrics.count_finished(finish_reason_name(response) or "unknown")
        if reply is None:
            return
        if reply.final:
            state.closed = True
        if reply.error is not None:
            state.client.send_error(reply.error, ErrorKind.INTERNAL)
        else:
            state.client.send(reply)

    def _poll_cancellation(self, live: dict[int, _LiveRequest]) -> None:
        for request_id, state in live.items():
            if not (state.cancelled or state.closed) and state.client.is_cancelled():
                state.cancelled = True
                self._executor.cancel(request_id)
                try:
                    state.client.close()
                except Exception as exc:
                    self._log.info(f"kilnlm: closing cancelled request {request_id}: {exc!r}")
