"""``kilnlm serve``: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over one executor.

===================================  =============================================================================
``GET  /v1/models``                  the served model (one)
``POST /v1/completions``             a prompt -> completion(s); SSE chunks with ``"stream": true``
``POST /v1/chat/completions``        messages (the engine's chat template) -> assistant message(s); SSE too
``GET  /health``                     200 while the executor's loop runs, else 503
``GET  /metrics``                    Prometheus text: the ``kilnlm_*`` metrics (:mod:`.metrics`)
===================================  =============================================================================

Request fields and what each becomes: :mod:`kilnlm.runtime.serving.openai_protocol`. Errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}``: 400 a bad parameter (FastAPI's 422 included), 401 a
missing or wrong API key (``Authorization: Bearer KEY``; /health and /metrics need none), 404 an unknown
model or path, 503 when the executor's queue is full (``QueueFullError``), 500 an executor failure. Streamed
responses are ``data: {chunk}`` lines ending with ``data: [DONE]``; a failure mid-stream is one
``data: {"error": ...}`` line before it.

Threads::

    event loop (uvicorn): parse, check, tokenize + submit (asyncio.to_thread), shape replies, metrics
    one reader thread per request: Executor.stream (blocking) -> loop.call_soon_threadsafe -> asyncio.Queue

The event loop never blocks on the executor. A client that goes away -- a streamed request whose
connection closes (Starlette cancels the stream), a non-streamed one whose connection closes while it
waits (the server listens for ``http.disconnect``) -- cancels its executor request, whose KV blocks return
to the pool. Only the event loop touches :class:`~kilnlm.runtime.serving.metrics.Metrics`; the gauges are
refreshed from ``Executor.stats()`` when ``/metrics`` is read.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response as HTTPResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kilnlm.runtime.errors import QueueFullError, RequestError
from kilnlm.runtime.request import FinishReason, Response
from kilnlm.runtime.serving import openai_protocol as protocol
from kilnlm.runtime.serving.metrics import Metrics, PrometheusBackend, RequestTiming
from kilnlm.runtime.serving.parameters import DEFAULT_MAX_TOKENS

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 503: "service_unavailable_error", 500: "internal_server_error"}
QUEUE_FULL_RETRY_AFTER_S = 1  # the Retry-After header of a 503 for a full queue


@dataclasses.dataclass(frozen=True)
class ServerSettings:
    """What ``kilnlm serve`` adds to the executor.

    Attributes:
        model_name: the name clients send as ``model`` (and ``/v1/models`` lists).
        api_key: when set, every ``/v1/*`` request must send ``Authorization: Bearer <api_key>``.
        default_max_tokens: ``max_tokens`` of a request that sends none (tokens).
    """

    model_name: str
    api_key: str | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS


class APIError(Exception):
    """An error reply in OpenAI's shape: ``status`` (HTTP), ``message``, ``type``, ``param``, ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def reply(self) -> JSONResponse:
        return JSONResponse(protocol.error_body(self.message, ERROR_TYPES.get(self.status, "api_error"),
                                                self.param, self.code), self.status, headers=self.headers)


class _ResponseStream:
    """One executor request's responses, moved by a reader thread onto the event loop's queue.

    Iterate it on the event loop; :meth:`close` cancels the executor request unless its stream ended.
    """

    def __init__(self, executor, request_id: int) -> None:
        self.request_id = request_id
        self.last: Response | None = None  # the last response read
        self._executor = executor
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()
        self._ended = False
        threading.Thread(target=self._read, name=f"kilnlm-openai-{request_id}", daemon=True).start()

    def _read(self) -> None:  # reader thread
        try:
            for response in self._executor.stream(self.request_id):
                self._put(response)
            self._put(None)
        except Exception as exc:  # the executor lost the request: the event loop reports it
            self._put(exc)

    def _put(self, item) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the event loop closed (server shut down): nobody reads this request any more
            pass

    def __aiter__(self) -> AsyncIterator[Response]:
        return self._responses()

    async def _responses(self) -> AsyncIterator[Response]:
        while True:
            item = await self._queue.get()
            if item is None:
                self._ended = True
                return
            if isinstance(item, Exception):
                self._ended = True
                raise APIError(500, f"kilnlm executor error: {item}")
            self.last = item
            yield item

    def close(self) -> bool:
        """Cancel the executor request unless its stream ended; returns whether it cancelled it."""
        if self._ended:
            return False
        self._executor.cancel(self.request_id)
        self._ended = True
        return True


async def _wait_for_disconnect(http_request: Request) -> None:
    """Return when the client closes the connection (the request's body was read already)."""
    while (await http_request.receive())["type"] != "http.disconnect":
        pass


@dataclasses.dataclass
class _Sequence:
    """What one choice has accumulated (non-streamed) or counted (streamed)."""

    text_parts: list[str] = dataclasses.field(default_factory=list)
    logprobs: list | None = None
    finish_reason: str | None = None
    num_generated_tokens: int = 0


class OpenAIServer:
    """The FastAPI application (:attr:`app`) serving ``executor`` as ``settings.model_name``.

    Args:
        executor: a started :class:`kilnlm.runtime.executor.Executor`; its owner shuts it down.
        settings: the model name, API key and default max_tokens.
    """

    def __init__(self, executor, settings: ServerSettings) -> None:
        self.executor = executor
        self.settings = settings
        self.metrics_backend = PrometheusBackend()
        self.metrics = Metrics(self.metrics_backend, settings.model_name)
        self._token_text = protocol.TokenText(executor.tokenizer)
        self._created_s = protocol.now_s()
        self.app = self._make_app()

    # ------------------------------------------------------------------------------------------ routes
    def _make_app(self) -> FastAPI:
        app = FastAPI(title="kilnlm", summary="OpenAI-compatible server over a kilnlm engine")
        authorized = [Depends(self._check_api_key)]
        app.add_api_route("/v1/models", self.list_models, methods=["GET"], dependencies=authorized)
        app.add_api_route("/v1/completions", self.completions, methods=["POST"], dependencies=authorized)
        app.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], dependencies=authorized)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_text, methods=["GET"])
        app.add_exception_handler(APIError, lambda request, exc: exc.reply())
        app.add_exception_handler(RequestValidationError, _validation_error)
        app.add_exception_handler(StarletteHTTPException, _http_error)
        app.add_exception_handler(Exception, _internal_error)
        return app

    async def _check_api_key(self, http_request: Request) -> None:
        if self.settings.api_key is None:
            return
        scheme, _, key = http_request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or key.strip() != self.settings.api_key:
            raise APIError(401, "missing or incorrect API key: send the key given to `kilnlm serve --api-key` "
                                "as 'Authorization: Bearer <key>'", code="invalid_api_key")

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": self.settings.model_name, "object": "model",
                                            "created": self._created_s, "owned_by": "kilnlm"}]}

    async def health(self) -> HTTPResponse:
        return HTTPResponse(status_code=200 if self.executor.running else 503)

    async def metrics_text(self) -> HTTPResponse:
        self.metrics.update_stats(self.executor.stats())
        import prometheus_client

        body, content_type = self.metrics_backend.render(), prometheus_client.CONTENT_TYPE_LATEST
        return HTTPResponse(body, media_type=content_type)

    async def completions(self, http_request: Request, body: protocol.CompletionRequest):
        return await self._generate(http_request, body, protocol.CompletionFormat(self._token_text))

    async def chat_completions(self, http_request: Request, body: protocol.ChatCompletionRequest):
        return await self._generate(http_request, body, protocol.ChatFormat(self._token_text))

    # -------------------------------------------------------------------------------------- generation
    async def _generate(self, http_request: Request, body, fmt):
        timing = RequestTiming(time.monotonic())
        if body.model is not None and body.model != self.settings.model_name:
            raise APIError(404, f"the model '{body.model}' does not exist: this server serves "
                                f"'{self.settings.model_name}'", param="model", code="model_not_found")
        request_id = await asyncio.to_thread(self._submit, body)
        stream = _ResponseStream(self.executor, request_id)
        reply = _Reply(fmt, body, self.settings.model_name)
        if body.stream:
            return StreamingResponse(self._stream(stream, reply, timing), media_type="text/event-stream")
        work = asyncio.ensure_future(self._collect(stream, reply, timing))
        disconnect = asyncio.ensure_future(_wait_for_disconnect(http_request))
        try:
            await asyncio.wait({work, disconnect}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            disconnect.cancel()
            client_gone = not work.done()
            if client_gone:  # (or this handler was cancelled): the work's `finally` cancels the request
                work.cancel()
        if client_gone:
            return HTTPResponse(status_code=499)  # nobody reads it
        return JSONResponse(work.result())

    def _submit(self, body) -> int:
        """Tokenize ``body``'s prompt and submit it (a worker thread: tokenizing may take a while)."""
        try:
            return self.executor.submit(body.prompt_token_ids(self.executor.tokenizer),
                                        body.sampling_params(self.settings.default_max_tokens))
        except QueueFullError as exc:
            raise APIError(503, str(exc), code="queue_full",
                           headers={"Retry-After": str(QUEUE_FULL_RETRY_AFTER_S)}) from None
        except RequestError as exc:
            raise APIError(400, str(exc)) from None

    def _observe(self, timing: RequestTiming, response: Response) -> None:
        """Metrics of one response (as the Triton front's dispatcher records them: per sequence)."""
        self.metrics.observe_response(timing, response, time.monotonic())
        if response.finished:
            self.metrics.count_finished(response.finish_reason.value)
        if response.finish_reason is FinishReason.ERROR:
            raise APIError(500, f"kilnlm executor error: {response.error}")

    def _finish(self, stream: _ResponseStream) -> None:
        """End the request's stream: a client that went away before its last response cancels it."""
        if stream.close():
            self.metrics.count_finished("cancelled")

    async def _collect(self, stream: _ResponseStream, reply: "_Reply", timing: RequestTiming) -> dict[str, Any]:
        try:
            async for response in stream:
                self._observe(timing, response)
                reply.add(response)
        finally:
            self._finish(stream)
        return reply.completion()

    async def _stream(self, stream: _ResponseStream, reply: "_Reply", timing: RequestTiming) -> AsyncIterator[str]:
        try:
            for chunk in reply.first_chunks():
                yield _sse(chunk)
            async for response in stream:
                self._observe(timing, response)
                chunk = reply.chunk(response)
                if chunk is not None:
                    yield _sse(chunk)
            if reply.body.include_usage:
                yield _sse(reply.usage_chunk())
        except APIError as exc:
            yield _sse(protocol.error_body(exc.message, ERROR_TYPES.get(exc.status, "api_error")))
        finally:
            self._finish(stream)
        yield "data: [DONE]\n\n"


class _Reply:
    """The OpenAI objects one request's responses make (``fmt``: completions or chat)."""

    def __init__(self, fmt, body, model_name: str) -> None:
        self.fmt, self.body, self.model_name = fmt, body, model_name
        self.id = protocol.new_id(fmt.id_prefix)
        self.created = protocol.now_s()
        self.wants_logprobs = body.requested_logprobs() is not None
        self.sequences = [_Sequence(logprobs=[] if self.wants_logprobs else None) for _ in range(body.n)]
        self.num_prompt_tokens = 0

    def _sequence(self, response: Response) -> _Sequence:
        index = response.sequence_index
        if index >= len(self.sequences):
            raise APIError(500, f"kilnlm executor error: sequence {index} of a request for n={self.body.n}")
        self.num_prompt_tokens = response.num_prompt_tokens
        sequence = self.sequences[index]
        sequence.num_generated_tokens = response.num_generated_tokens
        sequence.finish_reason = protocol.finish_reason(response)
        return sequence

    def add(self, response: Response) -> None:
        sequence = self._sequence(response)
        sequence.text_parts.append(response.text)
        if self.wants_logprobs:
            sequence.logprobs.extend(self.fmt.logprob_entries(response))

    def completion(self) -> dict[str, Any]:
        choices = [self.fmt.choice(i, "".join(s.text_parts), s.logprobs, s.finish_reason)
                   for i, s in enumerate(self.sequences)]
        return protocol.envelope(self.fmt, self.id, self.model_name, self.created, choices, chunk=False,
                                 usage_=self._usage())

    def first_chunks(self) -> list[dict[str, Any]]:
        choices = [self.fmt.first_chunk_choice(i) for i in range(self.body.n)]
        return [self._chunk([choice]) for choice in choices if choice is not None]

    def chunk(self, response: Response) -> dict[str, Any] | None:
        """The chunk ``response`` makes, or None when it carries no text, log-probs or finish reason."""
        sequence = self._sequence(response)
        logprobs = self.fmt.logprob_entries(response) if self.wants_logprobs else None
        if not (response.text or logprobs or sequence.finish_reason):
            return None
        return self._chunk([self.fmt.chunk_choice(response.sequence_index, response.text, logprobs,
                                                  sequence.finish_reason)])

    def usage_chunk(self) -> dict[str, Any]:
        return protocol.envelope(self.fmt, self.id, self.model_name, self.created, [], chunk=True,
                                 usage_=self._usage(), include_usage=True)

    def _chunk(self, choices: list) -> dict[str, Any]:
        return protocol.envelope(self.fmt, self.id, self.model_name, self.created, choices, chunk=True,
                                 include_usage=self.body.include_usage)

    def _usage(self) -> dict[str, int]:
        return protocol.usage(self.num_prompt_tokens, sum(s.num_generated_tokens for s in self.sequences))


def _sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def _validation_error(http_request: Request, exc: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 as OpenAI's 400, naming the first offending field."""
    errors = exc.errors()
    first = errors[0] if errors else {}
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()) if p != 'body')}: {e.get('msg')}"
                        for e in errors) or "the request body is not valid"
    return APIError(400, message, param=param).reply()


def _http_error(http_request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).reply()


def _internal_error(http_request: Request, exc: Exception) -> JSONResponse:
    """A bug or a broken engine: a 500 in OpenAI's shape (uvicorn logs the traceback)."""
    return APIError(500, f"kilnlm internal error: {exc!r}").reply()


def serve(executor, settings: ServerSettings, host: str, port: int, log_level: str = "info",
          engine_poll_s: float = 0.5) -> str | None:
    """Serve ``executor`` on ``host:port`` until interrupted or until its engine breaks (uvicorn, one worker:
    the executor lives in this process). Returns why the engine broke (``executor.engine_error``: e.g. a
    tensor-parallel rank died; checked every ``engine_poll_s``), or None after an interruption."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(OpenAIServer(executor, settings).app, host=host, port=port, log_level=log_level))

    def stop_on_broken_engine() -> None:
        while not server.should_exit:
            if executor.engine_error is not None:
                server.should_exit = True
                return
            time.sleep(engine_poll_s)

    threading.Thread(target=stop_on_broken_engine, name="kilnlm-engine-watch", daemon=True).start()
    server.run()
    return executor.engine_error
