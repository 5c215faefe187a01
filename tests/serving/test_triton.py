"""End to end through a real tritonserver with real tritonclient: the server's answers are compared with
the runtime executor's own greedy output for the same prompt (the reference), over every protocol path
(HTTP /infer via kilnlm_sync, HTTP generate / generate_stream, gRPC streaming), under concurrency,
with cancellation, bad requests, stop words, and the KV-cache / latency metrics.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from servers import sample

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

MAX_TOKENS = 16
STREAM_TIMEOUT_S = 120.0
PROMPTS = [
    "The capital of France is",
    "Once upon a time, there was a little",
    "The three primary colors are",
    "Water boils at a temperature of",
    "A good way to learn a new language is",
    "The largest planet in our solar system is",
    "def fibonacci(n):",
    "My favourite season of the year is",
]
INPUT_DTYPES = {
    "text_input": np.object_, "max_tokens": np.int32, "stream": np.bool_, "temperature": np.float32,
    "top_k": np.int32, "top_p": np.float32, "seed": np.uint64, "end_id": np.int32, "pad_id": np.int32,
    "stop_words": np.object_, "bad_words": np.object_, "exclude_input_in_output": np.bool_,
    "apply_chat_template": np.bool_,
}


# ------------------------------------------------------------------------------------------- helpers
def _array(name: str, value) -> np.ndarray:
    values = value if isinstance(value, (list, tuple)) else [value]
    if INPUT_DTYPES[name] is np.object_:
        values = [v.encode("utf-8") for v in values]
    return np.array(values, dtype=INPUT_DTYPES[name])


def _inputs(client_module, **values) -> list:
    inputs = []
    for name, value in values.items():
        array = _array(name, value)
        tensor = client_module.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def reference(executor, prompt: str, max_tokens: int = MAX_TOKENS, **params):
    """The runtime executor's own greedy answer for ``prompt`` (the same tokenization the model uses)."""
    from kilnlm.runtime.request import SamplingParams

    prompt_ids = executor.tokenizer.encode(prompt)
    return executor.generate(prompt_ids, SamplingParams(max_tokens=max_tokens, **params), timeout_s=120)


def grpc_stream(server, request_id: str = "r", cancel_after: int | None = None, on_response=None,
                **values):
    """Send one request on a fresh gRPC stream; returns the list of (text, output_ids, finish_reason)
    per response, ending with the final one. With ``cancel_after`` = n, the stream is closed with
    cancel_requests=True after n responses and those n are returned. ``on_response(n)`` is called
    after the n-th response."""
    client = grpcclient.InferenceServerClient(server.grpc_address)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    responses = []
    try:
        client.async_stream_infer("kilnlm", _inputs(grpcclient, **values), request_id=request_id,
                                  enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=STREAM_TIMEOUT_S)
            if error is not None:
                raise error
            final = result.get_response().parameters["triton_final_response"].bool_param
            if result.as_numpy("text_output") is not None:
                responses.append((result.as_numpy("text_output")[0].decode("utf-8"),
                                  result.as_numpy("output_ids").tolist(),
                                  result.as_numpy("finish_reason")[0].decode("utf-8")))
                if on_response is not None:
                    on_response(len(responses))
            if cancel_after is not None and len(responses) >= cancel_after:
                client.stop_stream(cancel_requests=True)
                return responses
            if final:
                return responses
    finally:
        client.stop_stream()
        client.close()


def http_generate(server, endpoint: str = "generate", model: str = "kilnlm", **body):
    """POST to Triton's generate extension; returns (status, list of JSON events)."""
    request = urllib.request.Request(f"{server.http_url}/v2/models/{model}/{endpoint}",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=STREAM_TIMEOUT_S) as reply:
            status, text = reply.status, reply.read().decode("utf-8")
    except urllib.error.HTTPError as exc:
        return exc.code, [json.loads(exc.read().decode("utf-8"))]
    if endpoint == "generate_stream":  # server-sent events: "data: {...}" lines
        return status, [json.loads(line[len("data:"):]) for line in text.splitlines()
                        if line.startswith("data:")]
    return status, [json.loads(text)]


def wait_for_idle(server, timeout_s: float = 20.0) -> tuple[float, float]:
    """Poll the metrics until no request is active or queued and every KV block is free; returns
    (free, total) blocks. Fails with the last values seen on timeout."""
    deadline_s = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        free = sample(m, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="free")
        total = sample(m, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max")
        active = sample(m, "nv_trt_llm_request_metrics", request_type="active")
        queued = sample(m, "nv_trt_llm_request_metrics", request_type="waiting")
        if free == total and total > 0 and active == 0 and queued == 0:
            return free, total
        if time.monotonic() > deadline_s:
            pytest.fail(f"server not idle after {timeout_s} s: free={free} total={total} active={active} "
                        f"queued={queued}")
        time.sleep(0.1)


def wait_for_cancelled(server, num_cancelled: int, timeout_s: float = 10.0) -> None:
    """Poll until ``kilnlm_requests_finished_total{finish_reason="cancelled"}`` reaches ``num_cancelled``;
    fails on timeout."""
    deadline_s = time.monotonic() + timeout_s
    while server.metric("kilnlm_requests_finished_total", finish_reason="cancelled") < num_cancelled:
        assert time.monotonic() < deadline_s, f"fewer than {num_cancelled} requests counted as cancelled"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def never_end_id(smollm2_executor) -> int:
    """An end_id the model does not produce on these prompts (the last vocabulary id), so a request
    runs to max_tokens."""
    return smollm2_executor.vocab_size - 1


# --------------------------------------------------------------------------------------------- tests
def test_http_infer_matches_executor_greedy(triton_server, smollm2_executor):
    prompt = PROMPTS[0]
    expected = reference(smollm2_executor, prompt)
    assert expected.text, "the reference produced no text"
    client = httpclient.InferenceServerClient(triton_server.http_url.removeprefix("http://"))
    result = client.infer("kilnlm_sync", _inputs(httpclient, text_input=prompt, max_tokens=MAX_TOKENS,
                                                 exclude_input_in_output=True))
    assert result.as_numpy("text_output")[0].decode() == expected.text
    assert result.as_numpy("output_ids").tolist() == expected.token_ids
    assert result.as_numpy("finish_reason")[0].decode() == expected.finish_reason.value
    # TensorRT-LLM's default: a non-streamed answer repeats the prompt.
    with_prompt = client.infer("kilnlm_sync", _inputs(httpclient, text_input=prompt, max_tokens=MAX_TOKENS))
    assert with_prompt.as_numpy("text_output")[0].decode() == prompt + expected.text


def test_grpc_streaming_deltas_concatenate_to_the_full_text(triton_server, smollm2_executor):
    prompt = PROMPTS[1]
    expected = reference(smollm2_executor, prompt)
    responses = grpc_stream(triton_server, text_input=prompt, max_tokens=MAX_TOKENS, stream=True)
    assert len(responses) > 1, "streaming sent everything in one response"
    assert "".join(text for text, _, _ in responses) == expected.text
    assert [t for _, ids, _ in responses for t in ids] == expected.token_ids
    assert responses[-1][2] == expected.finish_reason.value
    assert all(reason == "" for _, _, reason in responses[:-1])


def test_http_generate_and_generate_stream(triton_server, smollm2_executor):
    prompt = PROMPTS[2]
    expected = reference(smollm2_executor, prompt)
    status, [answer] = http_generate(triton_server, text_input=prompt, max_tokens=MAX_TOKENS,
                                     exclude_input_in_output=True)
    assert status == 200, answer
    assert answer["text_output"] == expected.text
    status, events = http_generate(triton_server, "generate_stream", text_input=prompt,
                                   max_tokens=MAX_TOKENS, stream=True)
    assert status == 200, events
    assert len(events) > 1
    assert "".join(e["text_output"] for e in events) == expected.text
    assert events[-1]["finish_reason"] == expected.finish_reason.value


def test_apply_chat_template_answers_as_the_instruct_model(triton_server, smollm2_executor):
    question = "What is the capital of France?"
    tokenizer = smollm2_executor.tokenizer
    chat_ids = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]),
                                add_special_tokens=False)
    from kilnlm.runtime.request import SamplingParams

    expected = smollm2_executor.generate(chat_ids, SamplingParams(max_tokens=24), timeout_s=120)
    status, [answer] = http_generate(triton_server, text_input=question, max_tokens=24, apply_chat_template=True,
                                     exclude_input_in_output=True)
    assert status == 200, answer
    assert answer["text_output"] == expected.text
    assert "Paris" in answer["text_output"]


def test_concurrent_clients_get_the_text_they_get_alone(triton_server):
    def ask(prompt: str) -> str:
        responses = grpc_stream(triton_server, text_input=prompt, max_tokens=MAX_TOKENS, stream=True)
        return "".join(text for text, _, _ in responses)

    alone = [ask(p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(ask, PROMPTS))
    assert together == alone
    wait_for_idle(triton_server)


def test_request_joining_running_batch_finishes_and_blocks_are_freed(triton_server, smollm2_executor,
                                                                     never_end_id):
    long_prompts = PROMPTS[3:5]
    first_token = threading.Barrier(len(long_prompts) + 1, timeout=STREAM_TIMEOUT_S)
    finished_at: dict[str, float] = {}

    def long_request(prompt: str) -> str:
        client = grpcclient.InferenceServerClient(triton_server.grpc_address)
        results: queue.Queue = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put((result, error)))
        client.async_stream_infer("kilnlm", _inputs(grpcclient, text_input=prompt, max_tokens=64,
                                                    stream=True, end_id=never_end_id))
        parts = []
        try:
            while True:
                result, error = results.get(timeout=STREAM_TIMEOUT_S)
                assert error is None, error
                parts.append(result.as_numpy("text_output")[0].decode())
                if len(parts) == 1:
                    first_token.wait()
                if result.get_response().parameters["triton_final_response"].bool_param:
                    finished_at[prompt] = time.monotonic()
                    return "".join(parts)
        finally:
            client.stop_stream()
            client.close()

    with ThreadPoolExecutor(len(long_prompts)) as pool:
        futures = [pool.submit(long_request, p) for p in long_prompts]
        first_token.wait()  # both long requests are generating
        joined_prompt = PROMPTS[5]
        status, [answer] = http_generate(triton_server, text_input=joined_prompt, max_tokens=8,
                                         exclude_input_in_output=True)
        joined_done_s = time.monotonic()
        long_texts = [f.result() for f in futures]
    assert status == 200, answer
    assert answer["text_output"] == reference(smollm2_executor, joined_prompt, max_tokens=8).text
    assert all(joined_done_s < finished_at[p] for p in long_prompts), \
        "the joining request did not finish while the long ones were still generating"
    for prompt, text in zip(long_prompts, long_texts):
        assert text == reference(smollm2_executor, prompt, max_tokens=64, end_id=never_end_id).text
    wait_for_idle(triton_server)


def test_cancelled_grpc_stream_frees_its_blocks(triton_server, never_end_id):
    wait_for_idle(triton_server)
    num_cancelled_before = triton_server.metric("kilnlm_requests_finished_total", finish_reason="cancelled")
    in_flight = {}

    def probe(num_responses: int) -> None:  # while the request generates: it holds KV blocks
        if num_responses != 8:
            return
        deadline_s = time.monotonic() + 5
        while triton_server.metric("nv_trt_llm_request_metrics", request_type="active") != 1 and \
                time.monotonic() < deadline_s:
            time.sleep(0.05)  # the gauges refresh every 0.1 s
        in_flight.update(triton_server.metrics())

    responses = grpc_stream(triton_server, text_input=PROMPTS[6], max_tokens=1000, stream=True,
                            end_id=never_end_id, cancel_after=16, on_response=probe)
    assert len(responses) == 16
    assert sample(in_flight, "nv_trt_llm_request_metrics", request_type="active") == 1
    assert sample(in_flight, "nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used") > 0
    wait_for_idle(triton_server)  # well before the 1000 tokens it asked for
    wait_for_cancelled(triton_server, num_cancelled_before + 1)
    status, [answer] = http_generate(triton_server, text_input=PROMPTS[0], max_tokens=4)
    assert status == 200, answer


def test_dropped_http_generate_stream_is_cancelled(triton_server, never_end_id):
    import http.client

    wait_for_idle(triton_server)
    num_cancelled_before = triton_server.metric("kilnlm_requests_finished_total", finish_reason="cancelled")
    host, port = triton_server.http_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=STREAM_TIMEOUT_S)
    body = {"text_input": PROMPTS[7], "max_tokens": 1000, "stream": True, "end_id": never_end_id}
    connection.request("POST", "/v2/models/kilnlm/generate_stream", body=json.dumps(body))
    reply = connection.getresponse()
    num_events = 0
    while num_events < 4:
        if reply.fp.readline().startswith(b"data:"):
            num_events += 1
    connection.sock.shutdown(2)  # the client goes away mid-stream
    connection.close()
    wait_for_idle(triton_server)  # well before the 1000 tokens it asked for
    wait_for_cancelled(triton_server, num_cancelled_before + 1)


@pytest.mark.parametrize("body, message", [
    ({"text_input": ""}, "text_input"),
    ({"text_input": "Hello", "max_tokens": -1}, "max_tokens"),
    ({"text_input": "Hello", "top_p": 1.5}, "top_p"),
    ({"text_input": "Hello", "temperature": -0.5}, "temperature"),
    ({"text_input": "Hello", "end_id": 10_000_000}, "end_id"),
])
def test_bad_request_gets_an_error_and_the_server_keeps_serving(triton_server, body, message):
    status, [answer] = http_generate(triton_server, **body)
    assert status == 400, answer
    assert message in answer["error"]
    status, [answer] = http_generate(triton_server, text_input=PROMPTS[0], max_tokens=2)
    assert status == 200, answer


def test_bad_request_over_grpc_and_infer(triton_server):
    with pytest.raises(InferenceServerException, match="max_tokens"):
        grpc_stream(triton_server, text_input="Hello", max_tokens=0, stream=True)
    client = httpclient.InferenceServerClient(triton_server.http_url.removeprefix("http://"))
    with pytest.raises(InferenceServerException, match="top_p"):
        client.infer("kilnlm_sync", _inputs(httpclient, text_input="Hello", top_p=0.0))
    not_utf8 = httpclient.InferInput("text_input", [1], "BYTES")
    not_utf8.set_data_from_numpy(np.array([b"caf\xe9"], dtype=np.object_))
    with pytest.raises(InferenceServerException, match="UTF-8"):
        client.infer("kilnlm_sync", [not_utf8])
    assert client.is_model_ready("kilnlm")
    result = client.infer("kilnlm_sync", _inputs(httpclient, text_input="Hello", max_tokens=2))
    assert result.as_numpy("sequence_length")[0] >= 1


def test_stop_words_end_generation_before_the_stop_string(triton_server, smollm2_executor):
    prompt = PROMPTS[2]
    full = reference(smollm2_executor, prompt).text
    words = full.split()
    assert len(words) >= 3, f"reference text too short to pick a stop word from: {full!r}"
    stop = words[len(words) // 2]
    expected = full[: full.find(stop)]
    status, [answer] = http_generate(triton_server, text_input=prompt, max_tokens=MAX_TOKENS,
                                     exclude_input_in_output=True, stop_words=[stop, "\u2603never"])
    assert status == 200, answer
    assert answer["text_output"] == expected
    assert answer["finish_reason"] == "stop"
    streamed = grpc_stream(triton_server, text_input=prompt, max_tokens=MAX_TOKENS, stream=True,
                           stop_words=[stop])
    assert "".join(text for text, _, _ in streamed) == expected


def test_bad_words_are_never_generated(triton_server, smollm2_executor):
    prompt = PROMPTS[0]
    tokenizer = smollm2_executor.tokenizer
    first_token = reference(smollm2_executor, prompt).token_ids[0]
    word = tokenizer.decode([first_token])
    if tokenizer.encode(word, add_special_tokens=False) != [first_token]:
        pytest.skip(f"the first greedy token {first_token} ({word!r}) does not round-trip through the tokenizer")
    expected = reference(smollm2_executor, prompt, bad_words=[[first_token]])
    status, [answer] = http_generate(triton_server, text_input=prompt, max_tokens=MAX_TOKENS,
                                     exclude_input_in_output=True, bad_words=[word], pad_id=0)
    assert status == 200, answer
    assert first_token not in answer["output_ids"]
    assert answer["text_output"] == expected.text


def test_latency_histograms_and_token_counter(triton_server):
    http_generate(triton_server, text_input=PROMPTS[7], max_tokens=4)
    m = triton_server.metrics()
    assert sample(m, "kilnlm_time_to_first_token_seconds_count", model="kilnlm") >= 1
    assert sample(m, "kilnlm_inter_token_latency_seconds_count", model="kilnlm") >= 1
    assert sample(m, "kilnlm_generated_tokens_total", model="kilnlm") >= 4
