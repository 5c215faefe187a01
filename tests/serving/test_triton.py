"""End to end through a real tritonserver serving TensorRT-LLM's model set (ensemble, tensorrt_llm_bls,
tensorrt_llm, preprocessing, postprocessing) with real clients, driven as TensorRT-LLM's own clients drive
it: the documented curl on ``ensemble/generate`` and ``generate_stream``, gRPC streams of ``[1, 1]``-shaped
tensors (tritonclient.grpc) on ``ensemble``, ``tensorrt_llm_bls`` and ``tensorrt_llm`` (token ids in, ids
out). Answers are compared with the runtime executor's own greedy output for the same prompt (the
reference); also concurrency, cancellation, refusals, bad requests, stop / bad words and the metrics.
"""

from __future__ import annotations

import json
import queue
import shutil
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from factories import CAPITAL_QUESTION
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
LLM_MODEL = "tensorrt_llm"  # the model that hosts the executor and reports the metrics
INPUT_DTYPES = {  # the ensemble's / tensorrt_llm_bls's inputs, then tensorrt_llm's (TensorRT-LLM's dtypes)
    "text_input": np.object_, "max_tokens": np.int32, "stream": np.bool_, "temperature": np.float32,
    "top_k": np.int32, "top_p": np.float32, "seed": np.uint64, "end_id": np.int32, "pad_id": np.int32,
    "stop_words": np.object_, "bad_words": np.object_, "exclude_input_in_output": np.bool_,
    "return_log_probs": np.bool_, "num_return_sequences": np.int32, "beam_width": np.int32,
    "lora_task_id": np.uint64, "apply_chat_template": np.bool_,
    "input_ids": np.int32, "input_lengths": np.int32, "request_output_len": np.int32, "streaming": np.bool_,
    "runtime_top_k": np.int32, "runtime_top_p": np.float32,
}


# ------------------------------------------------------------------------------------------- helpers
def _array(name: str, value) -> np.ndarray:
    """``value`` as the ``[1, n]`` tensor TensorRT-LLM's clients send (batch dimension first)."""
    values = value if isinstance(value, (list, tuple)) else [value]
    if INPUT_DTYPES[name] is np.object_:
        values = [v.encode("utf-8") for v in values]
    return np.array([values], dtype=INPUT_DTYPES[name])


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


def grpc_stream(server, model: str = "ensemble", request_id: str = "r", cancel_after: int | None = None,
                on_response=None, **values) -> list[dict]:
    """Send one request on a fresh gRPC stream; returns each response's outputs as {name: numpy array},
    ending with the final one. With ``cancel_after`` = n, the stream is closed with cancel_requests=True
    after n responses and those n are returned. ``on_response(n)`` is called after the n-th response."""
    client = grpcclient.InferenceServerClient(server.grpc_address)
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    responses = []
    try:
        client.async_stream_infer(model, _inputs(grpcclient, **values), request_id=request_id,
                                  enable_empty_final_response=True)
        while True:
            result, error = results.get(timeout=STREAM_TIMEOUT_S)
            if error is not None:
                raise error
            final = result.get_response().parameters["triton_final_response"].bool_param
            outputs = {o.name: result.as_numpy(o.name) for o in result.get_response().outputs}
            if outputs:
                responses.append(outputs)
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


def texts(responses: list[dict]) -> list[str]:
    key = "text_output" if "text_output" in responses[0] else "output_text"
    return [r[key].reshape(-1)[0].decode("utf-8") for r in responses]


def reasons(responses: list[dict]) -> list[str]:
    return [r["finish_reason"].reshape(-1)[0].decode("utf-8") for r in responses]


def http_generate(server, endpoint: str = "generate", model: str = "ensemble", **body):
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
    while not server.is_idle(LLM_MODEL):
        if time.monotonic() > deadline_s:
            pytest.fail(f"server not idle after {timeout_s} s: {server.llm_load(LLM_MODEL)}")
        time.sleep(0.1)
    load = server.llm_load(LLM_MODEL)
    return load["free"], load["total"]


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
def test_documented_curl_on_ensemble_generate(triton_server, smollm2_executor):
    """TensorRT-LLM's documented first request, empty bad_words / stop_words included; the real curl when
    installed."""
    prompt = "What is machine learning?"
    body = {"text_input": prompt, "max_tokens": 20, "bad_words": "", "stop_words": ""}
    url = f"{triton_server.http_url}/v2/models/ensemble/generate"
    if shutil.which("curl"):
        done = subprocess.run(["curl", "-s", "-X", "POST", url, "-d", json.dumps(body)], capture_output=True,
                              text=True, timeout=STREAM_TIMEOUT_S, check=True)
        answer = json.loads(done.stdout)
    else:
        status, [answer] = http_generate(triton_server, **body)
        assert status == 200, answer
    expected = reference(smollm2_executor, prompt, max_tokens=20)
    assert answer["text_output"] == prompt + expected.text  # TensorRT-LLM's default: the prompt repeated
    assert answer["num_output_tokens"] == len(expected.token_ids)
    assert answer["finish_reason"] == expected.finish_reason.value


def test_generate_stream_concatenates_to_the_non_streamed_text(triton_server, smollm2_executor):
    prompt = PROMPTS[2]
    expected = reference(smollm2_executor, prompt)
    for model in ("ensemble", "tensorrt_llm_bls"):
        status, [answer] = http_generate(triton_server, model=model, text_input=prompt, max_tokens=MAX_TOKENS,
                                         exclude_input_in_output=True)
        assert status == 200, answer
        assert answer["text_output"] == expected.text, model
        status, events = http_generate(triton_server, "generate_stream", model=model, text_input=prompt,
                                       max_tokens=MAX_TOKENS, stream=True)
        assert status == 200, events
        assert len(events) > 1, f"{model} sent everything in one event"
        assert "".join(e["text_output"] for e in events) == answer["text_output"], model
        assert events[-1]["finish_reason"] == expected.finish_reason.value


@pytest.mark.parametrize("model", ["ensemble", "tensorrt_llm_bls"])
def test_grpc_streaming_text_models(triton_server, smollm2_executor, model):
    prompt = PROMPTS[1]
    expected = reference(smollm2_executor, prompt)
    responses = grpc_stream(triton_server, model, text_input=prompt, max_tokens=MAX_TOKENS, stream=True)
    assert len(responses) > 1, "streaming sent everything in one response"
    assert "".join(texts(responses)) == expected.text  # spaces kept between pieces
    assert reasons(responses)[-1] == expected.finish_reason.value
    assert all(reason == "" for reason in reasons(responses)[:-1])
    assert sum(int(r["num_output_tokens"].reshape(-1)[0]) for r in responses) == len(expected.token_ids)


def test_grpc_streaming_tensorrt_llm_token_ids_in_ids_out(triton_server, smollm2_executor):
    prompt = PROMPTS[0]
    prompt_ids = smollm2_executor.tokenizer.encode(prompt)
    expected = reference(smollm2_executor, prompt)
    responses = grpc_stream(triton_server, "tensorrt_llm", input_ids=prompt_ids, input_lengths=len(prompt_ids),
                            request_output_len=MAX_TOKENS, streaming=True)
    assert [t for r in responses for t in r["output_ids"].reshape(-1).tolist()] == expected.token_ids
    assert all(r["output_ids"].shape == (1, 1, int(r["sequence_length"].reshape(-1)[0])) for r in responses)
    assert "".join(texts(responses)) == expected.text
    # Not streamed: one response, the prompt's ids first (exclude_input_in_output false, as TensorRT-LLM).
    [whole] = grpc_stream(triton_server, "tensorrt_llm", input_ids=prompt_ids, input_lengths=len(prompt_ids),
                          request_output_len=MAX_TOKENS)
    assert whole["output_ids"].reshape(-1).tolist() == prompt_ids + expected.token_ids
    assert int(whole["num_input_tokens"].reshape(-1)[0]) == len(prompt_ids)


def test_http_infer_on_preprocessing_and_postprocessing_with_batch_shaped_tensors(triton_server, smollm2_executor):
    """HTTP /infer with ``[1, 1]``-shaped tensors, as TensorRT-LLM's clients send them, on the two
    non-decoupled models of this decoupled set (test_triton_infer.py serves the whole set non-decoupled)."""
    tokenizer = smollm2_executor.tokenizer
    client = httpclient.InferenceServerClient(triton_server.http_url.removeprefix("http://"))
    query = np.array([[PROMPTS[0].encode()]], dtype=np.object_)
    inputs = [httpclient.InferInput("QUERY", [1, 1], "BYTES"), httpclient.InferInput("REQUEST_OUTPUT_LEN", [1, 1], "INT32"),
              httpclient.InferInput("STOP_WORDS_DICT", [1, 1], "BYTES")]
    for tensor, array in zip(inputs, (query, np.array([[8]], dtype=np.int32), np.array([[b" Paris"]], dtype=np.object_))):
        tensor.set_data_from_numpy(array)
    result = client.infer("preprocessing", inputs)
    assert result.as_numpy("INPUT_ID").tolist() == [tokenizer.encode(PROMPTS[0])]
    stop_ids = tokenizer.encode(" Paris", add_special_tokens=False)
    assert result.as_numpy("STOP_WORDS_IDS")[0, 0, :len(stop_ids)].tolist() == stop_ids
    ids = np.array([[tokenizer.encode(" Paris is", add_special_tokens=False)]], dtype=np.int32)
    inputs = [httpclient.InferInput("TOKENS_BATCH", list(ids.shape), "INT32"),
              httpclient.InferInput("SEQUENCE_LENGTH", [1, 1], "INT32")]
    inputs[0].set_data_from_numpy(ids)
    inputs[1].set_data_from_numpy(np.array([[ids.shape[-1]]], dtype=np.int32))
    assert client.infer("postprocessing", inputs).as_numpy("OUTPUT").tolist() == [[b" Paris is"]]


@pytest.mark.parametrize("model, name, value", [
    ("ensemble", "beam_width", 2), ("tensorrt_llm_bls", "beam_width", 2), ("ensemble", "lora_task_id", 3)])
def test_inputs_kilnlm_cannot_honour_are_refused_by_name(triton_server, model, name, value):
    status, [answer] = http_generate(triton_server, model=model, text_input="Hello", max_tokens=4, **{name: value})
    assert status == 400, answer
    assert name in answer["error"]
    with pytest.raises(InferenceServerException, match=name):
        grpc_stream(triton_server, model, text_input="Hello", max_tokens=4, **{name: value})
    status, [answer] = http_generate(triton_server, model=model, text_input="Hello", max_tokens=4, beam_width=1)
    assert status == 200, answer  # the default value passes


def test_log_probs_are_returned(triton_server):
    """Needs the sampling branch (Response.log_probs / cum_log_prob)."""
    responses = grpc_stream(triton_server, "ensemble", text_input=PROMPTS[5], max_tokens=8, stream=True,
                            return_log_probs=True)
    log_probs = [lp for r in responses for lp in r["output_log_probs"].reshape(-1).tolist()]
    assert len(log_probs) == 8 and all(lp <= 0.0 for lp in log_probs) and any(lp < 0.0 for lp in log_probs)
    assert float(responses[-1]["cum_log_probs"].reshape(-1)[0]) == pytest.approx(sum(log_probs), abs=1e-3)


def test_num_return_sequences_are_told_apart_by_sequence_index(triton_server):
    """Needs the sampling branch (n sequences, Response.sequence_index)."""
    responses = grpc_stream(triton_server, "ensemble", text_input=PROMPTS[4], max_tokens=6, stream=True,
                            num_return_sequences=2, temperature=1.0, top_k=50, seed=7)
    indices = {int(r["sequence_index"].reshape(-1)[0]) for r in responses}
    assert indices == {0, 1}
    assert sum(1 for reason in reasons(responses) if reason) == 2  # each sequence's last response


def test_apply_chat_template_answers_as_the_instruct_model(triton_server, smollm2_executor):
    question = CAPITAL_QUESTION
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
        return "".join(texts(grpc_stream(triton_server, text_input=prompt, max_tokens=MAX_TOKENS, stream=True)))

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
        responses = grpc_stream(triton_server, text_input=prompt, max_tokens=64, stream=True, end_id=never_end_id,
                                on_response=lambda n: first_token.wait() if n == 1 else None)
        finished_at[prompt] = time.monotonic()
        return "".join(texts(responses))

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


def test_cancelled_grpc_stream_frees_its_blocks(triton_server, smollm2_executor, never_end_id):
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

    prompt_ids = smollm2_executor.tokenizer.encode(PROMPTS[6])
    responses = grpc_stream(triton_server, "tensorrt_llm", input_ids=prompt_ids, input_lengths=len(prompt_ids),
                            request_output_len=1000, streaming=True, end_id=never_end_id, cancel_after=16,
                            on_response=probe)
    assert len(responses) == 16
    assert sample(in_flight, "nv_trt_llm_request_metrics", model=LLM_MODEL, request_type="active") == 1
    assert sample(in_flight, "nv_trt_llm_kv_cache_block_metrics", model=LLM_MODEL, kv_cache_block_type="used") > 0
    wait_for_idle(triton_server)  # well before the 1000 tokens it asked for
    wait_for_cancelled(triton_server, num_cancelled_before + 1)
    status, [answer] = http_generate(triton_server, text_input=PROMPTS[0], max_tokens=4)
    assert status == 200, answer


def test_dropped_http_generate_stream_is_cancelled(triton_server, smollm2_executor, never_end_id):
    import http.client

    wait_for_idle(triton_server)
    num_cancelled_before = triton_server.metric("kilnlm_requests_finished_total", finish_reason="cancelled")
    host, port = triton_server.http_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=STREAM_TIMEOUT_S)
    prompt_ids = smollm2_executor.tokenizer.encode(PROMPTS[7])
    body = {"input_ids": prompt_ids, "input_lengths": len(prompt_ids), "request_output_len": 1000,
            "streaming": True, "end_id": never_end_id}
    connection.request("POST", "/v2/models/tensorrt_llm/generate_stream", body=json.dumps(body))
    reply = connection.getresponse()
    num_events = 0
    while num_events < 4:
        line = reply.fp.readline()
        assert line, "the stream ended early"
        if line.startswith(b"data:"):
            num_events += 1
    connection.sock.shutdown(2)  # the client goes away mid-stream
    connection.close()
    wait_for_idle(triton_server)  # well before the 1000 tokens it asked for
    wait_for_cancelled(triton_server, num_cancelled_before + 1)


@pytest.mark.parametrize("body, message", [
    ({"text_input": "", "max_tokens": 4}, "text_input"),
    ({"text_input": "Hello", "max_tokens": -1}, "max_tokens"),
    ({"text_input": "Hello", "max_tokens": 4, "top_p": 1.5}, "top_p"),
    ({"text_input": "Hello", "max_tokens": 4, "top_k": 5, "temperature": -0.5}, "temperature"),
    ({"text_input": "Hello", "max_tokens": 4, "end_id": 10_000_000}, "end_id"),
    ({"text_input": "Hello", "max_tokens": 4, "num_speculative_tokens": -1}, "num_speculative_tokens is -1"),  # reaches the executor
])
def test_bad_request_gets_an_error_and_the_server_keeps_serving(triton_server, body, message):
    status, [answer] = http_generate(triton_server, **body)
    assert status == 400, answer
    assert message in answer["error"]
    status, [answer] = http_generate(triton_server, text_input=PROMPTS[0], max_tokens=2)
    assert status == 200, answer


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
    streamed = grpc_stream(triton_server, "tensorrt_llm_bls", text_input=prompt, max_tokens=MAX_TOKENS,
                           stream=True, stop_words=[stop])
    assert "".join(texts(streamed)) == expected


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
    assert answer["text_output"] == expected.text


def test_latency_histograms_and_token_counter(triton_server):
    def counts():
        m = triton_server.metrics()
        return {name: sample(m, name, model=LLM_MODEL) for name in (
            "kilnlm_time_to_first_token_seconds_count", "kilnlm_inter_token_latency_seconds_count",
            "kilnlm_queue_time_seconds_count", "kilnlm_e2e_request_latency_seconds_count",
            "nv_llm_input_token_len_count", "kilnlm_generated_tokens_total")}

    before = counts()
    http_generate(triton_server, text_input=PROMPTS[7], max_tokens=4)
    after = counts()
    delta = {name: after[name] - before[name] for name in after}
    # One request: one first token, one queue time, one end-to-end latency and prompt length; it
    # streams its 4 tokens (an end id earlier would leave fewer) with an inter-token latency between them.
    assert delta["kilnlm_time_to_first_token_seconds_count"] == 1
    assert delta["kilnlm_queue_time_seconds_count"] == 1
    assert delta["kilnlm_e2e_request_latency_seconds_count"] == 1
    assert delta["nv_llm_input_token_len_count"] == 1
    assert 1 <= delta["kilnlm_generated_tokens_total"] <= 4
    assert delta["kilnlm_inter_token_latency_seconds_count"] == delta["kilnlm_generated_tokens_total"] - 1
