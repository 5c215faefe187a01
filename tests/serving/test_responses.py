"""kilnlm.runtime.serving.responses: the executor's responses of one request -> the replies its client gets
-> output tensors. No tritonserver needed."""

from __future__ import annotations

import numpy as np

from kilnlm.runtime.request import FinishReason, Response
from kilnlm.runtime.serving.request_parsing import GenerateRequest
from kilnlm.runtime.serving.responses import OUTPUT_NAMES, Reply, ResponseShaper, output_arrays


def response(text: str, token_ids: list[int], finish_reason: FinishReason | None = None,
             error: str | None = None) -> Response:
    return Response(request_id=7, token_ids=token_ids, text=text, finished=finish_reason is not None,
                    finish_reason=finish_reason, num_prompt_tokens=3, num_generated_tokens=len(token_ids),
                    error=error)


def test_streamed_request_gets_each_piece_then_the_finish_reason():
    shaper = ResponseShaper(GenerateRequest(text="Q:", stream=True))
    assert shaper.add(response(" Pa", [10])) == Reply(" Pa", (10,))
    assert shaper.add(response("", [])) is None  # nothing new: no reply
    assert shaper.add(response("", [11])) == Reply("", (11,))  # a token whose text is held back
    assert shaper.add(response("ris", [12], FinishReason.LENGTH)) == \
        Reply("ris", (12,), "length", final=True)


def test_non_streamed_request_gets_one_reply_with_the_prompt_first():
    shaper = ResponseShaper(GenerateRequest(text="Q:"))
    assert shaper.add(response(" Pa", [10])) is None
    assert shaper.add(response("ris", [11])) is None
    assert shaper.add(response(".", [12], FinishReason.END_ID)) == \
        Reply("Q: Paris.", (10, 11, 12), "end_id", final=True)


def test_exclude_input_in_output_leaves_the_prompt_out():
    shaper = ResponseShaper(GenerateRequest(text="Q:", exclude_input_in_output=True))
    shaper.add(response(" Pa", [10]))
    assert shaper.add(response("ris", [11], FinishReason.STOP)) == Reply(" Paris", (10, 11), "stop", final=True)


def test_an_executor_failure_is_a_final_error_reply():
    shaper = ResponseShaper(GenerateRequest(text="Q:", stream=True))
    reply = shaper.add(response("", [], FinishReason.ERROR, error="engine forward failed"))
    assert reply.final and reply.finish_reason == "error"
    assert reply.error == "kilnlm executor error: engine forward failed"


def test_output_arrays_names_dtypes_and_shapes():
    arrays = output_arrays(Reply("Paris é", (10, 11), "stop", final=True))
    assert tuple(arrays) == OUTPUT_NAMES
    assert arrays["text_output"].dtype == np.object_ and arrays["text_output"].tolist() == ["Paris é".encode()]
    assert arrays["output_ids"].dtype == np.int32 and arrays["output_ids"].tolist() == [10, 11]
    assert arrays["sequence_length"].dtype == np.int32 and arrays["sequence_length"].tolist() == [2]
    assert arrays["finish_reason"].tolist() == [b"stop"]
    empty = output_arrays(Reply("", ()))
    assert empty["output_ids"].shape == (0,) and empty["sequence_length"].tolist() == [0]
    assert empty["finish_reason"].tolist() == [b""]
