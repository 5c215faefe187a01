"""Sampler: greedy, temperature / top-k / top-p against the renormalised softmax, per-request seeds
independent of batch composition, bad words."""

from __future__ import annotations

import pytest
import torch

import factories
from kilnlm.runtime.errors import RequestError
from kilnlm.runtime.request import Request, SamplingParams
from kilnlm.runtime.sampler import Sampler


def make_request(request_id: int = 1, token_ids=(5, 6, 7), **params) -> Request:
    return factories.make_request(request_id, list(token_ids), **params)


def draw_counts(logits_row: torch.Tensor, num_draws: int, **params) -> torch.Tensor:
    sampler = Sampler()
    request = make_request(seed=1234, **params)
    counts = torch.zeros(logits_row.shape[0])
    for _ in range(num_draws):
        counts[sampler.sample(logits_row.unsqueeze(0), [request]).token_ids[0]] += 1
    return counts / num_draws


def test_greedy_is_argmax_per_row():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    requests = [make_request(i) for i in range(3)]
    assert Sampler().sample(logits, requests).token_ids == logits.argmax(-1).tolist()
    tied = torch.zeros(2, 50)
    tied[0, [7, 3, 40]] = 1.0
    tied[1, [45, 44]] = 2.0
    assert Sampler().sample(tied, requests[:2]).token_ids == [3, 44]  # the first of equal maxima, as torch.argmax


def test_seeded_sampling_is_independent_of_batch_composition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=g)
    alone = Sampler().sample(logits[2:3], [make_request(9, temperature=1.0, seed=42)]).token_ids
    batch = [make_request(1), make_request(2, temperature=0.7, seed=1), make_request(9, temperature=1.0, seed=42),
             make_request(3, temperature=1.3, top_k=5)]
    together = Sampler().sample(logits, batch).token_ids
    assert together[2] == alone[0]
    assert together[0] == int(logits[0].argmax())  # the greedy row of a mixed batch
    # the whole sequence of draws repeats with the same seed, and differs with another one
    r = make_request(temperature=1.0, seed=7)
    seq_b = [Sampler().sample(logits[1:2], [r]).token_ids[0] for _ in range(10)]
    r = make_request(temperature=1.0, seed=7)
    seq_c = [Sampler().sample(logits[1:2], [r]).token_ids[0] for _ in range(10)]
    r = make_request(temperature=1.0, seed=8)
    seq_d = [Sampler().sample(logits[1:2], [r]).token_ids[0] for _ in range(10)]
    assert seq_b == seq_c != seq_d


def test_temperature_sampling_matches_softmax():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    freq = draw_counts(logits, 4000, temperature=0.8)
    expected = (logits / 0.8).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_keeps_only_k_largest_renormalised():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    freq = draw_counts(logits, 4000, temperature=1.0, top_k=2)
    expected = torch.zeros(5)
    expected[:2] = logits[:2].softmax(-1)
    assert freq[2:].sum() == 0
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_p_keeps_smallest_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    freq = draw_counts(logits, 4000, temperature=1.0, top_p=0.7)  # 0.5 < 0.7 <= 0.8: tokens 0 and 1
    assert freq[2:].sum() == 0
    assert torch.allclose(freq[:2], torch.tensor([0.5, 0.3]) / 0.8, atol=0.03)


def test_top_k_one_is_greedy_at_any_temperature():
    logits = torch.randn(2, 300, generator=torch.Generator().manual_seed(3))
    requests = [make_request(1, temperature=5.0, top_k=1), make_request(2, temperature=5.0, top_p=1e-6)]
    assert Sampler().sample(logits, requests).token_ids == logits.argmax(-1).tolist()


def test_bad_words_ban_tokens_and_continuations():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    logits[:, 4] = 4.0
    # Row 0 bans token 3 outright; row 1 bans 3 only after [6, 7] -- its tokens end with 6, 7.
    requests = [make_request(1, token_ids=(1, 2), bad_words=[[3]]), make_request(2, token_ids=(5, 6, 7), bad_words=[[6, 7, 3], [9, 4]])]
    assert Sampler().sample(logits, requests).token_ids == [4, 4]
    assert logits[0, 3] == 5.0  # the caller's logits are untouched


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(max_tokens=0), dict(end_id=10**6), dict(stop=[""]), dict(bad_words=[[]]),
                                 dict(stop=["s"] * 65), dict(stop=["s" * 1025])])
def test_invalid_params_are_request_errors(bad):
    with pytest.raises(RequestError):
        SamplingParams(**bad).validate(vocab_size=1000)


# ------------------------------------------------------------------- penalties, min_tokens, log-probs
def reference_penalised(logits: torch.Tensor, requests) -> torch.Tensor:
    return factories.reference_penalised(logits, [r.token_ids for r in requests], [r.num_prompt_tokens for r in requests],
                                         [r.params for r in requests])


def with_generated(request: Request, generated) -> Request:
    request.token_ids += list(generated)
    return request


PENALTY_ROWS = [
    dict(),  # no penalty: untouched
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),  # < 1 rewards repetition
    dict(presence_penalty=0.8),
    dict(frequency_penalty=0.5),
    dict(repetition_penalty=1.3, presence_penalty=-0.4, frequency_penalty=1.1),
]


def penalty_batch():
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(len(PENALTY_ROWS), 40, generator=g) * 3
    # prompt (3, 5, 5, 9, 17); row i generated 2 + i tokens of [5, 21, 21, 21, 3, 30] (repeats, prompt overlap)
    requests = [with_generated(make_request(i, token_ids=(3, 5, 5, 9, 17), **params), [5, 21, 21, 21, 3, 30][: 2 + i])
                for i, params in enumerate(PENALTY_ROWS)]
    return logits, requests


def test_penalties_match_a_loop_reference_and_drive_greedy_rows():
    logits, requests = penalty_batch()
    expected = reference_penalised(logits, requests)
    processed = Sampler().process_logits(logits, requests)
    assert torch.allclose(processed, expected, atol=1e-6, rtol=0)
    assert not torch.equal(processed[1:], logits[1:])  # every penalised row changed
    assert Sampler().sample(logits, requests).token_ids == expected.argmax(-1).tolist()
    assert torch.equal(logits, penalty_batch()[0])  # the caller's logits are untouched


def test_sampled_rows_draw_from_the_penalised_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, -0.5, -1.0]])
    params = dict(temperature=0.9, repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.2)
    request = with_generated(make_request(token_ids=(0, 4), seed=99, **params), [1, 1, 5])
    expected = (reference_penalised(logits, [request]) / 0.9).softmax(-1)[0]
    sampler = Sampler()
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[sampler.sample(logits, [request]).token_ids[0]] += 1
    assert torch.allclose(counts / 4000, expected, atol=0.03)


def test_min_tokens_bans_the_end_ids_until_reached():
    logits = torch.zeros(3, 10)
    logits[:, 2] = 5.0  # the end id is the most likely token
    logits[:, 7] = 4.0
    end_ids = frozenset({2, 3})
    requests = [factories.make_request(1, [4, 4], end_ids=end_ids, min_tokens=2),  # 0 generated: banned
                with_generated(factories.make_request(2, [4, 4], end_ids=end_ids, min_tokens=2), [6]),  # 1: banned
                with_generated(factories.make_request(3, [4, 4], end_ids=end_ids, min_tokens=2), [6, 6])]  # 2: free
    reference = logits.clone()
    for row, request in enumerate(requests):
        if request.num_generated_tokens < request.params.min_tokens:
            for end_id in request.end_ids:
                reference[row, end_id] = float("-inf")
    assert torch.equal(Sampler().process_logits(logits, requests), reference)
    assert Sampler().sample(logits, requests).token_ids == [7, 7, 2]


def test_logprobs_are_of_the_raw_logits_for_rows_that_ask():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(3, 50, generator=g)
    requests = [make_request(1, logprobs=3, repetition_penalty=2.0, temperature=0.7, seed=1),
                make_request(2), make_request(3, logprobs=0)]
    out = Sampler().sample(logits, requests)
    assert out.logprobs[1] is None
    raw = logits.log_softmax(-1)
    for row in (0, 2):
        entry = out.logprobs[row]
        assert entry.log_prob == pytest.approx(float(raw[row, out.token_ids[row]]), abs=1e-6)
    values, ids = raw[0].topk(3)
    assert list(out.logprobs[0].top_logprobs) == ids.tolist()
    assert list(out.logprobs[0].top_logprobs.values()) == pytest.approx(values.tolist(), abs=1e-6)
    assert out.logprobs[2].top_logprobs == {}


def test_sequence_seeds_are_distinct_and_deterministic():
    from kilnlm.runtime.request import sequence_seed

    seeds = [sequence_seed(42, i) for i in range(8)]
    assert seeds[0] == 42 and len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [sequence_seed(42, i) for i in range(8)]
    assert sequence_seed(43, 1) != seeds[1]
