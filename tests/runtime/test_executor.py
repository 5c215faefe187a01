"""Executor behaviour with a stand-in engine whose logits are a deterministic function of the input ids
(next token = last token + 1): finish reasons, stop strings, streaming, cancellation, errors, accounting.
Generated-text correctness against transformers is in test_executor_engine.py."""

from __future__ import annotations

import threading

import pytest
import torch

from factories import make_manifest, tiny_model_config
from kilnlm.runtime.abi import EngineInputs
from kilnlm.runtime.errors import RequestError
from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.manifest import BuildConfig
from kilnlm.runtime.request import FinishReason, SamplingParams
from kilnlm.runtime.tokenizer import Tokenizer

VOCAB_SIZE = 49152
EOS_ID = 2


class CountingEngine:
    """Engine stand-in: the logits of each sequence put all mass on ``last input id + 1`` (mod vocab);
    ``fail_on`` makes forward raise when that token id is among the inputs."""

    def __init__(self, build: BuildConfig):
        self.manifest = make_manifest(build, tiny_model_config(VOCAB_SIZE), eos_token_ids=(EOS_ID,))
        self.fail_on: int | None = None
        self.num_forwards = 0
        self.max_seen_tokens = 0
        self.num_computed_tokens = 0  # over all forwards

    def kv_cache_bytes_per_block(self) -> int:
        return 64

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(num_blocks)

    def forward(self, inputs: EngineInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        self.num_forwards += 1
        self.max_seen_tokens = max(self.max_seen_tokens, inputs.num_tokens)
        self.num_computed_tokens += inputs.num_tokens
        if self.fail_on is not None and bool((inputs.input_ids == self.fail_on).any()):
            raise RuntimeError("injected engine failure")
        last = inputs.input_ids[inputs.logits_indices]
        logits = torch.zeros(inputs.num_seqs, VOCAB_SIZE)
        logits[torch.arange(inputs.num_seqs), (last + 1) % VOCAB_SIZE] = 10.0
        return logits


@pytest.fixture(scope="module")
def tokenizer(rt_tokenizer_dir) -> Tokenizer:
    return Tokenizer.from_dir(rt_tokenizer_dir)


@pytest.fixture
def make_executor(tokenizer, make_build_config):
    executors = []

    def make(config: ExecutorConfig | None = None, **build_overrides) -> tuple[Executor, CountingEngine]:
        engine = CountingEngine(make_build_config(**build_overrides))
        executor = Executor(engine, tokenizer, config)
        executors.append(executor)
        return executor, engine

    yield make
    for executor in executors:
        executor.shutdown()


def wait_idle(executor: Executor) -> None:
    """Block until the loop has nothing left (all requests finished and accounted)."""
    for _ in range(2000):
        stats = executor.stats()
        if stats.num_active_requests == 0 and stats.num_queued == 0 and not executor._inbox and not executor._cancels:
            return
        threading.Event().wait(0.005)
    raise AssertionError("executor did not become idle")


def test_length_finish_and_token_ids(make_executor, tokenizer):
    executor, _ = make_executor()
    response = executor.generate([100, 101, 102], SamplingParams(max_tokens=5))
    assert response.finished and response.finish_reason is FinishReason.LENGTH
    assert response.token_ids == [103, 104, 105, 106, 107]
    assert response.text == tokenizer.decode([103, 104, 105, 106, 107])
    assert (response.num_prompt_tokens, response.num_generated_tokens) == (3, 5)


def test_end_id_stops_and_is_not_part_of_the_output(make_executor):
    executor, _ = make_executor()
    response = executor.generate([EOS_ID - 2], SamplingParams(max_tokens=10))  # generates EOS_ID - 1, then EOS
    assert response.finish_reason is FinishReason.END_ID and response.token_ids == [EOS_ID - 1]
    assert response.num_generated_tokens == 1
    response = executor.generate([EOS_ID - 2], SamplingParams(max_tokens=5, ignore_eos=True))
    assert response.finish_reason is FinishReason.LENGTH and EOS_ID in response.token_ids
    response = executor.generate([500], SamplingParams(max_tokens=10, end_id=503))
    assert response.finish_reason is FinishReason.END_ID and response.token_ids == [501, 502]


def test_stop_string_truncates_output(make_executor, tokenizer):
    executor, _ = make_executor()
    prompt = [1000]
    full = tokenizer.decode(list(range(1001, 1011)))
    stop = full[len(tokenizer.decode(list(range(1001, 1005)))) :][:3]  # starts inside the 5th token's text
    expected = full[: full.find(stop)]
    response = executor.generate(prompt, SamplingParams(max_tokens=10, stop=[stop, "never-appears"]))
    assert response.finish_reason is FinishReason.STOP
    assert response.text == expected
    # streamed deltas never contain any part of the stop string
    request_id = executor.submit(prompt, SamplingParams(max_tokens=10, stop=[stop]))
    deltas = [r.text for r in executor.stream(request_id, timeout_s=30)]
    assert "".join(deltas) == expected


def test_streaming_yields_one_response_per_token(make_executor, tokenizer):
    executor, _ = make_executor()
    request_id = executor.submit([300], SamplingParams(max_tokens=4))
    responses = list(executor.stream(request_id, timeout_s=30))
    assert [r.token_ids for r in responses] == [[301], [302], [303], [304]]
    assert [r.finished for r in responses] == [False, False, False, True]
    assert "".join(r.text for r in responses) == tokenizer.decode([301, 302, 303, 304])
    with pytest.raises(RequestError):
        next(executor.stream(request_id))  # already consumed


def test_chunked_context_and_in_flight_batching_respect_limits(make_executor):
    executor, engine = make_executor(max_batch_size=3, max_num_tokens=16, max_seq_len=128)
    prompts = [list(range(10 * i + 5, 10 * i + 5 + n)) for i, n in enumerate([40, 3, 17, 9, 1, 25])]
    ids = [executor.submit(p, SamplingParams(max_tokens=6 + i)) for i, p in enumerate(prompts)]
    results = {rid: [t for r in executor.stream(rid, timeout_s=60) for t in r.token_ids] for rid in ids}
    for i, (rid, prompt) in enumerate(zip(ids, prompts)):
        assert results[rid] == [prompt[-1] + 1 + j for j in range(6 + i)]
    assert engine.max_seen_tokens <= 16
    wait_idle(executor)
    stats = executor.stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_cancel_returns_blocks(make_executor):
    executor, _ = make_executor(max_seq_len=4096)
    request_id = executor.submit([10, 11], SamplingParams(max_tokens=4000, ignore_eos=True))
    stream = executor.stream(request_id, timeout_s=30)
    next(stream)
    executor.cancel(request_id)
    last = list(stream)[-1]
    assert last.finished and last.finish_reason is FinishReason.CANCELLED
    wait_idle(executor)
    stats = executor.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    executor.cancel(request_id)  # no-op


def test_engine_failure_fails_the_batch_and_the_loop_keeps_serving(make_executor):
    executor, engine = make_executor()
    engine.fail_on = 777
    response = executor.generate([776, 777], SamplingParams(max_tokens=3))
    assert response.finish_reason is FinishReason.ERROR and "injected engine failure" in response.error
    engine.fail_on = None
    assert executor.generate([50], SamplingParams(max_tokens=2)).token_ids == [51, 52]
    wait_idle(executor)
    assert executor.stats().num_free_blocks == executor.stats().num_total_blocks


def test_preemption_under_a_small_pool_still_completes_everything(make_executor):
    # 8 blocks of 4 tokens = 32 tokens for 3 requests that each grow to 20 tokens.
    executor, _ = make_executor(ExecutorConfig(kv_cache_bytes=8 * 64), max_batch_size=3, max_num_tokens=16, max_seq_len=64)
    prompts = [[100 * (i + 1) + j for j in range(8)] for i in range(3)]
    ids = [executor.submit(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    for rid, prompt in zip(ids, prompts):
        tokens = [t for r in executor.stream(rid, timeout_s=60) for t in r.token_ids]
        assert tokens == [prompt[-1] + 1 + j for j in range(12)]
    wait_idle(executor)
    stats = executor.stats()
    assert stats.num_preemptions > 0 and stats.num_free_blocks == stats.num_total_blocks


def test_submit_from_many_threads(make_executor):
    executor, _ = make_executor(max_batch_size=4, max_num_tokens=32)
    results: dict[int, list[int]] = {}

    def client(i: int) -> None:
        results[i] = executor.generate([1000 * i + 7], SamplingParams(max_tokens=3), timeout_s=60).token_ids

    threads = [threading.Thread(target=client, args=(i,)) for i in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: [1000 * i + 8, 1000 * i + 9, 1000 * i + 10] for i in range(1, 9)}


@pytest.mark.parametrize(
    "prompt, params, match",
    [
        ([], SamplingParams(), "empty"),
        (list(range(128)), SamplingParams(), "max_seq_len"),
        ([VOCAB_SIZE], SamplingParams(), "vocabulary"),
        ([1], SamplingParams(temperature=-1), "temperature"),
    ],
)
def test_submit_rejects_bad_requests(make_executor, prompt, params, match):
    executor, _ = make_executor()
    with pytest.raises(RequestError, match=match):
        executor.submit(prompt, params)


def test_request_larger_than_the_pool_is_rejected(make_executor):
    executor, _ = make_executor(ExecutorConfig(kv_cache_bytes=4 * 64))  # 16 tokens
    with pytest.raises(RequestError, match="kv_cache_bytes"):
        executor.submit(list(range(10)), SamplingParams(max_tokens=10))


def test_shutdown_cancels_outstanding_requests(make_executor):
    executor, _ = make_executor(max_seq_len=4096)
    request_id = executor.submit([5], SamplingParams(max_tokens=4000, ignore_eos=True))
    stream = executor.stream(request_id, timeout_s=30)
    next(stream)
    executor.shutdown()
    assert list(stream)[-1].finish_reason is FinishReason.CANCELLED
    with pytest.raises(RequestError, match="shut down"):
        executor.submit([5])


def test_failure_in_one_request_fails_only_that_request(tokenizer, make_build_config):
    class FaultyTokenizer(Tokenizer):
        """Raises when asked to decode token 905 (request A reaches it; request B never does)."""

        def decode(self, token_ids, skip_special_tokens=True):
            if 905 in token_ids:
                raise ValueError("injected decode failure")
            return super().decode(token_ids, skip_special_tokens)

    faulty = FaultyTokenizer(tokenizer.backend, tokenizer.config, tokenizer.chat_template)
    with Executor(CountingEngine(make_build_config()), faulty) as executor:
        a = executor.submit([900], SamplingParams(max_tokens=10))
        b = executor.submit([100], SamplingParams(max_tokens=10))
        a_last = list(executor.stream(a, timeout_s=30))[-1]
        b_tokens = [t for r in executor.stream(b, timeout_s=30) for t in r.token_ids]
        stats = executor.stats()
    assert a_last.finish_reason is FinishReason.ERROR and "injected decode failure" in a_last.error
    assert b_tokens == list(range(101, 111))
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("enable_kv_cache_reuse", [True, False])
def test_prefix_caching_skips_computing_cached_prompt_blocks(make_executor, enable_kv_cache_reuse):
    executor, engine = make_executor(ExecutorConfig(enable_kv_cache_reuse=enable_kv_cache_reuse), tokens_per_block=4)
    prompt = list(range(1000, 1042))  # 42 tokens: 10 full blocks of 4
    executor.generate(prompt, SamplingParams(max_tokens=3))
    assert engine.num_computed_tokens == 42 + 2  # the context, then 2 generation steps
    second = executor.generate(prompt[:40] + [7, 8, 9], SamplingParams(max_tokens=3))
    assert second.token_ids == [10, 11, 12]
    # With caching only the tokens after the 10 shared blocks are computed (43 - 40 = 3).
    assert engine.num_computed_tokens - 44 == (3 if enable_kv_cache_reuse else 43) + 2


# ------------------------------------------------------------------------ log-probs and n sequences
def test_log_probs_reach_the_responses_without_the_end_id(make_executor):
    executor, _ = make_executor()
    # The counting engine's logits are 10.0 on (last id + 1) and 0.0 elsewhere.
    top = 10.0 - torch.logaddexp(torch.tensor(10.0), torch.tensor(float(VOCAB_SIZE - 1)).log()).item()
    rest = top - 10.0
    request_id = executor.submit([500], SamplingParams(max_tokens=10, end_id=503, logprobs=2))
    responses = list(executor.stream(request_id, timeout_s=30))
    assert [r.token_ids for r in responses] == [[501], [502], []]  # then 503 ends it: in no list
    assert [len(r.log_probs) for r in responses] == [1, 1, 0]
    for response, token in zip(responses, (501, 502)):
        assert response.log_probs[0] == pytest.approx(top, abs=1e-5)
        (first, first_lp), (_, second_lp) = response.top_logprobs[0].items()
        assert first == token and first_lp == pytest.approx(top, abs=1e-5) and second_lp == pytest.approx(rest, abs=1e-5)
    assert [r.cum_log_prob for r in responses] == pytest.approx([top, 2 * top, 2 * top], abs=1e-5)
    whole = executor.generate([500], SamplingParams(max_tokens=10, end_id=503, logprobs=0))
    assert whole.log_probs == pytest.approx([top, top], abs=1e-5) and whole.top_logprobs == [{}, {}]
    plain = executor.generate([500], SamplingParams(max_tokens=3))
    assert (plain.log_probs, plain.top_logprobs, plain.cum_log_prob) == ([], [], None)


@pytest.mark.parametrize("enable_kv_cache_reuse", [True, False])
def test_n_sequences_compute_the_prompt_once(make_executor, enable_kv_cache_reuse):
    executor, engine = make_executor(ExecutorConfig(enable_kv_cache_reuse=enable_kv_cache_reuse), tokens_per_block=4)
    prompt = list(range(2000, 2010))  # 10 tokens: 2 full blocks of 4 and a partial one
    params = SamplingParams(n=3, max_tokens=4, temperature=1.0, seed=7, ignore_eos=True)
    responses = executor.generate_all(prompt, params, timeout_s=60)
    assert [r.sequence_index for r in responses] == [0, 1, 2]
    assert len({r.request_id for r in responses}) == 1
    assert all(r.finish_reason is FinishReason.LENGTH and len(r.token_ids) == 4 for r in responses)
    assert len({tuple(r.token_ids) for r in responses}) == 3  # distinct samples
    # Sequence 0: the 10-token context, then 3 generation steps. Sequences 1 and 2 join once its prompt's 2
    # full blocks are cached and compute only the last 2 prompt tokens (with reuse), then 3 steps each.
    assert engine.num_computed_tokens == (10 + 3) + 2 * ((2 if enable_kv_cache_reuse else 10) + 3)
    wait_idle(executor)
    stats = executor.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    # Seeded: the same k sequences again; sequence 0 is what n=1 with that seed gives.
    assert [r.token_ids for r in executor.generate_all(prompt, params)] == [r.token_ids for r in responses]
    assert executor.generate(prompt, SamplingParams(max_tokens=4, temperature=1.0, seed=7, ignore_eos=True)).token_ids == responses[0].token_ids
    with pytest.raises(RequestError, match="generate_all"):
        executor.generate(prompt, params)


@pytest.mark.parametrize("cancel_after_first_response", [True, False])
def test_stream_of_n_sequences_ends_after_all_and_cancel_cancels_all(make_executor, cancel_after_first_response):
    # A 40-token prompt computed in chunks of 8: cancelled at once, sequences 1 and 2 are likely still held
    # back waiting for sequence 0's prompt blocks; after the first response they run.
    executor, _ = make_executor(max_seq_len=4096, max_num_tokens=8)
    request_id = executor.submit(list(range(10, 50)), SamplingParams(n=3, max_tokens=4000, ignore_eos=True, temperature=1.0))
    stream = executor.stream(request_id, timeout_s=30)
    responses = [next(stream)] if cancel_after_first_response else []
    executor.cancel(request_id)
    responses += list(stream)
    finals = [r for r in responses if r.finished]
    assert sorted(r.sequence_index for r in finals) == [0, 1, 2] and responses[-1].finished
    assert all(r.finish_reason is FinishReason.CANCELLED for r in finals)
    wait_idle(executor)
    stats = executor.stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    with pytest.raises(RequestError):
        next(executor.stream(request_id))


def test_each_sequence_has_one_final_response_and_nothing_after_it(make_executor):
    executor, _ = make_executor()
    request_id = executor.submit([500], SamplingParams(n=4, max_tokens=6, temperature=1.0, seed=3, logprobs=1))
    per_sequence: dict[int, list] = {i: [] for i in range(4)}
    for response in executor.stream(request_id, timeout_s=30):
        assert not any(r.finished for r in per_sequence[response.sequence_index])
        per_sequence[response.sequence_index].append(response)
    for responses in per_sequence.values():
        assert responses[-1].finished
        assert responses[-1].cum_log_prob == pytest.approx(sum(p for r in responses for p in r.log_probs), abs=1e-4)
