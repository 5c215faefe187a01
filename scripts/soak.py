#!/usr/bin/env python3
"""Soak: drive running kilnlm servers with a seeded mix of requests and account for every one of them.

    python scripts/soak.py --engine ENGINE_DIR [--requests 1000] [--concurrency 8] [--duration-s 900]
        [--fronts triton,openai] [--max-tokens 64] [--max-prompt-words 400] [--cancel-fraction 0.15]
        [--bad-fraction 0.02] [--seed 0] [--json REPORT.json]
    python scripts/soak.py --triton-url http://127.0.0.1:8000 --triton-grpc 127.0.0.1:8001
        --triton-metrics http://127.0.0.1:8002/metrics --openai-url http://127.0.0.1:8080
        --tokenizer ENGINE_DIR/tokenizer [--triton-pid PID] [--openai-pid PID] ...

With ``--engine`` the script starts, on loopback, a tritonserver serving the engine (as
``scripts/launch_triton.py`` does) and ``kilnlm serve`` on it, soaks both and stops them; otherwise it drives
the servers at the given addresses (loopback or not: it only ever sends what a client would).

Each front gets ``--requests`` requests from ``--concurrency`` client threads, until they are all sent or
``--duration-s`` has passed. The mix, drawn from ``--seed``:

- Triton: ``ensemble`` text over a gRPC stream (tritonclient.grpc, ``stream=True``) and over HTTP
  ``/generate``; ``tensorrt_llm`` token ids over a gRPC stream and over HTTP ``/generate_stream``
  (server-sent events);
- OpenAI (``kilnlm serve``): ``/v1/chat/completions`` streamed and not, ``/v1/completions`` (the ``openai``
  client);
- prompts cut from real English text (the standard library's ``pydoc_data.topics``) of 4 to
  ``--max-prompt-words`` words, a third of them behind one of two shared ~150-word prefixes; greedy or
  sampled (temperature, top-p, top-k, seed), some with stop words, 1 to ``--max-tokens`` tokens;
- ``--cancel-fraction`` of the streamed requests is abandoned after 1-4 token-bearing responses: a gRPC stream
  closed with ``cancel_requests=True``, an HTTP or OpenAI stream's connection dropped;
- ``--bad-fraction`` asks for ``top_p = 1.5``, which every front must refuse with an error reply.

Every request ends as exactly one of: completed (its final response arrived), cancelled (the client
abandoned it), refused (a bad request answered with an error, as it must be), failed (an error or a wrong
reply; the reason is kept) or lost (neither a final response nor an error within ``--request-timeout-s``).
After the last request the script waits for each server to drain (``nv_trt_llm_request_metrics`` active and
waiting 0) and reports the KV blocks still held (``nv_trt_llm_kv_cache_block_metrics`` max - free), the
resident memory of each server's process tree (itself and its children: Triton's Python backend stubs) at
start, end and peak (sampled every 0.5 s), and p50 / p99 time to first token and inter-token latency of
the streamed requests, measured at the client. Exit status 1 when anything was lost, failed unexpectedly
or left KV blocks held; 0 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import http.client
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

STOP_WORD_CHOICES = (".", "\n", " the", " and", "!", ",")
STREAM_KINDS = ("ensemble_grpc_stream", "tensorrt_llm_grpc_stream", "tensorrt_llm_http_stream", "chat_stream")
FRONT_KINDS = {
    "triton": ("ensemble_grpc_stream", "ensemble_http", "tensorrt_llm_grpc_stream", "tensorrt_llm_http_stream"),
    "openai": ("chat_stream", "chat", "completion"),
}
OUTCOMES = ("completed", "cancelled", "refused", "failed", "lost")
BAD_TOP_P = 1.5  # outside (0, 1]: every front must refuse it


# ------------------------------------------------------------------------------------------ the plan
@dataclasses.dataclass
class RequestSpec:
    """One request of the soak, drawn before anything is sent."""

    index: int
    kind: str  # one of FRONT_KINDS' values
    prompt: str
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    cancel_after: int | None = None  # abandon the stream after this many token-bearing responses
    bad: bool = False  # carries BAD_TOP_P: must be refused


def english_words() -> list[str]:
    """Real English prose: the words of the standard library's ``pydoc_data.topics``, in order."""
    from pydoc_data.topics import topics

    return " ".join(topics[key] for key in sorted(topics)).split()


def make_plan(front: str, num_requests: int, rng: random.Random, words: list[str], max_tokens: int,
              max_prompt_words: int, cancel_fraction: float, bad_fraction: float) -> list[RequestSpec]:
    """``num_requests`` request specs for ``front`` ("triton" or "openai"), drawn from ``rng``."""
    prefixes = [" ".join(words[start:start + 150]) for start in (1000, 5000)]
    plan = []
    for index in range(num_requests):
        kind = rng.choice(FRONT_KINDS[front])
        length = min(max_prompt_words, int(rng.choice([rng.uniform(4, 48), rng.uniform(48, max_prompt_words)])))
        start = rng.randrange(0, len(words) - length)
        prompt = " ".join(words[start:start + max(4, length)])
        if rng.random() < 1 / 3:
            prompt = f"{rng.choice(prefixes)} {prompt}"
        spec = RequestSpec(index, kind, prompt, rng.randint(1, max_tokens))
        if rng.random() < 0.5:
            spec.temperature = round(rng.uniform(0.5, 1.2), 3)
            spec.top_p = round(rng.uniform(0.8, 1.0), 3)
            spec.top_k = rng.choice([0, 20, 50])
            spec.seed = rng.randrange(2**31)
        if rng.random() < 0.25:
            spec.stop = rng.sample(STOP_WORD_CHOICES, rng.randint(1, 3))
        if kind in STREAM_KINDS and rng.random() < cancel_fraction:
            spec.cancel_after = rng.randint(1, 4)
            spec.max_tokens = max(spec.max_tokens, spec.cancel_after + 8)
        if rng.random() < bad_fraction:
            spec.bad, spec.top_p, spec.cancel_after = True, BAD_TOP_P, None
        plan.append(spec)
    return plan


# ------------------------------------------------------------------------------------------ outcomes
@dataclasses.dataclass
class Outcome:
    """What became of one request. ``token_times``: client clock (s since it was sent) of each token-bearing
    response of a stream."""

    spec: RequestSpec
    result: str  # one of OUTCOMES
    reason: str = ""
    token_times: list[float] = dataclasses.field(default_factory=list)


class Abandon(Exception):
    """Raised inside a request to abandon it (the spec's cancel_after was reached)."""


class Stream:
    """Counts a streamed request's token-bearing responses and says when to abandon it."""

    def __init__(self, spec: RequestSpec) -> None:
        self.spec, self.start_s, self.token_times = spec, time.monotonic(), []

    def token(self) -> None:
        self.token_times.append(time.monotonic() - self.start_s)
        if self.spec.cancel_after is not None and len(self.token_times) >= self.spec.cancel_after:
            raise Abandon


def run_request(spec: RequestSpec, send: Callable[[RequestSpec, Stream], None], is_refusal: Callable[[Exception], bool],
                timeout_s: float) -> Outcome:
    """Send ``spec`` with ``send`` (which returns after the final response, or raises) and classify it."""
    stream = Stream(spec)
    try:
        send(spec, stream)
    except Abandon:
        return Outcome(spec, "cancelled", token_times=stream.token_times)
    except TimeoutError as exc:
        return Outcome(spec, "lost", f"no final response within {timeout_s:.0f} s ({exc})", stream.token_times)
    except Exception as exc:  # noqa: BLE001 -- every error is an outcome to report, never the soak's end
        if spec.bad and is_refusal(exc):
            return Outcome(spec, "refused", token_times=stream.token_times)
        return Outcome(spec, "failed", f"{type(exc).__name__}: {str(exc)[:300]}", stream.token_times)
    if spec.bad:
        return Outcome(spec, "failed", f"top_p={BAD_TOP_P} was accepted", stream.token_times)
    return Outcome(spec, "completed", token_times=stream.token_times)


# ------------------------------------------------------------------------------------------ Triton
class TritonFront:
    """Sends specs to a tritonserver serving kilnlm's model repository."""

    name = "triton"

    def __init__(self, http_url: str, grpc_address: str, metrics_url: str, tokenizer, timeout_s: float) -> None:
        self.http_url, self.grpc_address, self.metrics_url = http_url.rstrip("/"), grpc_address, metrics_url
        self.tokenizer, self.timeout_s = tokenizer, timeout_s

    def send(self, spec: RequestSpec, stream: Stream) -> None:
        getattr(self, spec.kind)(spec, stream)

    @staticmethod
    def is_refusal(exc: Exception) -> bool:
        from tritonclient.utils import InferenceServerException

        return isinstance(exc, (InferenceServerException, urllib.error.HTTPError)) or \
            (isinstance(exc, ServerError) and 400 <= exc.status < 500)

    # ----------------------------------------------------------------------------- request bodies
    def _ensemble_values(self, spec: RequestSpec, streaming: bool) -> dict:
        values = {"text_input": spec.prompt, "max_tokens": spec.max_tokens, "stream": streaming}
        if spec.temperature > 0 or spec.bad:
            values.update(temperature=spec.temperature or 1.0, top_p=spec.top_p, top_k=spec.top_k,
                          seed=spec.seed or 0)
        if spec.stop:
            values["stop_words"] = spec.stop
        return values

    def _token_values(self, spec: RequestSpec, streaming: bool) -> dict:
        ids = self.tokenizer.encode(spec.prompt).ids
        values = {"input_ids": ids, "input_lengths": len(ids), "request_output_len": spec.max_tokens,
                  "streaming": streaming}
        if spec.temperature > 0 or spec.bad:
            values.update(temperature=spec.temperature or 1.0, runtime_top_p=spec.top_p,
                          runtime_top_k=spec.top_k, seed=spec.seed or 0)
        return values

    # ----------------------------------------------------------------------------- the four kinds
    def ensemble_grpc_stream(self, spec: RequestSpec, stream: Stream) -> None:
        self._grpc_stream("ensemble", self._ensemble_values(spec, True), "text_output", stream)

    def tensorrt_llm_grpc_stream(self, spec: RequestSpec, stream: Stream) -> None:
        self._grpc_stream("tensorrt_llm", self._token_values(spec, True), "output_ids", stream)

    def ensemble_http(self, spec: RequestSpec, stream: Stream) -> None:
        request = urllib.request.Request(f"{self.http_url}/v2/models/ensemble/generate", method="POST",
                                         data=json.dumps(self._ensemble_values(spec, False)).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            body = json.loads(reply.read())
        if "text_output" not in body:
            raise ServerError(reply.status, f"no text_output in {str(body)[:200]}")

    def tensorrt_llm_http_stream(self, spec: RequestSpec, stream: Stream) -> None:
        url = urllib.parse.urlsplit(self.http_url)
        connection = http.client.HTTPConnection(url.hostname, url.port, timeout=self.timeout_s)
        try:
            connection.request("POST", "/v2/models/tensorrt_llm/generate_stream",
                               body=json.dumps(self._token_values(spec, True)),
                               headers={"Content-Type": "application/json"})
            reply = connection.getresponse()
            if reply.status != 200:
                raise ServerError(reply.status, reply.read().decode(errors="replace")[:300])
            for line in reply:
                if not line.startswith(b"data:"):
                    continue
                event = json.loads(line[len(b"data:"):])
                if "error" in event:
                    raise ServerError(400, event["error"])
                if event.get("output_ids"):
                    stream.token()
            # the server closes the event stream after the final event
        finally:
            connection.close()  # an abandoned stream: the dropped connection cancels it

    def _grpc_stream(self, model: str, values: dict, token_output: str, stream: Stream) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.grpc_address)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        cancel = False
        try:
            client.async_stream_infer(model, triton_inputs(grpcclient, values),
                                      request_id=str(stream.spec.index), enable_empty_final_response=True)
            deadline_s = stream.start_s + self.timeout_s
            while True:
                try:
                    result, error = results.get(timeout=max(0.0, deadline_s - time.monotonic()))
                except queue.Empty:
                    cancel = True
                    raise TimeoutError(f"{model} gRPC stream") from None
                if error is not None:
                    raise error
                response = result.get_response()
                output = result.as_numpy(token_output)
                if output is not None and output.size:
                    try:
                        stream.token()
                    except Abandon:
                        cancel = True
                        raise
                if response.parameters["triton_final_response"].bool_param:
                    return
        finally:
            client.stop_stream(cancel_requests=cancel)
            client.close()


TRITON_DTYPES = {  # TensorRT-LLM's input dtypes for what the soak sends
    "text_input": "object", "stop_words": "object", "max_tokens": "int32", "stream": "bool",
    "temperature": "float32", "top_p": "float32", "top_k": "int32", "seed": "uint64", "input_ids": "int32",
    "input_lengths": "int32", "request_output_len": "int32", "streaming": "bool", "runtime_top_p": "float32",
    "runtime_top_k": "int32",
}


def triton_inputs(client_module, values: dict) -> list:
    """``values`` as the ``[1, n]`` tensors TensorRT-LLM's clients send (batch dimension first)."""
    import numpy as np
    from tritonclient.utils import np_to_triton_dtype

    inputs = []
    for name, value in values.items():
        items = value if isinstance(value, (list, tuple)) else [value]
        if TRITON_DTYPES[name] == "object":
            items = [item.encode("utf-8") for item in items]
        array = np.array([items], dtype=TRITON_DTYPES[name])
        tensor = client_module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class ServerError(Exception):
    """A reply that is an error (``status``) or is not what the protocol promises."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


# ------------------------------------------------------------------------------------------ OpenAI
class OpenAIFront:
    """Sends specs to ``kilnlm serve`` with the ``openai`` client."""

    name = "openai"

    def __init__(self, base_url: str, timeout_s: float) -> None:
        import openai

        self.base_url = base_url.rstrip("/")
        self.metrics_url = f"{self.base_url}/metrics"
        self.client = openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=os.environ.get("OPENAI_API_KEY", "none"),
                                    max_retries=0, timeout=timeout_s)
        self.model = self.client.models.list().data[0].id

    @staticmethod
    def is_refusal(exc: Exception) -> bool:
        import openai

        return isinstance(exc, openai.APIStatusError) and 400 <= exc.status_code < 500

    def _arguments(self, spec: RequestSpec) -> dict:
        arguments = {"model": self.model, "max_tokens": spec.max_tokens, "temperature": spec.temperature}
        if spec.temperature > 0 or spec.bad:
            arguments.update(top_p=spec.top_p, seed=spec.seed)
            if spec.top_k:
                arguments["extra_body"] = {"top_k": spec.top_k}
        if spec.stop:
            arguments["stop"] = spec.stop
        return arguments

    def send(self, spec: RequestSpec, stream: Stream) -> None:
        import openai

        messages = [{"role": "user", "content": spec.prompt}]
        try:
            if spec.kind == "completion":
                reply = self.client.completions.create(prompt=spec.prompt, **self._arguments(spec))
                check_finished(reply.choices)
            elif spec.kind == "chat":
                reply = self.client.chat.completions.create(messages=messages, **self._arguments(spec))
                check_finished(reply.choices)
            else:
                self._chat_stream(messages, spec, stream)
        except openai.APITimeoutError as exc:
            raise TimeoutError(str(exc)) from None

    def _chat_stream(self, messages: list, spec: RequestSpec, stream: Stream) -> None:
        chunks = self.client.chat.completions.create(messages=messages, stream=True, **self._arguments(spec))
        finished = False
        try:
            for chunk in chunks:
                for choice in chunk.choices:
                    if choice.delta.content:
                        stream.token()
                    finished = finished or choice.finish_reason is not None
        finally:
            chunks.close()  # an abandoned stream: the dropped connection cancels it
        if not finished:
            raise ServerError(200, "the stream ended without a finish_reason")


def check_finished(choices: list) -> None:
    if not choices or any(choice.finish_reason is None for choice in choices):
        raise ServerError(200, "a choice without a finish_reason")


# ------------------------------------------------------------------------------------------ servers' state
def read_metrics(url: str) -> dict[tuple[str, frozenset], float]:
    """The Prometheus samples at ``url``: {(name, frozenset of label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as reply:
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metric(samples: dict, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    return sum(value for (sample_name, items), value in samples.items()
               if sample_name == name and set(labels.items()) <= items)


def executor_load(url: str) -> dict[str, float]:
    """KV blocks (``max``, ``free``) and requests (``active``, ``waiting``) from TensorRT-LLM's gauges, and
    ``cancelled``: sequences finished by cancellation (``kilnlm_requests_finished_total``)."""
    samples = read_metrics(url)
    load = {kind: metric(samples, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type=kind) for kind in ("max", "free")}
    load.update({kind: metric(samples, "nv_trt_llm_request_metrics", request_type=kind) for kind in ("active", "waiting")})
    load["cancelled"] = metric(samples, "kilnlm_requests_finished_total", finish_reason="cancelled")
    return load


def wait_for_drain(url: str, timeout_s: float) -> dict[str, float]:
    """Poll ``url``'s metrics until no request is active or waiting and every KV block is free, or
    ``timeout_s`` passes; the last load read."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        load = executor_load(url)
        drained = load["active"] == load["waiting"] == 0 and load["free"] == load["max"] > 0
        if drained or time.monotonic() > deadline_s:
            return load
        time.sleep(0.2)


class MemorySampler:
    """Resident memory (bytes) of a process and all its descendants, sampled every ``interval_s`` in a thread."""

    def __init__(self, pid: int, interval_s: float = 0.5) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.start = self.peak = self.end = self.rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for process in processes:
            try:
                total += process.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak = max(self.peak, self.rss())

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        self.end = self.rss()
        self.peak = max(self.peak, self.end)
        return {"start_mb": self.start / 2**20, "end_mb": self.end / 2**20, "peak_mb": self.peak / 2**20}


# ------------------------------------------------------------------------------------------ the soak
def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-quantile (0..1) of ``values`` by nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered) + 0.5)) - 1))]


def soak_front(front, plan: list[RequestSpec], concurrency: int, duration_s: float, timeout_s: float,
               drain_timeout_s: float, server_pid: int | None) -> dict:
    """Run ``plan`` against ``front`` from ``concurrency`` threads until done or ``duration_s`` passes;
    returns the front's report (see the module docstring)."""
    load_before = executor_load(front.metrics_url)
    sampler = MemorySampler(server_pid) if server_pid else None
    todo: queue.Queue = queue.Queue()
    for spec in plan:
        todo.put(spec)
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    start_s = time.monotonic()

    def worker() -> None:
        while time.monotonic() - start_s < duration_s:
            try:
                spec = todo.get_nowait()
            except queue.Empty:
                return
            outcome = run_request(spec, front.send, front.is_refusal, timeout_s)
            with lock:
                outcomes.append(outcome)

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed_s = time.monotonic() - start_s
    load_after = wait_for_drain(front.metrics_url, drain_timeout_s)
    counts = Counter(outcome.result for outcome in outcomes)
    ttft = [o.token_times[0] for o in outcomes if o.spec.kind in STREAM_KINDS and o.token_times]
    itl = [b - a for o in outcomes if o.spec.kind in STREAM_KINDS for a, b in zip(o.token_times, o.token_times[1:])]
    report = {
        "front": front.name,
        "seconds": round(elapsed_s, 1),
        "sent": len(outcomes),
        **{result: counts.get(result, 0) for result in OUTCOMES},
        "failures": Counter(o.reason for o in outcomes if o.result == "failed").most_common(10),
        "lost_requests": [dataclasses.asdict(o.spec) | {"reason": o.reason} for o in outcomes if o.result == "lost"][:10],
        "by_kind": {kind: dict(Counter(o.result for o in outcomes if o.spec.kind == kind)) for kind in FRONT_KINDS[front.name]},
        "server_cancelled": load_after["cancelled"] - load_before["cancelled"],
        "kv_blocks_total": load_after["max"],
        "kv_blocks_held_after_drain": load_after["max"] - load_after["free"],
        "requests_active_after_drain": load_after["active"] + load_after["waiting"],
        "ttft_ms": {"p50": ms(percentile(ttft, 0.5)), "p99": ms(percentile(ttft, 0.99)), "count": len(ttft)},
        "itl_ms": {"p50": ms(percentile(itl, 0.5)), "p99": ms(percentile(itl, 0.99)), "count": len(itl)},
    }
    if sampler is not None:
        report["rss"] = {k: round(v, 1) for k, v in sampler.stop().items()}
    return report


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)


def healthy(report: dict) -> bool:
    """Nothing lost, nothing failed, no KV block or request left in the server after the drain."""
    return (report["lost"] == report["failed"] == 0 and report["kv_blocks_held_after_drain"] == 0
            and report["requests_active_after_drain"] == 0)


def format_report(report: dict) -> str:
    lines = [f"== {report['front']}: {report['sent']} requests in {report['seconds']} s",
             "   " + ", ".join(f"{result} {report[result]}" for result in OUTCOMES)
             + f" (server counted {report['server_cancelled']:.0f} cancelled)",
             f"   KV blocks held after drain: {report['kv_blocks_held_after_drain']:.0f} of {report['kv_blocks_total']:.0f}; "
             f"requests left: {report['requests_active_after_drain']:.0f}",
             f"   TTFT p50 {report['ttft_ms']['p50']} ms, p99 {report['ttft_ms']['p99']} ms "
             f"({report['ttft_ms']['count']} streams); ITL p50 {report['itl_ms']['p50']} ms, "
             f"p99 {report['itl_ms']['p99']} ms"]
    if "rss" in report:
        rss = report["rss"]
        lines.append(f"   server RSS (process tree): start {rss['start_mb']:.0f} MB, end {rss['end_mb']:.0f} MB, "
                     f"peak {rss['peak_mb']:.0f} MB")
    lines += [f"   failed x{count}: {reason}" for reason, count in report["failures"]]
    lines += [f"   lost: {lost}" for lost in report["lost_requests"]]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ servers for --engine
class LaunchedServers:
    """tritonserver and ``kilnlm serve`` on loopback serving one engine; ``stop()`` ends both."""

    def __init__(self, engine_dir: Path, work_dir: Path, start_timeout_s: float = 300.0) -> None:
        from kilnlm.runtime.serving import launcher

        self.launcher = launcher
        http_port, grpc_port, metrics_port, openai_port = launcher.free_ports(4)
        config = launcher.ServerConfig(engine_dir=engine_dir, work_dir=work_dir / "triton", address="127.0.0.1",
                                       http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port)
        prepared = launcher.prepare_server(config)
        self.triton_log = open(work_dir / "tritonserver.log", "wb")
        self.triton = subprocess.Popen(launcher.server_command(config, prepared), env=launcher.server_environment(prepared),
                                       stdout=self.triton_log, stderr=subprocess.STDOUT, start_new_session=True)
        self.serve_log = open(work_dir / "serve.log", "wb")
        self.serve = subprocess.Popen([sys.executable, "-m", "kilnlm.cli", "serve", "--engine", str(engine_dir),
                                       "--host", "127.0.0.1", "--port", str(openai_port)],
                                      stdout=self.serve_log, stderr=subprocess.STDOUT)
        self.triton_http, self.triton_grpc = f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}"
        self.triton_metrics = f"http://127.0.0.1:{metrics_port}/metrics"
        self.openai_url = f"http://127.0.0.1:{openai_port}"
        deadline_s = time.monotonic() + start_timeout_s
        for process, url in ((self.triton, f"{self.triton_http}/v2/health/ready"), (self.serve, f"{self.openai_url}/health")):
            while not answers(url):
                if process.poll() is not None or time.monotonic() > deadline_s:
                    self.stop()
                    raise SystemExit(f"soak: a server did not start; see the logs in {work_dir}")
                time.sleep(0.5)

    def stop(self) -> None:
        for process in (self.serve, self.triton):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
                try:
                    process.wait(60)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait()
        self.launcher.kill_leftovers(self.triton.pid)
        self.triton_log.close()
        self.serve_log.close()


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


# ------------------------------------------------------------------------------------------ command line
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", type=Path, help="start tritonserver and kilnlm serve on loopback serving this engine")
    p.add_argument("--work-dir", type=Path, default=Path(".work/soak"), help="logs of the servers --engine starts")
    p.add_argument("--triton-url", help="tritonserver's HTTP endpoint, e.g. http://127.0.0.1:8000")
    p.add_argument("--triton-grpc", help="tritonserver's gRPC endpoint, e.g. 127.0.0.1:8001")
    p.add_argument("--triton-metrics", help="tritonserver's metrics URL, e.g. http://127.0.0.1:8002/metrics")
    p.add_argument("--openai-url", help="kilnlm serve's base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--tokenizer", type=Path, help="the engine's tokenizer directory (tokenizer.json), for token-id requests")
    p.add_argument("--triton-pid", type=int, help="with URLs: tritonserver's PID, whose process tree's memory to sample")
    p.add_argument("--openai-pid", type=int, help="with URLs: kilnlm serve's PID, whose memory to sample")
    p.add_argument("--fronts", default="triton,openai", help="comma-separated: triton, openai (default: both)")
    p.add_argument("--requests", type=int, default=1000, help="requests per front (default: 1000)")
    p.add_argument("--concurrency", type=int, default=8, help="client threads per front (default: 8)")
    p.add_argument("--duration-s", type=float, default=900.0, help="stop sending after this long, per front (default: 900)")
    p.add_argument("--max-tokens", type=int, default=64, help="max_tokens drawn from 1..this (default: 64)")
    p.add_argument("--max-prompt-words", type=int, default=400, help="longest prompt body in words (default: 400)")
    p.add_argument("--cancel-fraction", type=float, default=0.15, help="streamed requests abandoned mid-stream (default: 0.15)")
    p.add_argument("--bad-fraction", type=float, default=0.02, help="requests that must be refused (default: 0.02)")
    p.add_argument("--request-timeout-s", type=float, default=300.0, help="a request without a final response by then is lost")
    p.add_argument("--drain-timeout-s", type=float, default=60.0, help="how long the servers get to drain after the last request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="also write the report here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    fronts = [f.strip() for f in args.fronts.split(",") if f.strip()]
    unknown = set(fronts) - set(FRONT_KINDS)
    if unknown:
        raise SystemExit(f"soak: unknown front(s) {sorted(unknown)}: choose from {sorted(FRONT_KINDS)}")
    launched = None
    if args.engine is not None:
        args.work_dir.mkdir(parents=True, exist_ok=True)
        launched = LaunchedServers(args.engine, args.work_dir)
        args.triton_url, args.triton_grpc, args.triton_metrics = launched.triton_http, launched.triton_grpc, launched.triton_metrics
        args.openai_url, args.tokenizer = launched.openai_url, args.tokenizer or args.engine / "tokenizer"
        args.triton_pid, args.openai_pid = launched.triton.pid, launched.serve.pid
    try:
        reports = run_soak(args, fronts)
    finally:
        if launched is not None:
            launched.stop()
    for report in reports:
        print(format_report(report))
    if args.json is not None:
        args.json.write_text(json.dumps(reports, indent=2))
    return 0 if all(healthy(report) for report in reports) else 1


def run_soak(args: argparse.Namespace, fronts: list[str]) -> list[dict]:
    """Soak each of ``fronts`` in turn with its own plan (seeded by ``args.seed`` and the front)."""
    words = english_words()
    pids = {"triton": args.triton_pid, "openai": args.openai_pid}
    reports = []
    for front_name in fronts:
        if front_name == "triton":
            if not (args.triton_url and args.triton_grpc and args.triton_metrics and args.tokenizer):
                raise SystemExit("soak: the triton front needs --engine, or --triton-url, --triton-grpc, --triton-metrics and --tokenizer")
            from tokenizers import Tokenizer

            front = TritonFront(args.triton_url, args.triton_grpc, args.triton_metrics,
                                Tokenizer.from_file(str(args.tokenizer / "tokenizer.json")), args.request_timeout_s)
        else:
            if not args.openai_url:
                raise SystemExit("soak: the openai front needs --engine or --openai-url")
            front = OpenAIFront(args.openai_url, args.request_timeout_s)
        rng = random.Random(f"{args.seed}:{front_name}")
        plan = make_plan(front_name, args.requests, rng, words, args.max_tokens, args.max_prompt_words,
                         args.cancel_fraction, args.bad_fraction)
        reports.append(soak_front(front, plan, args.concurrency, args.duration_s, args.request_timeout_s,
                                  args.drain_timeout_s, pids.get(front_name)))
    return reports


if __name__ == "__main__":
    sys.exit(main())
