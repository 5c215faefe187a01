"""Speculative decoding (:mod:`kilnlm.runtime.speculative`): the config, the n-gram proposer, greedy
verification, the KV slots of rejected drafts, and the executor's outputs, which must be exactly those of
non-speculative decoding."""

from __future__ import annotations

import copy
import json

import pytest

from factories import make_kv_cache_manager

from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.request import SamplingParams
from kilnlm.runtime.speculative import (DraftModelProposer, NgramProposer, Proposer, SpeculativeConfig,
                                        parse_speculative_config, verify_greedy)
from kilnlm.runtime.tokenizer import Tokenizer

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


def test_the_config_takes_vllms_json():
    assert parse_speculative_config(NGRAM) == SpeculativeConfig("ngram", 4, 3, 1)
    assert parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2}) == \
        SpeculativeConfig("ngram", 2, 3, 2)
    assert parse_speculative_config(None) is None and parse_speculative_config("  ") is None
    assert parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 8}') == \
        SpeculativeConfig("ngram", 2, disable_by_batch_size=8)
    assert parse_speculative_config('{"method": "draft", "model": "engines/int4", "num_speculative_tokens": 3}') == \
        SpeculativeConfig("draft", 3, model="engines/int4")
    assert parse_speculative_config({"method": "draft", "model": "d", "num_speculative_tokens": 3, "draft_p_min": 0.75}) == \
        SpeculativeConfig("draft", 3, model="d", draft_p_min=0.75)
    assert parse_speculative_config({"method": "draft", "model": "d", "num_speculative_tokens": 3, "draft_p_min": 1}).draft_p_min == 1.0


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"),
    ("[1]", "JSON object"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method is 'eagle'"),
    ('{"method": "ngram"}', "needs num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens is 0"),
    ('{"method": "ngram", "num_speculative_tokens": true}', "num_speculative_tokens is True"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "unknown fields \\['model'\\]"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4}', "prompt_lookup_min 4 exceeds"),
    ('{"method": "draft", "num_speculative_tokens": 2}', "needs model"),
    ('{"method": "draft", "num_speculative_tokens": 2, "model": 3}', "model is 3"),
    ('{"method": "draft", "num_speculative_tokens": 2, "model": "x", "prompt_lookup_max": 2}', "unknown fields"),
    ('{"method": "draft", "num_speculative_tokens": 2, "model": "x", "draft_p_min": 0}', "draft_p_min is 0: it must be a probability"),
    ('{"method": "draft", "num_speculative_tokens": 2, "model": "x", "draft_p_min": 1.5}', "draft_p_min is 1.5"),
    ('{"method": "draft", "num_speculative_tokens": 2, "model": "x", "draft_p_min": "0.5"}', "draft_p_min is '0.5'"),
    ('{"method": "draft", "num_speculative_tokens": 2, "model": "x", "draft_p_min": true}', "draft_p_min is True"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_p_min": 0.5}', "unknown fields \\['draft_p_min'\\]"),
])
def test_a_bad_config_is_refused_naming_the_field(text, message):
    with pytest.raises(KilnError, match=message):
        parse_speculative_config(text)


def test_ngram_proposes_what_followed_the_most_recent_longest_match():
    proposer = NgramProposer(SpeculativeConfig("ngram", 3, prompt_lookup_max=3, prompt_lookup_min=1))
    #        0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 6, 7]
    assert proposer.lookup(tokens, 3) == [2, 3, 6]  # "6 7" last seen at 6-7 (3-gram "x 6 7" unmatched)
    assert proposer.lookup(tokens, 1) == [2]  # capped by the caller's limit
    assert proposer.lookup([5, 6, 7, 8, 9, 5, 6, 7], 4) == [8, 9, 5]  # 3-gram "5 6 7", k = 3
    assert proposer.lookup([1, 2, 3, 4], 3) == []  # nothing repeats
    assert proposer.lookup([4, 4], 3) == [4]  # a match near the end proposes what there is
    assert NgramProposer(SpeculativeConfig("ngram", 3, 3, 2)).lookup([1, 2, 3, 9, 3], 3) == []  # only 1-grams match


def test_greedy_verification_accepts_up_to_the_first_disagreement():
    assert verify_greedy(7, [7, 8, 9], [8, 1, 4]) == [7, 8, 1]  # drafts 7, 8 accepted; 1 replaces 9
    assert verify_greedy(7, [7, 8, 9], [8, 9, 4]) == [7, 8, 9, 4]  # all accepted, plus the bonus token
    assert verify_greedy(5, [7, 8], [8, 9]) == [5]  # the first draft rejected


def test_trimming_releases_the_rejected_drafts_blocks_and_never_a_cached_one():
    kv = make_kv_cache_manager(num_blocks=8, tokens_per_block=4, enable_kv_cache_reuse=True)
    assert kv.allocate(1, list(range(6))) == 0
    assert kv.append_slots(1, 6 + 5)  # 5 draft slots: blocks for 11 tokens
    assert len(kv.block_table(1)) == 3 and kv.num_free_blocks == 5
    kv.trim_slots(1, 7)  # one draft accepted: the pending token is the 7th
    assert len(kv.block_table(1)) == 2 and kv.num_free_blocks == 6
    kv.cache_computed_blocks(1, list(range(8)), 8)
    with pytest.raises(ValueError, match="cached blocks"):
        kv.trim_slots(1, 4)


# ---- the executor: speculative outputs are the non-speculative ones --------------------------------------
@pytest.fixture(scope="module")
def tokenizer(rt_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(rt_tokenizer_dir)


def run_together(executor, requests: list[tuple[list[int], SamplingParams]]) -> list[tuple]:
    """Submit every request at once; each one's (token ids, text, finish reason) from its merged stream."""
    ids = [executor.submit(prompt, params) for prompt, params in requests]
    results = []
    for rid in ids:
        responses = list(executor.stream(rid, timeout_s=300))
        results.append(([t for r in responses for t in r.token_ids], "".join(r.text for r in responses),
                         responses[-1].finish_reason, responses[-1].num_generated_tokens))
    return results


def run_with_proposer(engine, tokenizer, requests: list[tuple[list[int], SamplingParams]], proposer=None):
    """:func:`run_together` on a fresh executor over ``engine``: without speculation, or speculating with
    ``proposer`` (in place of the executor's own). Returns the results and the executor's stats after them."""
    config = ExecutorConfig() if proposer is None else ExecutorConfig(speculative_config=NGRAM)
    with Executor(engine, tokenizer, config) as executor:
        if proposer is not None:
            executor.scheduler.proposer = proposer
        return run_together(executor, requests), executor.stats()


def mixed_requests(tokenizer) -> list[tuple[list[int], SamplingParams]]:
    """Greedy requests (speculating: to max_tokens, to EOS, to stop strings), a sampling one (speculating too:
    the same distribution, not the same tokens) and requests that do not speculate (a repetition penalty,
    log-probabilities)."""
    prompts = [tokenizer.encode(p) for p in ("1, 2, 3, 1, 2, 3, 1, 2,", "The capital of France is", "def f(x): return f(x",
                                             "a b a b a b", "Hi", "Once upon a time, once upon a")]
    return [
        (prompts[0], SamplingParams(max_tokens=40, ignore_eos=True)),
        (prompts[1], SamplingParams(max_tokens=33)),
        (prompts[2], SamplingParams(max_tokens=30, ignore_eos=True, stop=(", ", "))"))),
        (prompts[3], SamplingParams(max_tokens=17, ignore_eos=True)),
        (prompts[4], SamplingParams(max_tokens=20, temperature=0.8, seed=7)),
        (prompts[5], SamplingParams(max_tokens=25, repetition_penalty=1.3)),
        (prompts[0], SamplingParams(max_tokens=12, logprobs=2)),
    ]


@pytest.mark.parametrize("enable_kv_cache_reuse", [True, False])
def test_speculating_requests_in_flight_produce_the_non_speculative_outputs(make_eager_engine, tokenizer,
                                                                              enable_kv_cache_reuse):
    """A batch mixing speculating and plain requests (small blocks, so drafts cross block boundaries, and a
    small token budget, so drafts compete with contexts): every request's tokens, text, finish reason and
    token count equal those without speculation; drafts were proposed and some accepted; every block is
    back in the pool at the end."""
    engine = make_eager_engine(max_batch_size=4, max_num_tokens=24, max_seq_len=96, tokens_per_block=4)
    requests = mixed_requests(tokenizer)
    with Executor(engine, tokenizer, ExecutorConfig(enable_kv_cache_reuse=enable_kv_cache_reuse)) as executor:
        expected = run_together(executor, requests)
    config = ExecutorConfig(enable_kv_cache_reuse=enable_kv_cache_reuse, speculative_config=NGRAM)
    with Executor(engine, tokenizer, config) as executor:
        actual = run_together(executor, requests)
        stats = executor.stats()
    sampled = [i for i, (_, params) in enumerate(requests) if not params.greedy]
    assert [r for i, r in enumerate(actual) if i not in sampled] == [r for i, r in enumerate(expected) if i not in sampled]
    for i in sampled:  # its own draw: as many tokens, the same way to end
        assert actual[i][2:] == expected[i][2:] and len(actual[i][0]) == len(expected[i][0])
    assert stats.total_draft_tokens > 0 and 0 < stats.total_accepted_draft_tokens <= stats.total_draft_tokens
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_draft_model_in_flight_keeps_the_non_speculative_outputs(make_eager_engine, tokenizer):
    """The ``draft`` proposer over the tiny Llama itself (every greedy draft accepted; the sampling request's
    drafts mostly rejected, its distribution being nearly flat) and over a copy with perturbed weights (more
    drafts rejected: its pool keeps only what each request still has), both with other limits than the
    target's (8-token catch-up forwards, 8-token blocks): the mixed in-flight batch gives the non-speculative
    outputs, the requests of a step draft in shared forwards, and every draft-pool block is back when the
    requests are done."""
    import dataclasses

    import torch

    target = make_eager_engine(max_batch_size=4, max_num_tokens=24, max_seq_len=96, tokens_per_block=4)
    same = make_eager_engine(max_batch_size=4, max_num_tokens=8, max_seq_len=96, tokens_per_block=8)
    network = copy.deepcopy(same.network)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in network.buffers():
            if weight.dim() == 2 and weight.is_floating_point():
                weight.add_(torch.randn(weight.shape, generator=generator) * 0.1 * weight.std())
    perturbed = dataclasses.replace(same, network=network)
    requests = mixed_requests(tokenizer)
    sampled = [i for i, (_, params) in enumerate(requests) if not params.greedy]
    expected, _ = run_with_proposer(target, tokenizer, requests)
    acceptance = []
    for draft in (same, perturbed):
        batch_sizes = []
        forward = draft.forward

        def counting_forward(inputs, kv_cache, forward=forward):
            batch_sizes.append(inputs.num_seqs)
            return forward(inputs, kv_cache)

        draft.forward = counting_forward
        proposer = DraftModelProposer(SpeculativeConfig("draft", 3, model="(in memory)"), draft,
                                      target.manifest.model.vocab_size)
        actual, stats = run_with_proposer(target, tokenizer, requests, proposer)
        assert [r for i, r in enumerate(actual) if i not in sampled] == [r for i, r in enumerate(expected) if i not in sampled]
        for i in sampled:
            assert actual[i][2:] == expected[i][2:] and len(actual[i][0]) == len(expected[i][0])
        assert stats.total_draft_tokens > 100 and 0 < stats.total_accepted_draft_tokens < stats.total_draft_tokens
        acceptance.append(stats.total_accepted_draft_tokens / stats.total_draft_tokens)
        assert max(batch_sizes) > 1  # the step's requests draft together
        assert not proposer.sequences and len(proposer.free_blocks) == 4 * 12
        assert stats.num_free_blocks == stats.num_total_blocks
    assert acceptance[0] > 0.5 and acceptance[1] < acceptance[0] - 0.2, acceptance


def test_the_draft_pool_keeps_only_what_the_request_still_has(make_eager_engine, tokenizer):
    """After a draft whose second token the target rejected, the next proposal equals a fresh proposer's on
    the same tokens (the rejected token's K/V is not attended to), and release gives every block back."""
    from types import SimpleNamespace

    engine = make_eager_engine(max_batch_size=2, max_num_tokens=8, max_seq_len=96, tokens_per_block=4)
    config, vocab_size = SpeculativeConfig("draft", 3, model="(in memory)"), engine.manifest.model.vocab_size
    proposer = DraftModelProposer(config, engine, vocab_size)
    prompt = tokenizer.encode("The capital of France is Paris, and the capital of Spain is")
    first = proposer.propose(SimpleNamespace(request_id="a", token_ids=prompt), 3)
    assert len(first) == 3
    rejected = (first[1] + 1) % vocab_size  # the target accepted first[0], then chose another token
    tokens = [*prompt, first[0], rejected]
    again = proposer.propose(SimpleNamespace(request_id="a", token_ids=tokens), 3)
    assert proposer.sequences["a"].token_ids == [*tokens, *again[:-1]]
    assert again == DraftModelProposer(config, engine, vocab_size).propose(SimpleNamespace(request_id="b", token_ids=tokens), 3)
    proposer.release("a")
    assert not proposer.sequences and sorted(proposer.free_blocks) == list(range(2 * 24))
    # the pool holds no more sequences than the target runs at once
    assert len(DraftModelProposer(config, engine, vocab_size, max_batch_size=1).free_blocks) == 24


def test_draft_p_min_stops_drafting_after_a_token_below_it(make_eager_engine, tokenizer):
    """draft_p_min (llama.cpp's --draft-p-min): a sequence drafts no further after a token its draft model
    gave a probability below it, and that token is still proposed; at every threshold between the drafted
    tokens' probabilities the drafts are the full proposal's first tokens up to the first one below it. In
    flight, greedy outputs stay the non-speculative ones."""
    from types import SimpleNamespace

    engine = make_eager_engine(max_batch_size=2, max_num_tokens=8, max_seq_len=96, tokens_per_block=4)
    vocab_size = engine.manifest.model.vocab_size

    def proposer(p_min):
        return DraftModelProposer(SpeculativeConfig("draft", 4, model="(in memory)", draft_p_min=p_min), engine, vocab_size)

    request = SimpleNamespace(request_id="a", token_ids=tokenizer.encode("The capital of France is Paris, and the"))
    # a threshold below every probability drafts as none does, and has the probabilities computed
    unlimited, probabilities = proposer(1e-30), []
    forward_all = unlimited._forward_all
    unlimited._forward_all = lambda parts: [probabilities.append(out[2]) or out for out in forward_all(parts)]
    full = unlimited.propose(request, 4)
    assert full == proposer(None).propose(request, 4)
    probabilities = probabilities[-4:]  # the drafts' (the prompt's catch-up takes more than one forward)
    assert len(full) == 4 and all(0 < p < 1 for p in probabilities)
    for p_min in sorted(set(probabilities)) + [max(probabilities) * 1.01, 1.0]:
        below = [i for i, p in enumerate(probabilities) if p < p_min]
        assert proposer(p_min).propose(request, 4) == full[:below[0] + 1 if below else 4], p_min
    requests = [r for r in mixed_requests(tokenizer) if r[1].greedy]
    expected, _ = run_with_proposer(engine, tokenizer, requests)
    median = sorted(probabilities)[len(probabilities) // 2]
    actual, stats = run_with_proposer(engine, tokenizer, requests, proposer(median))
    assert actual == expected and stats.total_draft_tokens > 0


def test_a_failing_draft_model_costs_drafts_not_requests(make_eager_engine, tokenizer):
    """A draft engine whose forward raises: every request still gets its non-speculative tokens."""
    import dataclasses

    import torch

    class Broken(torch.nn.Module):
        def forward(self, *args):
            raise RuntimeError("draft engine broke")

    engine = make_eager_engine(max_batch_size=4, max_num_tokens=24, max_seq_len=96, tokens_per_block=4)
    requests = [r for r in mixed_requests(tokenizer) if r[1].greedy][:3]
    expected, _ = run_with_proposer(engine, tokenizer, requests)
    broken = DraftModelProposer(SpeculativeConfig("draft", 3, model="(in memory)"),
                                dataclasses.replace(engine, network=Broken()), engine.manifest.model.vocab_size)
    actual, stats = run_with_proposer(engine, tokenizer, requests, broken)
    assert actual == expected and stats.total_draft_tokens == 0


def test_a_draft_model_of_another_vocabulary_or_a_missing_one_is_refused(make_eager_engine, tokenizer, tmp_path):
    engine = make_eager_engine()
    with pytest.raises(KilnError, match="vocabulary of 49,152 tokens, the target's 49,153"):
        DraftModelProposer(SpeculativeConfig("draft", 2, model="x"), engine, 49_153)
    missing = f'{{"method": "draft", "num_speculative_tokens": 2, "model": "{tmp_path / "none"}"}}'
    with pytest.raises(KilnError, match="speculative_config's draft model: .*none"):
        Executor(engine, tokenizer, ExecutorConfig(speculative_config=missing))


class _FixedProposer(Proposer):
    """Proposes, for the output position a step starts at, the given tokens from that position on (as many as
    the scheduler allows)."""

    config = SpeculativeConfig("ngram", 4)

    def __init__(self, num_prompt_tokens: int, draft_token_ids: list[int]):
        self.num_prompt_tokens, self.draft_token_ids = num_prompt_tokens, draft_token_ids

    def propose(self, request, max_tokens: int) -> list[int]:
        position = len(request.token_ids) - self.num_prompt_tokens  # the output position the first draft fills
        return self.draft_token_ids[position : position + max_tokens]


def test_speculative_sampling_keeps_the_target_distribution(make_eager_engine, tokenizer):
    """Seeded sampling (temperature 1, top-k 2), 600 requests of 4 tokens each without speculation and with
    drafts that propose each position's most frequent token: the distribution of every generated position
    after the first (the first comes from the context step, which has no drafts) is the same under a
    chi-square test of homogeneity (p > 0.001), while over 1,000 drafts were verified and both accepted and
    rejected often. The test has the power to see the rule broken (measured): redrawing from the full
    distribution after a rejection gives p = 1e-11, accepting every draft fails too."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    engine = make_eager_engine(max_batch_size=16, max_num_tokens=128, max_seq_len=64, tokens_per_block=4)
    prompt = tokenizer.encode("The weather today is")
    num_requests, num_tokens = 600, 4

    def outputs(executor) -> list[tuple[int, ...]]:
        ids = [executor.submit(prompt, SamplingParams(max_tokens=num_tokens, temperature=1.0, top_k=2, seed=seed,
                                                      ignore_eos=True)) for seed in range(num_requests)]
        return [tuple(t for r in executor.stream(i, timeout_s=300) for t in r.token_ids) for i in ids]

    with Executor(engine, tokenizer) as executor:
        expected = outputs(executor)
    drafts = [Counter(out[position] for out in expected).most_common(1)[0][0] for position in range(num_tokens)]
    with Executor(engine, tokenizer, ExecutorConfig(speculative_config=NGRAM)) as executor:
        executor.scheduler.proposer = _FixedProposer(len(prompt), drafts)
        actual = outputs(executor)
        stats = executor.stats()
    assert stats.total_draft_tokens > 1000 and 0.1 < stats.total_accepted_draft_tokens / stats.total_draft_tokens < 0.9, stats
    for position in range(1, num_tokens):
        counts = [Counter(out[position] for out in run) for run in (expected, actual)]
        tokens = sorted(set(counts[0]) | set(counts[1]))
        table = [[c[t] for t in tokens] for c in counts]
        assert chi2_contingency(table).pvalue > 1e-3, (position, table)


class _RecordingProposer(Proposer):
    """Proposes token 0 as many times as allowed and records, per prompt (its first token), each allowance."""

    def __init__(self, config: SpeculativeConfig = SpeculativeConfig("ngram", 4)):
        self.config = config
        self.allowances: dict[int, list[int]] = {}
        self.generated_at_call: dict[int, list[int]] = {}

    def propose(self, request, max_tokens: int) -> list[int]:
        self.allowances.setdefault(request.token_ids[0], []).append(max_tokens)
        self.generated_at_call.setdefault(request.token_ids[0], []).append(request.num_generated_tokens)
        return [0] * max_tokens


def test_a_request_turns_speculation_off_or_drafts_fewer_tokens(make_eager_engine, tokenizer):
    """``num_speculative_tokens`` 0 never reaches the proposer, 2 caps every allowance at 2, None leaves the
    scheduler's; each request's greedy tokens stay those without speculation; -1 is refused."""
    engine = make_eager_engine(max_batch_size=4, max_num_tokens=64, max_seq_len=96, tokens_per_block=4)
    prompts = [[first, *tokenizer.encode(" the cat sat on the mat")] for first in (10, 11, 12)]
    requests = [(prompt, SamplingParams(max_tokens=12, ignore_eos=True, num_speculative_tokens=cap))
                for prompt, cap in zip(prompts, [0, 2, None])]
    expected, _ = run_with_proposer(engine, tokenizer, requests)
    proposer = _RecordingProposer()
    assert run_with_proposer(engine, tokenizer, requests, proposer)[0] == expected
    assert 10 not in proposer.allowances
    assert proposer.allowances[11] and max(proposer.allowances[11]) == 2
    assert max(proposer.allowances[12]) > 2
    with pytest.raises(KilnError, match="num_speculative_tokens is -1"):
        SamplingParams(num_speculative_tokens=-1).validate(vocab_size=100)


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(make_eager_engine, tokenizer):
    """vLLM's ``disable_by_batch_size`` 2 with three requests running: no proposals until the shortest one
    finished, then proposals for the other two; outputs unchanged."""
    engine = make_eager_engine(max_batch_size=4, max_num_tokens=64, max_seq_len=96, tokens_per_block=4)
    prompts = [[first, *tokenizer.encode(" the cat sat on the mat")] for first in (10, 11, 12)]
    requests = [(prompt, SamplingParams(max_tokens=n, ignore_eos=True)) for prompt, n in zip(prompts, [4, 14, 14])]
    expected, _ = run_with_proposer(engine, tokenizer, requests)
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 2}')
    proposer = _RecordingProposer(config)
    assert run_with_proposer(engine, tokenizer, requests, proposer)[0] == expected
    assert 10 not in proposer.generated_at_call  # it ran only beside two others
    assert min(proposer.generated_at_call[11]) >= 4 and min(proposer.generated_at_call[12]) >= 4


def test_a_bad_speculative_config_is_refused_at_start(make_eager_engine, tokenizer):
    with pytest.raises(KilnError, match="method is 'medusa'"):
        Executor(make_eager_engine(), tokenizer, ExecutorConfig(speculative_config='{"method": "medusa"}'))


# Input-grounded prompts (the output copies spans of the prompt, where prompt lookup proposes well) and free ones.
SMOLLM2_PROMPTS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "Copy the list: apples, oranges, pears, plums, cherries, grapes, lemons, limes, peaches.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "The capital of France is",
    "Write a short poem about the sea.",
]


@pytest.mark.parametrize("qformat, method", [("fp32", "ngram"), ("bf16", "ngram"), ("bf16", "draft")])
def test_smollm2_greedy_outputs_are_unchanged_by_speculation(qformat, method, smollm2_format_engine, tokenizer):
    """SmolLM2's compiled engines, five greedy chat prompts submitted together with a sampling request and a
    penalised one (which does not speculate): each greedy completion equals the non-speculative one, token
    for token, and drafts were accepted. Proposers: n-gram, and SmolLM2's int4_awq engine drafting for its
    bf16 engine (a self-draft)."""
    engine_dir = smollm2_format_engine(qformat)
    speculative = NGRAM if method == "ngram" else json.dumps(
        {"method": "draft", "model": str(smollm2_format_engine("int4_awq")), "num_speculative_tokens": 3})
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True),
                                add_special_tokens=False) for p in SMOLLM2_PROMPTS]
    requests = [(ids, SamplingParams(max_tokens=48)) for ids in prompts]
    requests += [(prompts[0], SamplingParams(max_tokens=16, temperature=0.7, seed=3, ignore_eos=True)),
                 (prompts[3], SamplingParams(max_tokens=16, presence_penalty=0.5))]
    results = {}
    for speculative_config in (None, speculative):
        config = ExecutorConfig(max_batch_size=8, speculative_config=speculative_config)
        with Executor.from_engine_dir(engine_dir, config, trusted_keys=None) as executor:
            results[speculative_config] = run_together(executor, requests)
            stats = executor.stats()
    assert results[speculative][:5] == results[None][:5] and results[speculative][6] == results[None][6]
    assert len(results[speculative][5][0]) == 16
    assert stats.total_accepted_draft_tokens > 0 and stats.num_free_blocks == stats.num_total_blocks
