"""TensorRT-LLM's model set served with ``decoupled_mode`` false (``launch_triton.py --decoupled-mode
false``): HTTP ``/infer`` with ``[1, 1]``-shaped tensors on ``ensemble``, ``tensorrt_llm_bls`` and
``tensorrt_llm``, as TensorRT-LLM's end-to-end clients send them, answered once per request; what needs several
responses (streaming, num_return_sequences) is refused naming the input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as httpclient
from servers import running_tritonserver
from tritonclient.utils import InferenceServerException

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

PROMPT = "The capital of France is"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def infer_server(smollm2_engine_fp32_dir, tmp_path_factory):
    with running_tritonserver(tmp_path_factory.mktemp("triton_infer"), engine_dir=Path(smollm2_engine_fp32_dir),
                              decoupled_mode=False) as server:
        yield server


def infer(server, model: str, **values):
    """One HTTP /infer: each value a ``[1, 1]`` tensor (a list: ``[1, N]``)."""
    inputs = []
    for name, value in values.items():
        array = np.array([value if isinstance(value, list) else [value]])
        if array.dtype.kind == "U":
            array = array.astype(np.object_)
        dtype = {"O": "BYTES", "b": "BOOL", "i": "INT32"}[array.dtype.kind]
        tensor = httpclient.InferInput(name, list(array.shape), dtype)
        tensor.set_data_from_numpy(array.astype(np.int32) if dtype == "INT32" else array)
        inputs.append(tensor)
    client = httpclient.InferenceServerClient(server.http_url.removeprefix("http://"))
    return client.infer(model, inputs)


def test_text_models_answer_infer_with_the_executors_greedy_text(infer_server, smollm2_executor):
    from kilnlm.runtime.request import SamplingParams

    expected = smollm2_executor.generate(smollm2_executor.tokenizer.encode(PROMPT),
                                         SamplingParams(max_tokens=MAX_TOKENS), timeout_s=120)
    for model in ("ensemble", "tensorrt_llm_bls"):
        result = infer(infer_server, model, text_input=PROMPT, max_tokens=MAX_TOKENS, bad_words="", stop_words="")
        assert result.as_numpy("text_output").tolist() == [[(PROMPT + expected.text).encode()]], model
        assert result.as_numpy("num_output_tokens").tolist() == [[len(expected.token_ids)]]


def test_tensorrt_llm_answers_infer_with_token_ids(infer_server, smollm2_executor):
    from kilnlm.runtime.request import SamplingParams

    prompt_ids = smollm2_executor.tokenizer.encode(PROMPT)
    expected = smollm2_executor.generate(prompt_ids, SamplingParams(max_tokens=MAX_TOKENS), timeout_s=120)
    result = infer(infer_server, "tensorrt_llm", input_ids=prompt_ids, input_lengths=len(prompt_ids),
                   request_output_len=MAX_TOKENS, exclude_input_in_output=True)
    assert result.as_numpy("output_ids").tolist() == [[expected.token_ids]]


@pytest.mark.parametrize("model, name, value", [
    ("ensemble", "stream", True), ("tensorrt_llm_bls", "stream", True), ("ensemble", "num_return_sequences", 2)])
def test_several_responses_are_refused_naming_the_input(infer_server, model, name, value):
    tensor_name = {"stream": "streaming"}.get(name, name)
    with pytest.raises(InferenceServerException, match=f"'{tensor_name}' needs several responses"):
        infer(infer_server, model, text_input=PROMPT, max_tokens=4, **{name: value})
