"""Triton Python-backend model (decoupled) hosting kilnlm's in-flight-batching executor.

Triton hands each request to :meth:`TritonPythonModel.execute` as it arrives (max_batch_size 0); the
request is validated, tokenized and submitted to one :class:`kilnlm.runtime.executor.Executor`, and
``execute`` returns at once. The executor's own loop batches all live requests in flight; a reader
thread per request hands its responses to one dispatcher thread, which alone sends them through the
requests' response senders (see :class:`TritonPythonModel` for why).

Request tensors (names of TensorRT-LLM's ``inflight_batcher_llm`` ensemble; all but ``text_input``
optional, each of shape [1] except the word lists):

==========================  ==========================================================================
``text_input``              the prompt (UTF-8), tokenized as is unless ``apply_chat_template``
``apply_chat_template``     kilnlm extension: true wraps ``text_input`` as one user message in the
                            engine's chat template (default false, as TensorRT-LLM's ensemble)
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
import queue
import site
import sys
import threading
import time


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
import triton_python_backend_utils as pb_utils  # noqa: E402

STATS_INTERVAL_S = 0.1  # how often the gauges are refreshed from executor.stats()
CANCEL_POLL_INTERVAL_S = 0.05  # how often live requests are checked for client cancellation
LATENCY_BUCKETS_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]


class BadRequest(ValueError):
    """A request's tensors are invalid; the message says which and what is allowed."""


@dataclasses.dataclass
class ParsedRequest:
    """What one Triton request asks for, after validation."""

    text: str
    apply_chat_template: bool
    stream: bool
    exclude_input_in_output: bool
    sampling: dict  # keyword arguments for kilnlm.runtime.request.SamplingParams
    bad_words: list[str]  # tokenized by the model (the executor bans token-id sequences)


def _values(request, name: str) -> list | None:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return None
    values = tensor.as_numpy().reshape(-1).tolist()
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in values]
    except UnicodeDecodeError as exc:
        raise BadRequest(f"'{name}' is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


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
        apply_chat_template=bool(_scalar(request, "apply_chat_template", False)),
        stream=bool(_scalar(request, "stream", False)),
        exclude_input_in_output=bool(_scalar(request, "exclude_input_in_output", False)),
        sampling=sampling,
        bad_words=[w for w in (_values(request, "bad_words") or []) if w],
    )


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
    """The model's custom Prometheus metrics (one set per model instance; used by the dispatcher
    thread only)."""

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

    def count_finished(self, reason: str) -> None:
        if reason not in self._finished:
            self._finished[reason] = self._families["finished"].Metric(
                labels={**self._labels, "finish_reason": reason})
        self._finished[reason].increment(1)

    def update_stats(self, stats) -> None:
        """``stats``: the executor's IterationStats."""
        self.free_blocks.set(float(stats.num_free_blocks))
        self.total_blocks.set(float(stats.num_total_blocks))
        self.cached_blocks.set(float(stats.num_cached_blocks))
        self.active_requests.set(float(stats.num_active_requests))
        self.queued_requests.set(float(stats.num_queued))


def _response(text: str, token_ids: list[int], finish_reason: str):
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_)),
        pb_utils.Tensor("output_ids", np.array(token_ids, dtype=np.int32)),
        pb_utils.Tensor("sequence_length", np.array([len(token_ids)], dtype=np.int32)),
        pb_utils.Tensor("finish_reason", np.array([finish_reason.encode("utf-8")], dtype=np.object_)),
    ])


def _error(message: str, code):
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


@dataclasses.dataclass
class LiveRequest:
    """Dispatcher-thread state of one submitted request."""

    sender: object  # the request's response sender (touched by the dispatcher thread only)
    parsed: ParsedRequest
    arrival_s: float
    last_token_s: float | None = None
    text_parts: list[str] = dataclasses.field(default_factory=list)  # non-streamed: the whole answer
    token_ids: list[int] = dataclasses.field(default_factory=list)
    cancelled: bool = False  # the client cancelled; the request is closed, the sender unused


class TritonPythonModel:
    """One executor per model instance.

    Threads: ``execute`` (Triton's) parses and submits, then returns; one reader thread per request
    moves the executor's responses into ``self._outbox``; one dispatcher thread owns every response
    sender. Only the dispatcher talks to senders (send, is_cancelled): concurrent use of senders from
    several threads crashed tritonserver 2.51's python backend, as does touching a sender after its
    final response. When ``is_cancelled()`` turns True the request is cancelled in the executor and
    closed with one empty final flag (without it Triton never releases the request and the model
    cannot unload), and its sender is not used again.
    """

    def initialize(self, args):
        from kilnlm.runtime.distribution.engine_source import resolve_served_engine
        from kilnlm.runtime.errors import RequestError
        from kilnlm.runtime.executor import Executor, ExecutorConfig
        from kilnlm.runtime.request import SamplingParams

        self._sampling_cls = SamplingParams
        self._request_error = RequestError
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        # The engine: this version directory's engine/ or engine.json pointer (`kilnlm deploy`), else the
        # engine_ref parameter (a cache reference, fetched into a local engine cache and verified), else
        # the engine_dir parameter; see kilnlm.runtime.distribution.engine_source.
        served = resolve_served_engine(args["model_repository"], args["model_version"],
                                       {"engine_dir": "engine", **params}, log=pb_utils.Logger.log_info)
        engine_dir = served.engine_dir
        self._default_max_tokens = int(params.get("default_max_tokens", "128"))
        # Any parameter named like an ExecutorConfig field configures the executor.
        overrides = {f.name: _convert(params[f.name], str(f.type))
                     for f in dataclasses.fields(ExecutorConfig) if f.name in params}
        pb_utils.Logger.log_info(f"kilnlm: loading engine {engine_dir} ({served.source}) with "
                                 f"{overrides or 'defaults'}")
        self._executor = Executor.from_engine_dir(str(engine_dir), ExecutorConfig(**overrides))
        self._metrics = Metrics(args["model_name"])
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._readers: set[threading.Thread] = set()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name="kilnlm-dispatcher",
                                            daemon=True)
        self._dispatcher.start()

    # -- Triton's thread ------------------------------------------------------------------------------
    def execute(self, requests):
        for request in requests:
            arrival_s = time.monotonic()
            sender = request.get_response_sender()
            try:
                parsed = parse_request(request, self._default_max_tokens)
                tokenizer = self._executor.tokenizer
                bad_words = [tokenizer.encode(w, add_special_tokens=False) for w in parsed.bad_words]
                params = self._sampling_cls(**parsed.sampling, bad_words=[w for w in bad_words if w])
                if parsed.apply_chat_template:
                    chat = tokenizer.apply_chat_template([{"role": "user", "content": parsed.text}])
                    prompt_ids = tokenizer.encode(chat, add_special_tokens=False)
                else:
                    prompt_ids = tokenizer.encode(parsed.text)
                request_id = self._executor.submit(list(prompt_ids), params)
            except (BadRequest, self._request_error) as exc:  # the client's to fix: say what
                self._outbox.put(("refused", sender, _error(str(exc), pb_utils.TritonError.INVALID_ARG)))
                continue
            except Exception as exc:  # a bug or a broken engine: report it, keep serving others
                pb_utils.Logger.log_error(f"kilnlm: submitting a request failed: {exc!r}")
                self._outbox.put(("refused", sender, _error(f"kilnlm could not submit the request: {exc}",
                                                            pb_utils.TritonError.INTERNAL)))
                continue
            self._outbox.put(("submitted", request_id, LiveRequest(sender, parsed, arrival_s)))
            reader = threading.Thread(target=self._read_responses, args=(request_id,), daemon=True,
                                      name=f"kilnlm-reader-{request_id}")
            self._readers.add(reader)
            reader.start()
        return None

    # -- reader threads (one per request): executor -> outbox -----------------------------------------
    def _read_responses(self, request_id) -> None:
        try:
            for response in self._executor.stream(request_id):
                self._outbox.put(("response", request_id, response))
        except Exception as exc:  # the executor lost this request: the dispatcher tells the client
            self._outbox.put(("failed", request_id, exc))
        finally:
            self._readers.discard(threading.current_thread())

    # -- the dispatcher thread: outbox -> response senders ------------------------------------------
    def _dispatch_loop(self) -> None:
        """Send responses as they arrive; every CANCEL_POLL_INTERVAL_S check live requests for client
        cancellation (cancelling them in the executor frees their KV blocks); every
        STATS_INTERVAL_S refresh the gauges."""
        live: dict[object, LiveRequest] = {}
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
                    pb_utils.Logger.log_error(f"kilnlm: handling {kind} of request {key} failed: {exc!r}")
            now_s = time.monotonic()
            if now_s >= next_poll_s:
                next_poll_s = now_s + CANCEL_POLL_INTERVAL_S
                self._poll_cancellation(live)
            if now_s >= next_stats_s:
                next_stats_s = now_s + STATS_INTERVAL_S
                try:
                    self._metrics.update_stats(self._executor.stats())
                except Exception as exc:
                    pb_utils.Logger.log_warn(f"kilnlm: reading executor stats failed: {exc!r}")

    def _handle(self, live: dict, kind: str, key, payload) -> None:
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        if kind == "refused":
            key.send(payload, flags=final)
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
            if not state.cancelled:
                state.sender.send(_error(f"kilnlm executor error: {payload}", pb_utils.TritonError.INTERNAL),
                                  flags=final)
            return
        r = payload  # kind == "response"
        now_s = time.monotonic()
        new_ids = list(r.token_ids)
        if new_ids:
            self._metrics.generated_tokens.increment(len(new_ids))
            if state.last_token_s is None:
                self._metrics.ttft.observe(now_s - state.arrival_s)
            else:
                self._metrics.itl.observe(now_s - state.last_token_s)
            state.last_token_s = now_s
        if state.cancelled:  # closed already; wait for the executor's final ("cancelled") response
            if r.finished:
                del live[key]
                self._metrics.count_finished("cancelled")
            return
        if not r.finished:
            if state.parsed.stream:
                if r.text or new_ids:
                    state.sender.send(_response(r.text, new_ids, ""))
            else:
                state.text_parts.append(r.text)
                state.token_ids.extend(new_ids)
            return
        del live[key]
        finish_reason = str(getattr(r.finish_reason, "value", r.finish_reason) or "")
        self._metrics.count_finished(finish_reason or "unknown")
        if finish_reason == "error":
            response = _error(f"kilnlm executor error: {getattr(r, 'error', None)}",
                              pb_utils.TritonError.INTERNAL)
        elif state.parsed.stream:
            response = _response(r.text, new_ids, finish_reason)
        else:
            prefix = "" if state.parsed.exclude_input_in_output else state.parsed.text
            text = prefix + "".join(state.text_parts) + r.text
            response = _response(text, state.token_ids + new_ids, finish_reason)
        state.sender.send(response, flags=final)

    def _poll_cancellation(self, live: dict) -> None:
        for request_id, state in live.items():
            if not state.cancelled and state.sender.is_cancelled():
                state.cancelled = True
                self._executor.cancel(request_id)
                try:
                    state.sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception as exc:
                    pb_utils.Logger.log_info(f"kilnlm: closing cancelled request {request_id}: {exc!r}")

    def finalize(self):
        pb_utils.Logger.log_info("kilnlm: finalize: shutting the executor down")
        self._executor.shutdown()  # unfinished requests end as "cancelled"; the readers drain
        for reader in list(self._readers):
            reader.join(timeout=5.0)
        self._outbox.put(("stop", None, None))
        self._dispatcher.join(timeout=5.0)
        pb_utils.Logger.log_info("kilnlm: finalize: done")
