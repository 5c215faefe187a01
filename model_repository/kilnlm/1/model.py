"""Triton Python-backend model (decoupled) hosting kilnlm's in-flight-batching executor.

Triton hands each request to :meth:`TritonPythonModel.execute` as it arrives (max_batch_size 0); the
request is validated, tokenized and submitted to one :class:`kilnlm.runtime.executor.Executor`, and
``execute`` returns at once. A thread per request then streams the executor's responses back through
the request's response sender; the executor's own loop batches all live requests in flight.

Request tensors (names of TensorRT-LLM's ``inflight_batcher_llm`` ensemble; all but ``text_input``
optional, each of shape [1] except the word lists):

==========================  ==========================================================================
``text_input``              the prompt (UTF-8), tokenized as is (no chat template)
``max_tokens``              number of tokens to generate (default: the ``default_max_tokens`` parameter)
``stream``                  true: one response per new piece of text; false: one final response
``temperature``             0 = greedy (default); > 0 samples
``top_k`` / ``top_p``       0 = off / 1.0 = off
``seed``                    random seed of this request's sampler
``end_id``                  token id that ends generation (default: the engine's EOS ids)
``stop_words``              [N] strings, each one stop string (no comma splitting); generation stops at
                            the first, which is cut from the output (finish reason "stop"). Honoured.
``bad_words``               [N] strings, each tokenized without special tokens; the executor never
                            generates those token sequences. Honoured for that tokenization only (the
                            same word tokenized differently in context, e.g. after a space, is not banned).
``pad_id``                  accepted for compatibility and ignored: responses are never padded
``exclude_input_in_output`` false (default, as TensorRT-LLM): a non-streamed ``text_output`` starts with
                            the prompt; true: only the completion. Streamed responses never repeat it.
==========================  ==========================================================================

Response tensors: ``text_output`` [1] (the new text of this response), ``output_ids`` [n] int32 (the
token ids it carries), ``sequence_length`` [1] (n), ``finish_reason`` [1] ("" until the final response,
then e.g. "length", "stop", "end_id", "cancelled").

Errors: a bad request (empty text, max_tokens < 1, top_p outside (0, 1], a prompt too long for the
engine, ...) gets one final error response (INVALID_ARG; over HTTP a 400) and never affects other
requests; an executor failure gets INTERNAL. A request whose client cancels (gRPC stream
closed, HTTP connection dropped) is cancelled in the executor, which frees its KV-cache blocks.

Metrics (Triton's custom metrics, on the metrics port next to Triton's own): ``kilnlm_kv_cache_free_blocks``,
``kilnlm_kv_cache_total_blocks``, ``kilnlm_kv_cache_cached_blocks``, ``kilnlm_active_requests``, ``kilnlm_queued_requests`` (gauges), ``kilnlm_requests_finished_total``
(counter, label ``finish_reason``), ``kilnlm_generated_tokens_total`` (counter),
``kilnlm_time_to_first_token_seconds`` and ``kilnlm_inter_token_latency_seconds`` (histograms).
"""

from __future__ import annotations

import dataclasses
import json
import os
import site
import sys
import threading
import time
from pathlib import Path


def _add_launcher_python_path() -> None:
    """Make the launching interpreter's packages importable in this backend stub.

    The stubs nvidia-pytriton ships embed the system's libpython, which ignores PYTHONPATH. The
    launcher (scripts/launch_triton.py) exports its interpreter's sys.path as PYTHONPATH; its package
    folders (not another interpreter's standard library) go in front of the system's dist-packages,
    and their .pth files are processed (that is how a venv's editable/dev installs are found).
    """
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    packages = [p for p in entries if os.path.isdir(p) and not os.path.exists(os.path.join(p, "os.py"))
                and not p.rstrip("/").endswith("lib-dynload") and p not in sys.path]
    sys.path[0:0] = packages
    for p in packages:
        site.addsitedir(p)


_add_launcher_python_path()

import numpy as np  # noqa: E402  (after the path set-up above)
import triton_python_backend_utils as pb_utils

STATS_INTERVAL_S = 0.1       # how often the gauges are refreshed from executor.stats()
CANCEL_POLL_INTERVAL_S = 0.05  # how often live requests are checked for client cancellation
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
OUTPUT_NAMES = ("text_output", "output_ids", "sequence_length", "finish_reason")


class BadRequest(ValueError):
    """A request's tensors are invalid; the message says which and what is allowed."""


@dataclasses.dataclass
class ParsedRequest:
    """What one Triton request asks for, after validation."""

    text: str
    stream: bool
    exclude_input_in_output: bool
    sampling: dict  # keyword arguments for kilnlm.runtime.request.SamplingParams
    bad_words: list[str]  # tokenized by the model (the executor bans token-id sequences)


def _values(request, name: str) -> list | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1).tolist()
    return [v.decode("utf-8") if isinstance(v, bytes) else v for v in values]


def _scalar(request, name: str, default):
    values = _values(request, name)
    if not values:
        return default
    if len(values) != 1:
        raise BadRequest(f"'{name}' must hold one value, got {len(values)}")
    return values[0]


def parse_request(request, default_max_tokens: int) -> ParsedRequest:
    """Read a request's tensors (see the module docstring) into keyword arguments for SamplingParams.

    Value ranges are checked once, by ``SamplingParams.validate`` in ``Executor.submit`` (its
    RequestError becomes an INVALID_ARG response); this only checks presence and shapes.

    Raises:
        BadRequest: a missing/empty text_input, or a scalar input holding several values.
    """
    text = _scalar(request, "text_input", None)
    if not isinstance(text, str) or not text:
        raise BadRequest("'text_input' must be a non-empty UTF-8 string")
    sampling = {
        "max_tokens": int(_scalar(request, "max_tokens", default_max_tokens)),
        "temperature": float(_scalar(request, "temperature", 0.0)),
        "top_k": int(_scalar(request, "top_k", 0)),
        "top_p": float(_scalar(request, "top_p", 1.0)),
    }
    for name in ("seed", "end_id"):
        value = _scalar(request, name, None)
        if value is not None:
            sampling[name] = int(value)
    stop_words = [w for w in (_values(request, "stop_words") or []) if w]
    if stop_words:
        sampling["stop"] = stop_words
    return ParsedRequest(
        text=text,
        stream=bool(_scalar(request, "stream", False)),
        exclude_input_in_output=bool(_scalar(request, "exclude_input_in_output", False)),
        sampling=sampling,
        bad_words=[w for w in (_values(request, "bad_words") or []) if w],
    )


def _stat(stats, name: str, default=0):
    if isinstance(stats, dict):
        return stats.get(name, default)
    return getattr(stats, name, default)


def _convert(text: str, annotation: str):
    """Convert a config.pbtxt parameter string to a dataclass field's type (its annotation string,
    e.g. ``"int | None"``); "" or "none" means None."""
    value = text.strip()
    if value.lower() in ("", "none"):
        return None
    if "bool" in annotation:
        return value.lower() in ("1", "true", "yes", "on")
    if "int" in annotation:
        return int(value)
    if "float" in annotation:
        return float(value)
    return value


class Metrics:
    """The model's custom Prometheus metrics (one set per model instance)."""

    def __init__(self, model_name: str):
        labels = {"model": model_name}
        gauge, counter = pb_utils.MetricFamily.GAUGE, pb_utils.MetricFamily.COUNTER
        hist = pb_utils.MetricFamily.HISTOGRAM
        self._families = {
            "free": pb_utils.MetricFamily("kilnlm_kv_cache_free_blocks", "Free KV-cache blocks", gauge),
            "total": pb_utils.MetricFamily("kilnlm_kv_cache_total_blocks", "KV-cache blocks", gauge),
            "cached": pb_utils.MetricFamily("kilnlm_kv_cache_cached_blocks",
                                            "KV-cache blocks reusable by prefix hash", gauge),
            "active": pb_utils.MetricFamily("kilnlm_active_requests",
                                            "Requests admitted by the executor (holding KV blocks)", gauge),
            "queued": pb_utils.MetricFamily("kilnlm_queued_requests",
                                            "Requests waiting for admission", gauge),
            "finished": pb_utils.MetricFamily("kilnlm_requests_finished_total",
                                              "Finished requests by finish reason", counter),
            "tokens": pb_utils.MetricFamily("kilnlm_generated_tokens_total", "Generated tokens", counter),
            "ttft": pb_utils.MetricFamily("kilnlm_time_to_first_token_seconds",
                                          "Time from request arrival to its first token (s)", hist),
            "itl": pb_utils.MetricFamily("kilnlm_inter_token_latency_seconds",
                                         "Time between consecutive responses of a request (s)", hist),
        }
        self._labels = labels
        self.free_blocks = self._families["free"].Metric(labels=labels)
        self.total_blocks = self._families["total"].Metric(labels=labels)
        self.cached_blocks = self._families["cached"].Metric(labels=labels)
        self.active_requests = self._families["active"].Metric(labels=labels)
        self.queued_requests = self._families["queued"].Metric(labels=labels)
        self.generated_tokens = self._families["tokens"].Metric(labels=labels)
        self.ttft = self._families["ttft"].Metric(labels=labels, buckets=LATENCY_BUCKETS_S)
        self.itl = self._families["itl"].Metric(labels=labels, buckets=LATENCY_BUCKETS_S)
        self._finished: dict[str, object] = {}
        self._lock = threading.Lock()

    def count_finished(self, reason: str) -> None:
        with self._lock:
            if reason not in self._finished:
                self._finished[reason] = self._families["finished"].Metric(
                    labels={**self._labels, "finish_reason": reason})
            self._finished[reason].increment(1)

    def update_stats(self, stats) -> None:
        self.free_blocks.set(float(_stat(stats, "num_free_blocks")))
        self.total_blocks.set(float(_stat(stats, "num_total_blocks")))
        self.cached_blocks.set(float(_stat(stats, "num_cached_blocks")))
        self.active_requests.set(float(_stat(stats, "num_active_requests")))
        self.queued_requests.set(float(_stat(stats, "num_queued")))


def _response(text: str, token_ids: list[int], finish_reason: str):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.array(token_ids, dtype=np.int32)),
        pb_utils.Tensor("sequence_length", np.array([len(token_ids)], dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_)),
    ])


def _error(message: str, code):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


class TritonPythonModel:
    """One executor per model instance; requests are streamed by one thread each."""

    def initialize(self, args):
        from kilnlm.runtime.errors import RequestError
        from kilnlm.runtime.executor import Executor, ExecutorConfig
        from kilnlm.runtime.request import SamplingParams

        self._sampling_cls = SamplingParams
        self._request_error = RequestError
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        engine_dir = Path(params.get("engine_dir", "engine"))
        if not engine_dir.is_absolute():
            engine_dir = Path(args["model_repository"]) / engine_dir
        self._default_max_tokens = int(params.get("default_max_tokens", "128"))
        # Any parameter named like an ExecutorConfig field configures the executor.
        overrides = {f.name: _convert(params[f.name], str(f.type))
                     for f in dataclasses.fields(ExecutorConfig) if f.name in params}
        pb_utils.Logger.log_info(f"kilnlm: loading engine {engine_dir} with {overrides or 'defaults'}")
        self._executor = Executor.from_engine_dir(str(engine_dir), ExecutorConfig(**overrides))
        self._metrics = Metrics(args["model_name"])
        self._live: dict[object, object] = {}  # request id -> response sender, for cancellation
        self._cancelled: set = set()  # live request ids whose client cancelled
        self._live_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._monitor = threading.Thread(target=self._monitor_loop, name="kilnlm-monitor", daemon=True)
        self._monitor.start()

    # -- request path ---------------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            arrival_s = time.monotonic()
            sender = request.get_response_sender()
            try:
                parsed = parse_request(request, self._default_max_tokens)
                tokenizer = self._executor.tokenizer
                bad_words = [tokenizer.encode(w, add_special_tokens=False) for w in parsed.bad_words]
                params = self._sampling_cls(**parsed.sampling, bad_words=[w for w in bad_words if w])
                prompt_ids = tokenizer.encode(parsed.text)
                request_id = self._executor.submit(list(prompt_ids), params)
            except (BadRequest, self._request_error) as exc:  # the client's to fix: say what
                self._send_final(sender, _error(str(exc), pb_utils.TritonError.INVALID_ARG))
                continue
            except Exception as exc:  # a bug or a broken engine: report it, keep serving others
                pb_utils.Logger.log_error(f"kilnlm: submitting a request failed: {exc!r}")
                self._send_final(sender, _error(f"kilnlm could not submit the request: {exc}",
                                                pb_utils.TritonError.INTERNAL))
                continue
            with self._live_lock:
                self._live[request_id] = sender
            thread = threading.Thread(target=self._stream_request, daemon=True,
                                      args=(request_id, parsed, sender, arrival_s),
                                      name=f"kilnlm-request-{request_id}")
            self._threads.add(thread)
            thread.start()
        return None

    def _stream_request(self, request_id, parsed: ParsedRequest, sender, arrival_s: float) -> None:
        """Forward the executor's responses for ``request_id`` to ``sender`` (runs on its own thread).

        Ownership rule: a response sender must not be touched once its final response is sent (Triton
        frees it; even ``is_cancelled`` then crashes the server). The monitor thread is the only
        caller of ``is_cancelled`` and only for senders in ``self._live``; this thread removes its
        sender from there, under the lock, before it sends the final response.
        """
        text_parts = [parsed.text] if not parsed.exclude_input_in_output and not parsed.stream else []
        token_ids: list[int] = []
        last_s = None
        finish_reason = ""
        final_sent = False

        def send_final(response) -> None:
            nonlocal final_sent
            with self._live_lock:
                self._live.pop(request_id, None)
                cancelled = request_id in self._cancelled
                self._cancelled.discard(request_id)
            final_sent = True
            if cancelled:  # the client is gone: close the request without a payload
                response = _error("request cancelled by the client", pb_utils.TritonError.CANCELLED)
            self._send_final(sender, response)

        try:
            for r in self._executor.stream(request_id):
                if final_sent:  # drain the stream so the executor finishes its bookkeeping
                    continue
                now_s = time.monotonic()
                new_ids = list(r.token_ids)
                if new_ids:
                    self._metrics.generated_tokens.increment(len(new_ids))
                    if last_s is None:
                        self._metrics.ttft.observe(now_s - arrival_s)
                    else:
                        self._metrics.itl.observe(now_s - last_s)
                    last_s = now_s
                if r.finished:
                    finish_reason = str(getattr(r.finish_reason, "value", r.finish_reason) or "")
                    if finish_reason == "error":
                        send_final(_error(f"kilnlm executor error: {getattr(r, 'error', None)}",
                                          pb_utils.TritonError.INTERNAL))
                    elif parsed.stream:
                        send_final(_response(r.text, new_ids, finish_reason))
                    else:
                        text_parts.append(r.text)
                        token_ids.extend(new_ids)
                        send_final(_response("".join(text_parts), token_ids, finish_reason))
                    continue
                if not parsed.stream:
                    text_parts.append(r.text)
                    token_ids.extend(new_ids)
                elif (r.text or new_ids) and not self._is_cancelled(request_id):
                    sender.send(_response(r.text, new_ids, ""))
            if not final_sent:
                finish_reason = finish_reason or "cancelled"
                send_final(_error("the executor ended the request without a final response",
                                  pb_utils.TritonError.INTERNAL))
        except Exception as exc:  # the executor failed this request: tell the client, keep serving
            pb_utils.Logger.log_error(f"kilnlm: request {request_id} failed: {exc!r}")
            self._cancel(request_id)
            finish_reason = "error"
            if not final_sent:
                send_final(_error(f"kilnlm executor error: {exc}", pb_utils.TritonError.INTERNAL))
        finally:
            self._metrics.count_finished(finish_reason or "unknown")
            self._threads.discard(threading.current_thread())

    def _is_cancelled(self, request_id) -> bool:
        with self._live_lock:
            return request_id in self._cancelled

    def _cancel(self, request_id) -> None:
        try:
            self._executor.cancel(request_id)
        except Exception as exc:  # already finished: nothing to free
            pb_utils.Logger.log_verbose(f"kilnlm: cancel({request_id}): {exc!r}")

    @staticmethod
    def _send_final(sender, response) -> None:
        flag = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        try:
            sender.send(response, flags=flag)
        except Exception as exc:  # the client is gone (cancelled); the request is complete anyway
            pb_utils.Logger.log_warn(f"kilnlm: could not send the final response: {exc!r}")

    # -- background: cancellation and gauges ---------------------------------------------------------
    def _monitor_loop(self) -> None:
        """Every CANCEL_POLL_INTERVAL_S: cancel, in the executor, the live requests whose client
        cancelled (frees their KV blocks); every STATS_INTERVAL_S: refresh the gauges."""
        next_stats_s = 0.0
        while not self._stop.wait(CANCEL_POLL_INTERVAL_S):
            with self._live_lock:
                newly_cancelled = [rid for rid, sender in self._live.items()
                                   if rid not in self._cancelled and sender.is_cancelled()]
                self._cancelled.update(newly_cancelled)
            for request_id in newly_cancelled:
                self._cancel(request_id)
            if time.monotonic() >= next_stats_s:
                next_stats_s = time.monotonic() + STATS_INTERVAL_S
                try:
                    self._metrics.update_stats(self._executor.stats())
                except Exception as exc:
                    pb_utils.Logger.log_warn(f"kilnlm: reading executor stats failed: {exc!r}")

    def finalize(self):
        self._stop.set()
        self._monitor.join(timeout=5.0)
        self._executor.shutdown()
        for thread in list(self._threads):
            thread.join(timeout=5.0)
