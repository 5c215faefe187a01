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
        counts[sampler.sample(logits_row.unsqueeze(0), [request])[0]] += 1
    return counts / num_draws


def test_greedy_is_argmax_per_row():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    requests = [make_request(i) for i in range(3)]
    assert Sampler().sample(logits, requests) == logits.argmax(-1).tolist()
    tied = torch.zeros(2, 50)
    tied[0, [7, 3, 40]] = 1.0
    tied[1, [45, 44]] = 2.0
    assert Sampler().sample(tied, requests[:2]) == [3, 44]  # the first of equal maxima, as torch.argmax


def test_seeded_sampling_is_independent_of_batch_composition():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 1000, generator=g)
    alone = Sampler().sample(logits[2:3], [make_request(9, temperature=1.0, seed=42)])
    batch = [make_request(1), make_request(2, temperature=0.7, seed=1), make_request(9, temperature=1.0, seed=42),
             make_request(3, temperature=1.3, top_k=5)]
    together = Sampler().sample(logits, batch)
    assert together[2] == alone[0]
    assert together[0] == int(logits[0].argmax())  # the greedy row of a mixed batch
    # the whole sequence of draws repeats with the same seed, and differs with another one
    r = make_request(temperature=1.0, seed=7)
    seq_b = [Sampler().sample(logits[1:2], [r])[0] for _ in range(10)]
    r = make_request(temperature=1.0, seed=7)
    seq_c = [Sampler().sample(logits[1:2], [r])[0] for _ in range(10)]
    r = make_request(temperature=1.0, seed=8)
    seq_d = [Sampler().sample(logits[1:2], [r])[0] for _ in range(10)]
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
    assert Sampler().sample(logits, requests) == logits.argmax(-1).tolist()


def test_bad_words_ban_tokens_and_continuations():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 5.0
    logits[:, 4] = 4.0
    # Row 0 bans token 3 outright; row 1 bans 3 only after [6, 7] -- its tokens end with 6, 7.
    requests = [make_request(1, token_ids=(1, 2), bad_words=[[3]]), make_request(2, token_ids=(5, 6, 7), bad_words=[[6, 7, 3], [9, 4]])]
    assert Sampler().sample(logits, requests) == [4, 4]
    assert logits[0, 3] == 5.0  # the caller's logits are untouched


@pytest.mark.parametrize("bad", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-1),
                                 dict(max_tokens=0), dict(end_id=10**6), dict(stop=[""]), dict(bad_words=[[]])])
def test_invalid_params_are_request_errors(bad):
    with pytest.raises(RequestError):
        SamplingParams(**bad).validate(vocab_size=1000)
