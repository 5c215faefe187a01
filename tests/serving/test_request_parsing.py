"""kilnlm.runtime.serving.request_parsing: a request's named inputs -> GenerateRequest -> the executor's
submit arguments; good inputs, bad inputs and the messages they get. No tritonserver needed."""

from __future__ import annotations

import numpy as np
import pytest

from kilnlm.runtime.errors import RequestError
from kilnlm.runtime.request import SamplingParams
from kilnlm.runtime.serving.request_parsing import (BadRequest, GenerateRequest, json_reader, parse_request,
                                                    prepare_submission)


def tensor_reader(**inputs):
    """Inputs as Triton hands them over: each a numpy array (strings as UTF-8 bytes, dtype object), read
    back flattened to Python values."""

    def array(value) -> np.ndarray:
        values = value if isinstance(value, list) else [value]
        if isinstance(values[0], (str, bytes)):
            return np.array([v.encode() if isinstance(v, str) else v for v in values], dtype=np.object_)
        return np.array(values)

    arrays = {name: array(value) for name, value in inputs.items()}
    return lambda name: arrays[name].reshape(-1).tolist() if name in arrays else None


class FakeTokenizer:
    """encode: one id per character (its code point), plus BOS 1 when add_special_tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [ord(c) for c in text]

    def apply_chat_template(self, messages: list[dict]) -> str:
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)


def test_defaults_when_only_text_input_is_sent():
    request = parse_request(tensor_reader(text_input="Hello"), default_max_tokens=77)
    assert request == GenerateRequest(text="Hello", sampling=SamplingParams(max_tokens=77))
    assert not request.stream and not request.apply_chat_template and not request.exclude_input_in_output


def test_every_input_lands_in_its_field():
    request = parse_request(tensor_reader(
        text_input="Hi", max_tokens=np.int32(5), stream=True, temperature=np.float32(0.5), top_k=np.int32(4),
        top_p=np.float32(0.75), seed=np.uint64(9), end_id=np.int32(2), pad_id=np.int32(0),
        stop_words=["\n", "", "END"], bad_words=["foo", ""], exclude_input_in_output=True,
        apply_chat_template=True), default_max_tokens=128)
    assert request.text == "Hi" and request.stream and request.exclude_input_in_output
    assert request.apply_chat_template
    assert request.sampling == SamplingParams(max_tokens=5, temperature=0.5, top_k=4, top_p=0.75, seed=9,
                                              end_id=2, stop=("\n", "END"))
    assert request.bad_words == ("foo",)  # empty words are dropped
    assert isinstance(request.sampling.max_tokens, int) and isinstance(request.sampling.seed, int)


def test_json_body_reads_like_tensors():
    body = {"text_input": "Hi", "max_tokens": 3, "stop_words": ["x"], "seed": None}
    assert parse_request(json_reader(body), 128) == parse_request(
        tensor_reader(text_input="Hi", max_tokens=np.int32(3), stop_words=["x"]), 128)


@pytest.mark.parametrize("inputs, message", [
    ({}, "'text_input' must be a non-empty UTF-8 string"),
    ({"text_input": ""}, "'text_input' must be a non-empty UTF-8 string"),
    ({"text_input": b"caf\xe9"}, "'text_input' is not valid UTF-8 (unexpected end of data at byte 3)"),
    ({"text_input": ["a", "b"]}, "'text_input' must hold one value, got 2"),
    ({"text_input": "Hi", "max_tokens": [np.int32(1), np.int32(2)]}, "'max_tokens' must hold one value, got 2"),
])
def test_bad_inputs_name_the_input(inputs, message):
    with pytest.raises(BadRequest) as info:
        parse_request(tensor_reader(**inputs), 128)
    assert str(info.value) == message
    assert isinstance(info.value, RequestError)  # fronts answer every RequestError as the client's error


def test_a_non_number_in_a_json_body_is_a_bad_request():
    with pytest.raises(BadRequest, match="'max_tokens' must be an integer, got 'ten'"):
        parse_request(json_reader({"text_input": "Hi", "max_tokens": "ten"}), 128)
    with pytest.raises(BadRequest, match="'top_p' must be a number"):
        parse_request(json_reader({"text_input": "Hi", "top_p": "x"}), 128)


def test_out_of_range_values_parse_and_are_refused_by_validate():
    """Ranges are checked once, in SamplingParams.validate (Executor.submit), with the parameter's name."""
    request = parse_request(json_reader({"text_input": "Hi", "max_tokens": -1, "top_p": 1.5}), 128)
    with pytest.raises(RequestError, match="max_tokens"):
        request.sampling.validate(vocab_size=100)


def test_submission_tokenizes_prompt_and_bad_words():
    tokenizer = FakeTokenizer()
    request = parse_request(json_reader({"text_input": "ab", "bad_words": ["c", "de"], "max_tokens": 4}), 128)
    prompt_ids, params = prepare_submission(request, tokenizer)
    assert prompt_ids == [1, ord("a"), ord("b")]
    assert params == SamplingParams(max_tokens=4, bad_words=((ord("c"),), (ord("d"), ord("e"))))


def test_submission_applies_the_chat_template_without_a_second_bos():
    request = parse_request(json_reader({"text_input": "hi", "apply_chat_template": True}), 128)
    prompt_ids, _ = prepare_submission(request, FakeTokenizer())
    assert prompt_ids == [ord(c) for c in "<user>hi</user>"]
