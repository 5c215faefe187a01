"""Executor behaviour with a stand-in engine whose logits are a deterministic function of the input ids
(next token = last token + 1): finish reasons, stop strings, streaming, cancellation, errors, accounting.
Generated-text correctness against transformers is in test_executor_engine.py."""

from __future__ import annotations

import threading

import pytest
import torch

from factories import make_manifest, tiny_model_config
from kilnlm.runtime.abi import EngineInputs
from kilnlm.runtime.errors import KilnError, QueueFullError, RequestError
from kilnlm.runtime.executor import Executor, ExecutorConfig
from kilnlm.runtime.manifest import BuildConfig
from kilnlm.runtime.request import FinishReason, SamplingParams
from kilnlm.runtime.tokenizer import Tokenizer

VOCAB_SIZE = 49152
EOS_ID = 2


class CountingEngine:
    """Engine stand-in: the logits of each sequence put all mass on ``last input id + 1`` (mod vocab);
    ``fail_on`` makes forward raise when that token id is among the inputs. Clearing ``gate`` holds the
    next forward (the loop thread) until it is set again; ``entered`` is set when a forward starts."""

    def __init__(self, build: BuildConfig):
        self.manifest = make_manifest(build, tiny_model_config(VOCAB_SIZE), eos_token_ids=(EOS_ID,))
        self.fail_on: int | None = None
        self.num_forwards = 0
        self.max_seen_tokens = 0
        self.max_seen_seqs = 0
        self.num_computed_tokens = 0  # over all forwards
        self.num_tokens_per_forward: list[int] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def kv_cache_bytes_per_block(self) -> int:
        return 64

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        return torch.zeros(num_blocks)

    def forward(self, inputs: EngineInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"
        self.num_forwards += 1
        self.max_seen_tokens = max(self.max_seen_tokens, inputs.num_tokens)
        self.max_seen_seqs = max(self.max_seen_seqs, inputs.num_seqs)
        self.num_tokens_per_forward.append(inputs.num_tokens)
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


def test_more_sequences_than_the_batch_holds_are_rejected(make_executor):
    """n = 100,000 sequences of one request would occupy the server for minutes: refused, naming the limit."""
    executor, _ = make_executor(max_batch_size=3)
    with pytest.raises(RequestError, match="n \\(num_return_sequences\\) is 100,000: at most max_batch_size=3"):
        executor.submit([1, 2], SamplingParams(n=100_000, max_tokens=2))
    assert executor.stats().num_queued == 0
    executor.submit([1, 2], SamplingParams(n=3, max_tokens=2))


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
    # float32 log-softmax over the whole vocabulary: its sum's order is the CPU's (AVX2 kernels: 3.3e-5 off
    # the exact value on an AMD Zen 3), hence 1e-4
    tol = 1e-4
    for response, token in zip(responses, (501, 502)):
        assert response.log_probs[0] == pytest.approx(top, abs=tol)
        (first, first_lp), (_, second_lp) = response.top_logprobs[0].items()
        assert first == token and first_lp == pytest.approx(top, abs=tol) and second_lp == pytest.approx(rest, abs=tol)
    assert [r.cum_log_prob for r in responses] == pytest.approx([top, 2 * top, 2 * top], abs=2 * tol)
    whole = executor.generate([500], SamplingParams(max_tokens=10, end_id=503, logprobs=0))
    assert whole.log_probs == pytest.approx([top, top], abs=tol) and whole.top_logprobs == [{}, {}]
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


def submit_while_busy(executor: Executor, engine: CountingEngine, prompts: list[list[int]],
                      params: SamplingParams) -> list[int]:
    """Submit the first prompt, hold the loop in its first forward, submit the rest, let it go: every
    request but the first waits for admission together."""
    engine.gate.clear()
    engine.entered.clear()
    ids = [executor.submit(prompts[0], params)]
    assert engine.entered.wait(30)
    ids += [executor.submit(p, params) for p in prompts[1:]]
    engine.gate.set()
    return ids


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
def test_scheduler_policies_on_a_small_pool(make_executor, policy):
    # 12 blocks of 4 tokens = 48 tokens; 4 requests of 4 prompt tokens that grow to 16 tokens (4 blocks).
    config = ExecutorConfig(max_tokens_in_paged_kv_cache=48, batch_scheduler_policy=policy)
    executor, engine = make_executor(config, max_batch_size=4, max_num_tokens=32, max_seq_len=64)
    prompts = [[100 * (i + 1) + j for j in range(4)] for i in range(4)]
    ids = submit_while_busy(executor, engine, prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for rid, prompt in zip(ids, prompts):
        tokens = [t for r in executor.stream(rid, timeout_s=60) for t in r.token_ids]
        assert tokens == [prompt[-1] + 1 + j for j in range(12)]  # the same greedy tokens under both
    wait_idle(executor)
    stats = executor.stats()
    assert stats.num_free_blocks == stats.num_total_blocks == 12
    if policy == "max_utilization":  # requests 2-4 are admitted together, then run out of blocks
        assert engine.max_seen_seqs == 4 and stats.num_preemptions > 0
    else:  # request 1 reserves 4 blocks: 2 more fit next to it, the last waits; nothing is preempted
        assert engine.max_seen_seqs == 3 and stats.num_preemptions == 0


def test_full_queue_rejects_then_recovers(make_executor):
    executor, engine = make_executor(ExecutorConfig(max_queue_size=2), max_batch_size=1)
    params = SamplingParams(max_tokens=3)
    engine.gate.clear()
    ids = [executor.submit([10], params)]
    assert engine.entered.wait(30)  # request 1 holds the one batch slot; the loop is held in its forward
    ids += [executor.submit([20], params), executor.submit([30], params)]
    with pytest.raises(QueueFullError, match=r"queue is full: 2 requests already wait for admission "
                                             r"\(max_queue_size\): retry later"):
        executor.submit([40], params)
    engine.gate.set()
    for rid, first in zip(ids, (10, 20, 30)):
        assert [t for r in executor.stream(rid, timeout_s=60) for t in r.token_ids] == [first + 1, first + 2, first + 3]
    wait_idle(executor)
    assert executor.generate([40], params, timeout_s=60).token_ids == [41, 42, 43]


@pytest.mark.parametrize("config, match", [
    (ExecutorConfig(batch_scheduler_policy="fifo"),
     "batch_scheduler_policy is 'fifo': it must be one of max_utilization, guaranteed_no_evict"),
    (ExecutorConfig(kv_cache_bytes=4096, max_tokens_in_paged_kv_cache=64), "give only one"),
    (ExecutorConfig(max_queue_size=0), "max_queue_size=0 must be >= 1"),
])
def test_bad_scheduler_settings_are_refused(make_executor, config, match):
    with pytest.raises(KilnError, match=match):
        make_executor(config)


@pytest.mark.parametrize("enable_chunked_context", [True, False])
def test_chunked_context(make_executor, enable_chunked_context):
    config = ExecutorConfig(enable_chunked_context=enable_chunked_context)
    executor, engine = make_executor(config, max_num_tokens=16)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    ids = submit_while_busy(executor, engine, [[500], list(range(600, 616))], params)
    assert [t for r in executor.stream(ids[1], timeout_s=60) for t in r.token_ids] == [616, 617, 618, 619]
    wait_idle(executor)
    if enable_chunked_context:  # the long prompt's first 15 tokens join request 1's first generation step
        assert engine.num_tokens_per_forward == [1, 16, 2, 2, 1, 1]
    else:  # it waits until a step has room for all 16
        assert engine.num_tokens_per_forward == [1, 1, 1, 1, 16, 1, 1, 1]
        with pytest.raises(RequestError, match="17 tokens but one step computes at most max_num_tokens=16 and "
                                               "chunked context is off: enable chunked context"):
            executor.submit(list(range(600, 617)), params)


def test_iteration_stats(make_executor):
    executor, _ = make_executor(ExecutorConfig(max_tokens_in_paged_kv_cache=256), max_batch_size=3, max_num_tokens=64,
                                tokens_per_block=4)
    prompt = list(range(1000, 1042))  # 42 tokens: 11 blocks, 10 of them full
    executor.generate(prompt, SamplingParams(max_tokens=1), timeout_s=60)  # one iteration: the context
    wait_idle(executor)
    stats = executor.stats()
    assert (stats.max_num_active_requests, stats.tokens_per_block, stats.num_total_blocks) == (3, 4, 64)
    assert (stats.num_iterations, stats.last_num_tokens, stats.last_num_seqs) == (1, 42, 1)
    assert (stats.last_num_context_requests, stats.last_num_context_tokens, stats.last_num_generation_requests,
            stats.last_num_paused_requests) == (1, 42, 0, 0)
    assert (stats.num_reused_blocks, stats.num_needed_blocks) == (0, 11)
    executor.generate(prompt[:40] + [7, 8, 9], SamplingParams(max_tokens=2), timeout_s=60)
    wait_idle(executor)
    stats = executor.stats()
    assert (stats.num_iterations, stats.last_num_tokens, stats.last_num_seqs) == (3, 1, 1)
    assert (stats.last_num_context_requests, stats.last_num_context_tokens, stats.last_num_generation_requests) == (0, 0, 1)
    assert (stats.num_reused_blocks, stats.num_needed_blocks) == (10, 22)  # 10 of its 11 blocks were cached
    assert stats.num_cached_blocks == 11 and stats.num_active_requests == stats.num_queued == 0  # + [7, 8, 9, 10]
    assert stats.timestamp_s > 0 and stats.last_iteration_s > 0
