"""Property-based fuzzing (hypothesis) of the Triton front: a real tritonserver serving TensorRT-LLM's model
set on the tiny compiled engine, sent (1) generate-extension JSON of random fields and values to
``ensemble``, ``tensorrt_llm_bls`` and ``tensorrt_llm``, and (2) gRPC tensors of wrong dtype, shape or
emptiness to ``tensorrt_llm``. Every request gets a reply or an error naming what is wrong (HTTP 400 with
Triton's ``{"error": ...}``, or a gRPC error; tritonserver's own JSON-to-tensor conversion answers 500
before any model runs), never a crash; after each, the server is ready and every KV
block is free. Derandomized, with a fixed example budget."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from servers import is_ready, running_tritonserver

pytestmark = [pytest.mark.triton]

grpcclient = pytest.importorskip("tritonclient.grpc", reason="the serve extra installs tritonclient")
from tritonclient.utils import InferenceServerException, np_to_triton_dtype  # noqa: E402

LLM_MODEL = "tensorrt_llm"
FUZZ = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])
TEXT_FIELDS = ["text_input", "max_tokens", "stream", "temperature", "top_k", "top_p", "seed", "end_id", "pad_id",
               "stop_words", "bad_words", "exclude_input_in_output", "return_log_probs", "num_return_sequences",
               "beam_width", "apply_chat_template", "repetition_penalty", "presence_penalty", "frequency_penalty",
               "min_tokens", "lora_task_id"]
LLM_FIELDS = ["input_ids", "input_lengths", "request_output_len", "end_id", "pad_id", "stop_words_list",
              "bad_words_list", "runtime_top_k", "runtime_top_p", "temperature", "seed", "streaming",
              "num_return_sequences", "beam_width", "exclude_input_in_output", "return_log_probs", "min_tokens",
              "guided_decoding_guide_type", "guided_decoding_guide", "embedding_bias", "stop"]
HOSTILE = [-1, 0, 1, 2**31 - 1, 2**31, 2**63, -(2**63), 10**30, 1e308, -1e308, 1e-320, 0.5, "", "nan", "inf"]
leaf = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from(HOSTILE)
        | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=16))
value = st.recursive(leaf, lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=3),
                     max_leaves=10)
TRITON_JSON_ERRORS = ("Unable to parse ", "parameter key ")  # its messages for JSON it cannot convert
# Mostly scalars Triton can convert to the inputs' tensor types, so that most cases reach kilnlm's models.
scalar = (st.integers(min_value=-(2**40), max_value=2**40) | st.sampled_from(HOSTILE) | st.booleans()
          | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=40))
DTYPES = [np.int32, np.int64, np.float32, np.float16, np.bool_, np.uint64, np.object_]


@pytest.fixture(scope="module")
def server(tiny_engine_dir, tmp_path_factory):
    with running_tritonserver(tmp_path_factory.mktemp("triton_fuzz"), engine_dir=tiny_engine_dir,
                              decoupled_mode=False) as running:  # unary gRPC infer, one reply per request
        yield running


def wait_idle(server, sent) -> None:
    """The server is ready, and within 30 s no request is active or queued and every KV block is free."""
    deadline = time.monotonic() + 30
    while not (server.is_idle(LLM_MODEL) and is_ready(server.http_url)):
        assert time.monotonic() < deadline, f"not idle: {server.llm_load(LLM_MODEL)}; {sent}"
        time.sleep(0.05)


def generate(server, model: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{server.http_url}/v2/models/{model}/generate", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("model,base", [
    ("ensemble", {"text_input": "The kiln", "max_tokens": 4}),
    ("tensorrt_llm_bls", {"text_input": "The kiln", "max_tokens": 4}),
    ("tensorrt_llm", {"input_ids": [1, 2, 3], "input_lengths": 3, "request_output_len": 4}),
])
@FUZZ
@given(changes=st.dictionaries(st.sampled_from(TEXT_FIELDS + LLM_FIELDS) | st.text(max_size=10),
                               scalar | scalar | scalar | st.lists(scalar, max_size=6) | value, max_size=4),
       drop=st.sets(st.sampled_from(["text_input", "max_tokens", "input_ids", "input_lengths", "request_output_len"])))
@example(changes={"num_return_sequences": 100_000}, drop=set())
@example(changes={"stop_words": ["s"] * 5000}, drop=set())
@example(changes={"input_ids": [], "input_lengths": 0}, drop=set())
@example(changes={"input_ids": [10**9], "text_input": "\udcff"}, drop=set())
def test_generate_json_gets_a_reply_or_a_named_error(server, model, base, changes, drop):
    body = json.dumps({k: v for k, v in base.items() if k not in drop} | changes).encode()
    status, reply = generate(server, model, body)
    event(f"HTTP {status}")
    if status != 200:
        error = json.loads(reply)["error"]
        # tritonserver's own HTTP frontend answers 500 when a JSON value cannot become the input's tensor
        # type, before any model runs; every error of kilnlm's models is a 400.
        assert status == 400 or (status == 500 and error.startswith(TRITON_JSON_ERRORS)), (status, reply[:400], body[:400])
    wait_idle(server, body[:400])


@FUZZ
@given(name=st.sampled_from(["input_ids", "input_lengths", "request_output_len", "temperature", "runtime_top_k",
                             "stop_words_list", "seed", "streaming", "embedding_bias"]),
       dtype=st.sampled_from(DTYPES), shape=st.lists(st.integers(0, 3), min_size=0, max_size=3))
def test_grpc_tensors_of_wrong_dtype_or_shape_are_refused_by_name(server, name, dtype, shape):
    values = {"input_ids": np.array([[1, 2, 3]], np.int32), "input_lengths": np.array([[3]], np.int32),
              "request_output_len": np.array([[2]], np.int32)}
    values[name] = (np.full(shape, "x", dtype=object) if dtype is np.object_ else np.ones(shape, dtype=dtype))
    client = grpcclient.InferenceServerClient(server.grpc_address)
    inputs = []
    for input_name, array in values.items():
        tensor = grpcclient.InferInput(input_name, list(array.shape), np_to_triton_dtype(array.dtype))
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    try:
        client.infer(LLM_MODEL, inputs, timeout=120)
        event("accepted")
    except InferenceServerException as exc:
        event("refused")
        assert exc.message(), exc
    finally:
        client.close()
    wait_idle(server, f"{name} {dtype.__name__} {shape}")
