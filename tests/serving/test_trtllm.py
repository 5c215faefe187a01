"""kilnlm.runtime.serving.trtllm: TensorRT-LLM's tensor conventions (words lists, preprocessing,
postprocessing, the tensorrt_llm model's inputs and outputs) with the real SmolLM2 tokenizer of the tiny
engine; no tritonserver."""

from __future__ import annotations

import numpy as np
import pytest

from kilnlm.runtime.request import FinishReason, Response
from kilnlm.runtime.serving import trtllm


@pytest.fixture(scope="module")
def tokenizer(tiny_engine_dir):
    from kilnlm.runtime.tokenizer import Tokenizer

    return Tokenizer.from_dir(tiny_engine_dir / "tokenizer")


def reader(**tensors):
    return lambda name: tensors.get(name)


def test_words_list_round_trips_in_tensorrt_llms_offsets_format():
    array = trtllm.encode_words_list([[9, 4], [7]])
    assert array.tolist() == [[9, 4, 7], [2, 3, -1]]
    assert array.dtype == np.int32
    assert trtllm.decode_words_list(array) == [[9, 4], [7]]
    assert trtllm.encode_words_list([]).tolist() == [[0], [-1]]
    assert trtllm.decode_words_list(np.array([[0], [-1]])) == []
    with pytest.raises(trtllm.BadRequest, match="offsets"):
        trtllm.decode_words_list(np.array([[1, 2], [3, -1]]))


def test_preprocess_tokenizes_query_words_and_defaults_end_id(tokenizer):
    out = trtllm.preprocess(reader(
        QUERY=np.array([[b"Hello world"]], dtype=object), REQUEST_OUTPUT_LEN=np.array([[8]], dtype=np.int32),
        STOP_WORDS_DICT=np.array([[b" world", b""]], dtype=object), BAD_WORDS_DICT=np.array([[b""]], dtype=object)),
        tokenizer)
    ids = tokenizer.encode("Hello world")
    assert out["INPUT_ID"].tolist() == [ids] and out["REQUEST_INPUT_LEN"].tolist() == [[len(ids)]]
    world = tokenizer.encode(" world", add_special_tokens=False)
    assert out["STOP_WORDS_IDS"].tolist() == [trtllm.encode_words_list([world]).tolist()]
    assert out["BAD_WORDS_IDS"].tolist() == [[[0], [-1]]]  # the documented curl's "bad_words": ""
    assert out["OUT_END_ID"].tolist() == [[tokenizer.eos_token_id]] == out["OUT_PAD_ID"].tolist()
    assert out["REQUEST_OUTPUT_LEN"].tolist() == [[8]]
    with pytest.raises(trtllm.BadRequest, match="text_input"):
        trtllm.preprocess(reader(QUERY=np.array([[b""]], dtype=object),
                                 REQUEST_OUTPUT_LEN=np.array([[8]], dtype=np.int32)), tokenizer)


def test_postprocess_decodes_ids_or_passes_the_executors_text(tokenizer):
    ids = tokenizer.encode("Paris is", add_special_tokens=False)
    tokens = np.array([[ids + [0, 0]]], dtype=np.int32)
    out = trtllm.postprocess(reader(TOKENS_BATCH=tokens, SEQUENCE_LENGTH=np.array([[len(ids)]], dtype=np.int32)),
                             tokenizer)
    assert out["OUTPUT"].tolist() == [[b"Paris is"]]
    text = np.array([[" caf\u00e9".encode()]], dtype=object)
    assert trtllm.postprocess(reader(TOKENS_BATCH=tokens, SEQUENCE_LENGTH=np.array([[1]]), OUTPUT_TEXT=text),
                              tokenizer)["OUTPUT"].tolist() == [[" caf\u00e9".encode()]]


def llm_inputs(**extra):
    return dict(input_ids=np.array([[5, 6, 7]], dtype=np.int32), input_lengths=np.array([[3]], dtype=np.int32),
                request_output_len=np.array([[4]], dtype=np.int32), **extra)


def test_parse_llm_request_maps_tensorrt_llm_inputs_to_sampling_params(tokenizer):
    stop = tokenizer.encode(" Paris", add_special_tokens=False)
    request = trtllm.parse_llm_request(reader(**llm_inputs(
        runtime_top_k=np.array([[40]]), runtime_top_p=np.array([[0.9]], dtype=np.float32),
        temperature=np.array([[0.7]], dtype=np.float32), repetition_penalty=np.array([[1.2]], dtype=np.float32),
        presence_penalty=np.array([[0.5]], dtype=np.float32), frequency_penalty=np.array([[0.25]], dtype=np.float32),
        min_tokens=np.array([[2]]), seed=np.array([[11]], dtype=np.uint64), return_log_probs=np.array([[True]]),
        streaming=np.array([[True]]), num_return_sequences=np.array([[2]]), beam_width=np.array([[1]]),
        stop_words_list=trtllm.encode_words_list([stop])[None], end_id=np.array([[3]]),
        guided_decoding_guide_type=np.array([[b"json"]], dtype=object),
        num_speculative_tokens=np.array([[0]], dtype=np.int32))), tokenizer)
    s = request.sampling
    assert request.prompt_ids == [5, 6, 7] and request.streaming
    assert (s.max_tokens, s.top_k, s.seed, s.min_tokens, s.n, s.logprobs, s.end_id) == (4, 40, 11, 2, 2, 0, 3)
    assert s.num_speculative_tokens == 0
    assert s.top_p == pytest.approx(0.9) and s.temperature == pytest.approx(0.7)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == pytest.approx((1.2, 0.5, 0.25))
    assert s.stop == (" Paris",) and s.guided_decoding.guide_type == "json"


def test_tensorrt_llm_default_sampling_is_greedy(tokenizer):
    plain = trtllm.parse_llm_request(reader(**llm_inputs(temperature=np.array([[0.8]], dtype=np.float32))),
                                     tokenizer).sampling
    assert plain.greedy and plain.top_p == 1.0
    top1 = trtllm.parse_llm_request(reader(**llm_inputs(runtime_top_k=np.array([[1]]))), tokenizer).sampling
    assert top1.greedy
    out_of_range = trtllm.parse_llm_request(reader(**llm_inputs(runtime_top_p=np.array([[1.5]], dtype=np.float32))),
                                            tokenizer).sampling
    with pytest.raises(Exception, match="top_p"):  # refused by SamplingParams.validate, not silently "off"
        out_of_range.validate(vocab_size=100)


@pytest.mark.parametrize("name, value", [
    ("beam_width", np.array([[2]], dtype=np.int32)),
    ("lora_task_id", np.array([[3]], dtype=np.uint64)),
    ("lora_weights", np.zeros((1, 2, 4), dtype=np.float16)),
    ("return_generation_logits", np.array([[True]])),
])
def test_inputs_kilnlm_cannot_honour_are_refused_by_name(tokenizer, name, value):
    with pytest.raises(trtllm.BadRequest, match=name):
        trtllm.parse_llm_request(reader(**llm_inputs(**{name: value})), tokenizer)


def test_a_batch_of_prompts_is_refused(tokenizer):
    with pytest.raises(trtllm.BadRequest, match="one request per prompt"):
        trtllm.parse_llm_request(reader(**{**llm_inputs(), "input_ids": np.zeros((2, 3), dtype=np.int32)}),
                                 tokenizer)


def response(ids, text, finished=False, seq=0, log_probs=(), cum=None):
    return Response(1, list(ids), text, finished, FinishReason.LENGTH if finished else None, 3, len(ids),
                    sequence_index=seq, log_probs=list(log_probs), cum_log_prob=cum)


def test_shaper_non_streamed_sequences_each_end_with_their_ids_and_the_last_is_final(tokenizer):
    request = trtllm.parse_llm_request(reader(**llm_inputs(num_return_sequences=np.array([[2]]))), tokenizer)
    shaper = trtllm.LLMShaper(request, "PROMPT")
    assert shaper.add(response([8], " a", seq=0)) is None
    first = shaper.add(response([9], " b", finished=True, seq=0, log_probs=[-0.5], cum=-1.5))
    assert not first.final and first.finish_reason == "length"
    assert first.outputs["output_ids"].tolist() == [[[5, 6, 7, 8, 9]]]
    assert first.outputs["sequence_length"].tolist() == [[5]]
    assert first.outputs["output_text"].tolist() == [[b"PROMPT a b"]]
    assert first.outputs["cum_log_probs"].tolist() == [[-1.5]]
    assert first.outputs["output_log_probs"].shape == (1, 1, 2)
    assert first.outputs["num_input_tokens"].tolist() == [[3]] and first.outputs["num_output_tokens"].tolist() == [[2]]
    last = shaper.add(response([4], " c", finished=True, seq=1))
    assert last.final and last.outputs["sequence_index"].tolist() == [[1]]


def test_shaper_streams_new_ids_and_text(tokenizer):
    request = trtllm.parse_llm_request(reader(**llm_inputs(streaming=np.array([[True]]))), tokenizer)
    shaper = trtllm.LLMShaper(request, "")
    piece = shaper.add(response([8], " caf"))
    assert piece.outputs["output_ids"].tolist() == [[[8]]] and piece.outputs["output_text"].tolist() == [[b" caf"]]
    assert not piece.final
    assert shaper.add(response([9], "\u00e9", finished=True)).final


def test_protocol_keeps_the_engines_end_ids_for_an_eos_end_id(tokenizer):
    protocol = trtllm.LLMProtocol(frozenset({2, 0}))
    _, params, _ = protocol.prepare(reader(**llm_inputs(end_id=np.array([[2]]))), tokenizer)
    assert params.end_id is None
    _, params, _ = protocol.prepare(reader(**llm_inputs(end_id=np.array([[7]]))), tokenizer)
    assert params.end_id == 7


def test_a_model_served_without_decoupled_mode_refuses_several_responses(tokenizer):
    """Not decoupled, tensorrt_llm answers each request exactly once: streaming and num_return_sequences > 1
    are refused naming the input; a plain request passes."""
    protocol = trtllm.LLMProtocol(frozenset({2}), decoupled=False)
    with pytest.raises(trtllm.BadRequest, match="'streaming' needs several responses.*decoupled_mode true"):
        protocol.prepare(reader(**llm_inputs(streaming=np.array([[True]]))), tokenizer)
    with pytest.raises(trtllm.BadRequest, match="'num_return_sequences' needs several responses"):
        protocol.prepare(reader(**llm_inputs(num_return_sequences=np.array([[2]]))), tokenizer)
    prompt_ids, params, _ = protocol.prepare(reader(**llm_inputs()), tokenizer)
    assert prompt_ids and params.n == 1
    decoupled = trtllm.LLMProtocol(frozenset({2}))
    assert decoupled.prepare(reader(**llm_inputs(num_return_sequences=np.array([[2]]))), tokenizer)[1].n == 2
