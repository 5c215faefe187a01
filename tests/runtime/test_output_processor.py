"""OutputProcessor on a character tokenizer (token id i decodes to VOCAB[i]): streamed text, stop strings
across token boundaries with hold-back, "stop" over "length", final responses. The scheduler's update
runs first, as in the executor."""

from __future__ import annotations

from factories import make_request, make_scheduler
from kilnlm.runtime.output_processor import OutputProcessor
from kilnlm.runtime.request import FinishReason, Response

VOCAB = ["<s>", "</s>", "a", "b", "c", " ", "END", "x"]
ID = {text: i for i, text in enumerate(VOCAB)}


class CharTokenizer:
    def decode(self, token_ids, skip_special_tokens=True):
        return "".join(VOCAB[t] for t in token_ids if not (skip_special_tokens and t < 2))


def generate(texts: list[str], max_tokens: int = 16, **sampling) -> list[Response]:
    """Run one request whose steps sample the tokens of ``texts``; the responses until it finishes."""
    scheduler = make_scheduler()
    processor = OutputProcessor(CharTokenizer())
    request = make_request(1, [ID["x"]] * 3, max_tokens=max_tokens, end_ids=frozenset({ID["</s>"]}), **sampling)
    processor.add_request(request)
    scheduler.add(request)
    responses = []
    for text in texts:
        (updated,) = scheduler.update(scheduler.schedule(), [[ID[text]]])
        response = processor.process(updated)
        if response.finished and not request.finished:
            scheduler.finish(request, response.finish_reason)
        responses.append(response)
        if response.finished:
            break
    assert not scheduler.has_work() or not responses[-1].finished
    return responses


def test_each_token_streams_its_text():
    responses = generate(["a", " ", "b", "</s>"])
    assert [(r.token_ids, r.text, r.finished) for r in responses] == [([2], "a", False), ([5], " ", False),
                                                                      ([3], "b", False), ([], "", True)]
    assert responses[-1].finish_reason is FinishReason.END_ID and responses[-1].num_generated_tokens == 3


def test_text_that_may_start_a_stop_string_is_held_back_until_decided():
    responses = generate(["a", "b", "a", "c", "</s>"], stop=("ab", "bc"))
    # "a" could start "ab": held; "ab" is a stop string: cut before it, finish "stop".
    assert [r.text for r in responses] == ["", ""]
    assert responses[-1].finish_reason is FinishReason.STOP and responses[-1].token_ids == [ID["b"]]
    responses = generate(["a", "c", "b", "</s>"], stop=("ab",))
    assert [r.text for r in responses] == ["", "ac", "b", ""]  # "a" released once "c" ruled the stop out


def test_a_stop_string_spanning_tokens_cuts_the_output():
    responses = generate(["c", "END", "a"], stop=("Da",))
    assert "".join(r.text for r in responses) == "cEN"
    assert responses[-1].finish_reason is FinishReason.STOP


def test_stop_takes_precedence_over_length_on_the_same_token():
    responses = generate(["a", "b"], max_tokens=2, stop=("b",))
    assert responses[-1].finish_reason is FinishReason.STOP and "".join(r.text for r in responses) == "a"
    responses = generate(["a", "c"], max_tokens=2, stop=("cc",))
    assert responses[-1].finish_reason is FinishReason.LENGTH
    assert "".join(r.text for r in responses) == "ac"  # the held-back "c" arrives with the final response


def test_final_response_of_a_cancelled_request_carries_the_held_back_text():
    scheduler = make_scheduler()
    processor = OutputProcessor(CharTokenizer())
    request = make_request(1, [ID["x"]], stop=("ab",))
    processor.add_request(request)
    scheduler.add(request)
    (updated,) = scheduler.update(scheduler.schedule(), [[ID["a"]]])
    assert processor.process(updated).text == ""
    scheduler.finish(request, FinishReason.CANCELLED)
    final = processor.final_response(request)
    assert (final.text, final.finished, final.finish_reason, final.token_ids) == ("a", True, FinishReason.CANCELLED, [])
    assert scheduler.kv_cache.num_free_blocks == scheduler.kv_cache.num_total_blocks


def test_log_probs_follow_the_tokens_and_the_end_id_is_left_out():
    from kilnlm.runtime.request import TokenLogprobs

    scheduler = make_scheduler()
    processor = OutputProcessor(CharTokenizer())
    request = make_request(1, [ID["x"]], end_ids=frozenset({ID["</s>"]}), logprobs=1)
    processor.add_request(request)
    scheduler.add(request)
    responses = []
    for text, log_prob in (("a", -0.5), ("b", -1.25), ("</s>", -0.125)):
        request.last_logprobs = TokenLogprobs(log_prob, {ID[text]: log_prob})
        (updated,) = scheduler.update(scheduler.schedule(), [[ID[text]]])
        responses.append(processor.process(updated))
    assert [r.log_probs for r in responses] == [[-0.5], [-1.25], []]
    assert [r.top_logprobs for r in responses] == [[{ID["a"]: -0.5}], [{ID["b"]: -1.25}], []]
    assert [r.cum_log_prob for r in responses] == [-0.5, -1.75, -1.75]
    assert responses[-1].finished and responses[-1].finish_reason is FinishReason.END_ID
