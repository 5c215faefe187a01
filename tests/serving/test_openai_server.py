"""``kilnlm serve``: the OpenAI-compatible server, driven by the real ``openai`` client over a real uvicorn
server on loopback (one per module, in this process, over the fp32 tiny engine: the executor's stats are
at hand), and ``kilnlm serve`` itself on the SmolLM2 fp32 engine for one chat completion."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai  # the test extra installs it: a missing client fails here, it never skips
import pytest

from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.request import SamplingParams
from kilnlm.runtime.serving.openai_server import ServerSettings
from factories import CAPITAL_QUESTION
from servers import all_blocks_free, running_kilnlm_serve, running_openai_server, sample

MODEL = "tiny"
API_KEY = "test-key"
PROMPT = "The quick brown fox"
LONG = dict(max_tokens=200, extra_body={"ignore_eos": True})  # runs long enough to be interrupted


def make_client(url: str, api_key: str = API_KEY, **options) -> "openai.OpenAI":
    return openai.OpenAI(base_url=f"{url}/v1", api_key=api_key, max_retries=0, timeout=options.pop("timeout", 60),
                         **options)


def wait_for(predicate, timeout_s: float = 10.0, what: str = "condition", message=lambda: ""):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what} {message()}"
        time.sleep(0.02)


def metric_samples(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^((?:kilnlm|nv)_\S+)\s+(\S+)$", text, re.M)}


def cancelled_count(url: str) -> float:
    return sample(metric_samples(url), "kilnlm_requests_finished_total", model=MODEL, finish_reason="cancelled")


@pytest.fixture(scope="module")
def tiny_executor(tiny_engine_dir):
    executor = Executor.from_engine_dir(tiny_engine_dir, ExecutorConfig())
    yield executor
    executor.shutdown()


@pytest.fixture(scope="module")
def server_url(tiny_executor):
    with running_openai_server(tiny_executor, ServerSettings(MODEL, api_key=API_KEY)) as url:
        yield url


@pytest.fixture
def client(server_url):
    return make_client(server_url)


# ----------------------------------------------------------------------------------------- completions
def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completion_is_the_executors(client, tiny_executor):
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True})
    prompt_ids = tiny_executor.tokenizer.encode(PROMPT)
    expected = tiny_executor.generate(prompt_ids, SamplingParams(max_tokens=8, ignore_eos=True))
    (choice,) = completion.choices
    assert completion.object == "text_completion"
    assert (choice.index, choice.text, choice.finish_reason) == (0, expected.text, "length")
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens) == \
        (len(prompt_ids), 8, len(prompt_ids) + 8)


def test_streamed_completion_with_usage(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    *text_chunks, usage_chunk = chunks
    assert "".join(c.choices[0].text for c in text_chunks) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.usage is None for c in text_chunks)
    assert usage_chunk.choices == [] and usage_chunk.usage.model_dump() == whole.usage.model_dump()


def test_stop_string_ends_the_completion(client):
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), f"no usable stop string in {text!r}"
    choice = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True}).choices[0]
    assert (choice.text, choice.finish_reason) == (text[:text.index(stop)], "stop")


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed,
                                         extra_body={"ignore_eos": True}).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_n_returns_one_choice_per_sequence(client):
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=7,
                                           extra_body={"ignore_eos": True})
    assert sorted(c.index for c in completion.choices) == [0, 1, 2]
    assert completion.usage.completion_tokens == 18


def test_completion_logprobs(client):
    completion = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 5
    for logprob, top in zip(logprobs.token_logprobs, logprobs.top_logprobs):
        # by token text: two ids may decode alike; greedy: the sampled token is the most likely
        assert 1 <= len(top) <= 3 and logprob == pytest.approx(max(top.values()), abs=1e-5)


# ------------------------------------------------------------------------------------------------ chat
def test_chat_streamed_and_not(client):
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk" and chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 10


def test_chat_logprobs(client):
    completion = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                                extra_body={"ignore_eos": True})
    content = completion.choices[0].logprobs.content
    assert len(content) == completion.usage.completion_tokens == 4
    for entry in content:
        assert len(entry.top_logprobs) == 2 and entry.logprob <= 0.0
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert entry.bytes == list(entry.token.encode("utf-8"))


# ---------------------------------------------------------------------------------------------- errors
def _error_fields(exc: "openai.APIStatusError") -> dict:
    assert set(exc.body) == {"message", "type", "param", "code"}, exc.body
    return exc.body


def test_bad_parameter_is_400(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1.0)
    assert "temperature" in _error_fields(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:  # kilnlm's extra, checked like the others
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"num_speculative_tokens": -1})
    assert "num_speculative_tokens is -1" in _error_fields(info.value)["message"]
    with pytest.raises(openai.BadRequestError) as info:  # FastAPI's 422, in OpenAI's shape
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"max_tokens": "many"})
    assert info.value.status_code == 400 and _error_fields(info.value)["param"] == "max_tokens"
    refused = [({"echo": True}, "echo"), ({"logit_bias": {"42": 5}}, "logit_bias"),
               ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema")]
    for extra, named in refused:  # what kilnlm cannot honour is refused by name, never ignored
        with pytest.raises(openai.BadRequestError) as info:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra)
        assert named in _error_fields(info.value)["message"]


def test_wrong_or_missing_api_key_is_401(server_url):
    with pytest.raises(openai.AuthenticationError) as info:
        make_client(server_url, api_key="wrong-key").models.list()
    assert _error_fields(info.value)["code"] == "invalid_api_key"
    with pytest.raises(urllib.error.HTTPError) as info:  # (the openai client refuses to send no key)
        urllib.request.urlopen(f"{server_url}/v1/models", timeout=10)
    assert info.value.code == 401 and json.loads(info.value.read())["error"]["code"] == "invalid_api_key"
    with urllib.request.urlopen(f"{server_url}/health", timeout=10) as reply:  # needs no key
        assert reply.status == 200


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "Hi"}])
    assert _error_fields(info.value)["code"] == "model_not_found"


def test_full_queue_is_503(tiny_engine_dir):
    """One sequence at a time and one waiting: a third request is refused with 503 (QueueFullError)."""
    executor = Executor.from_engine_dir(tiny_engine_dir, ExecutorConfig(max_batch_size=1, max_queue_size=1))
    try:
        with running_openai_server(executor, ServerSettings(MODEL)) as url:
            client = make_client(url)
            running = client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **LONG)
            next(iter(running))  # admitted
            waiting = threading.Thread(target=lambda: make_client(url).completions.create(
                model=MODEL, prompt=PROMPT, max_tokens=2), daemon=True)
            waiting.start()
            wait_for(lambda: executor.stats().num_queued == 1, what="a queued request")
            with pytest.raises(openai.InternalServerError) as info:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert info.value.status_code == 503 and _error_fields(info.value)["code"] == "queue_full"
            running.close()
            waiting.join(timeout=30)
            wait_for(lambda: all_blocks_free(executor), what="every KV block free")
    finally:
        executor.shutdown()


# ------------------------------------------------------------------------------------------ disconnect
def test_disconnect_mid_stream_cancels_the_request(client, server_url, tiny_executor):
    cancelled_before = cancelled_count(server_url)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on"}],
                                            stream=True, **LONG)
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    stream.close()
    wait_for(lambda: all_blocks_free(tiny_executor), what="every KV block free after the disconnect")
    wait_for(lambda: cancelled_count(server_url) == cancelled_before + 1, what="the request counted as cancelled")


def test_disconnect_while_waiting_cancels_the_request(tiny_engine_dir):
    """A non-streamed request whose client gives up (here: while it waits behind three long requests for
    the one batch slot) is cancelled at once, and the pool is whole once the others are closed."""
    executor = Executor.from_engine_dir(tiny_engine_dir, ExecutorConfig(max_batch_size=1))
    try:
        with running_openai_server(executor, ServerSettings(MODEL)) as url:
            ahead = [make_client(url).completions.create(model=MODEL, prompt=PROMPT, stream=True, **LONG)
                     for _ in range(3)]
            next(iter(ahead[0]))
            with pytest.raises(openai.APITimeoutError):
                make_client(url, timeout=0.25).completions.create(model=MODEL, prompt=PROMPT, **LONG)
            wait_for(lambda: cancelled_count(url) == 1, what="the waiting request cancelled",
                     message=lambda: metric_samples(url))
            for stream in ahead:
                stream.close()
            wait_for(lambda: all_blocks_free(executor), what="every KV block free")
    finally:
        executor.shutdown()


def test_a_hundred_clients_disconnecting_at_once(tiny_engine_dir):
    """100 streamed requests submitted while the engine's first step is held (8 admitted, 92 waiting for a
    batch slot); every client closes its connection at the same moment (issue 26, item 3): all 100 end as
    cancelled, the server keeps answering, and every KV block is back in the pool."""
    import http.client

    executor = Executor.from_engine_dir(tiny_engine_dir, ExecutorConfig(max_batch_size=8))
    forward, go = executor.engine.forward, threading.Event()
    executor.engine.forward = lambda *args: (go.wait(60), forward(*args))[1]  # hold the first step: none finishes
    submit, submitted = executor.submit, []
    executor.submit = lambda *args, **kwargs: submitted.append(submit(*args, **kwargs)) or submitted[-1]
    try:
        with running_openai_server(executor, ServerSettings(MODEL)) as url:
            host, port = url.removeprefix("http://").split(":")
            body = json.dumps({"model": MODEL, "prompt": PROMPT, "stream": True, **LONG["extra_body"],
                               "max_tokens": LONG["max_tokens"]})
            connections = []
            for _ in range(100):
                connection = http.client.HTTPConnection(host, int(port), timeout=60)
                connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                connections.append(connection)
            wait_for(lambda: len(submitted) == 100, what="all 100 requests submitted", message=lambda: len(submitted))
            barrier = threading.Barrier(100)

            def disconnect(connection):
                barrier.wait()
                connection.sock.shutdown(socket.SHUT_RDWR)
                connection.close()

            threads = [threading.Thread(target=disconnect, args=(c,)) for c in connections]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
            go.set()
            wait_for(lambda: cancelled_count(url) == 100, timeout_s=60, what="all 100 requests cancelled",
                     message=lambda: executor.stats())
            wait_for(lambda: all_blocks_free(executor), what="every KV block free")
            completion = make_client(url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
            assert completion.choices[0].text
    finally:
        executor.shutdown()


# ---------------------------------------------------------------------------------------------- health
def test_health_and_metrics(client, server_url):
    with urllib.request.urlopen(f"{server_url}/health", timeout=10) as reply:
        assert reply.status == 200
    before = sample(metric_samples(server_url), "kilnlm_time_to_first_token_seconds_count", model=MODEL)
    for stream in (False, True, False):
        list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, stream=True,
                                       extra_body={"ignore_eos": True})) if stream else \
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"ignore_eos": True})
    after = metric_samples(server_url)
    assert sample(after, "kilnlm_time_to_first_token_seconds_count", model=MODEL) == before + 3
    blocks = "nv_trt_llm_kv_cache_block_metrics"
    assert sample(after, blocks, model=MODEL, kv_cache_block_type="free") == \
        sample(after, blocks, model=MODEL, kv_cache_block_type="max") > 0


# ----------------------------------------------------------------------------------------- kilnlm serve
def test_serve_help_and_executor_options():
    from kilnlm.cli.main import make_parser
    from kilnlm.cli.serve_cmd import executor_config

    fields = [f.name for f in dataclasses.fields(ExecutorConfig)]
    help_text = subprocess.run([sys.executable, "-m", "kilnlm.cli", "serve", "--help"], capture_output=True,
                               text=True, check=True, env={**os.environ, "COLUMNS": "400"}).stdout
    for name in fields:
        assert f"--{name.replace('_', '-')}" in help_text and f"--{name}" in help_text
    assert help_text.count("(default:") >= len(fields) + 7
    args = make_parser().parse_args(["serve", "--engine", "x", "--max_queue_size", "4",
                                     "--enable-kv-cache-reuse", "false", "--batch-scheduler-policy",
                                     "guaranteed_no_evict"])
    assert executor_config(args) == ExecutorConfig(max_queue_size=4, enable_kv_cache_reuse=False,
                                                   batch_scheduler_policy="guaranteed_no_evict")


@pytest.mark.e2e
def test_kilnlm_serve_answers_paris(smollm2_engine_fp32_dir, tmp_path):
    args = ["--engine", str(smollm2_engine_fp32_dir), "--served-model-name", "smollm2", "--api-key", API_KEY,
            "--log-level", "warning"]
    with running_kilnlm_serve(args, tmp_path) as served:
        completion = make_client(served.url).chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": CAPITAL_QUESTION}],
            temperature=0, max_tokens=20)
        assert "Paris" in completion.choices[0].message.content
        assert completion.choices[0].finish_reason == "stop"


def test_serve_resolves_a_cache_reference(tiny_engine_dir, tmp_path):
    """``--engine NAME:VERSION --cache DIR``: the engine is fetched from the cache into the local engine
    cache directory and verified, as a deployed model's pointer is; a second resolve reuses that copy."""
    from kilnlm.cli.serve_cmd import resolve_engine
    from kilnlm.runtime.distribution.cache import EngineCache
    from kilnlm.runtime.engine import verify_engine

    cache_url = str(tmp_path / "cache")
    entry = EngineCache(cache_url).publish(Path(tiny_engine_dir), name="tiny", version="1")
    local = resolve_engine("tiny:1", cache_url, tmp_path / "served")
    assert local == tmp_path / "served" / entry.key
    verify_engine(local)
    assert resolve_engine(f"{cache_url}/tiny:latest", None, tmp_path / "served") == local
    assert resolve_engine(str(tiny_engine_dir), cache_url, tmp_path / "served") == Path(tiny_engine_dir)
