"""Scheduler policies on tiny configs: admission by KV capacity, packing by token budget, chunked context,
generation-first ordering, preemption by recompute; and its update after a forward (computed tokens, end
ids, length, prefix registration). No engine: a step "computes" what was scheduled and samples a fixed
token, and Scheduler.update applies it as in the executor."""

from __future__ import annotations

import pytest

from factories import make_request, make_scheduler
from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.request import FinishReason, RequestStatus
from kilnlm.runtime.scheduler import BatchSchedulerPolicy, ScheduledBatch, Scheduler


def run_step(scheduler: Scheduler, batch: ScheduledBatch, next_token: int = 7) -> list:
    """The step after the forward: every sampled sequence samples ``next_token``; the scheduler's own
    update applies it. Returns the requests that got a token."""
    num_sampled = sum(seq.completes_sequence for seq in batch.seqs)
    return scheduler.update(batch, [[next_token]] * num_sampled)


def plan(batch: ScheduledBatch) -> list[tuple[int, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in batch.seqs]


def test_long_prompt_is_chunked_across_iterations():
    scheduler = make_scheduler(max_num_tokens=8)
    scheduler.add(make_request(1, num_prompt_tokens=20, max_tokens=2))
    chunks = []
    for _ in range(5):
        batch = scheduler.schedule()
        chunks.append(plan(batch))
        run_step(scheduler, batch)
    assert chunks == [[(1, 8)], [(1, 8)], [(1, 4)], [(1, 1)], []]
    assert not scheduler.has_work()
    assert scheduler.kv_cache.num_free_blocks == 16


def test_generation_tokens_first_then_context_chunks_within_budget():
    scheduler = make_scheduler(max_num_tokens=8)
    scheduler.add(make_request(1, num_prompt_tokens=3))
    run_step(scheduler, scheduler.schedule())  # request 1's prompt; it samples its first token
    scheduler.add(make_request(2, num_prompt_tokens=12))
    scheduler.add(make_request(3, num_prompt_tokens=5))
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 1), (2, 7)]  # decode first; request 2 gets the rest of the budget
    run_step(scheduler, batch)
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 1), (2, 5), (3, 2)]  # request 3 joins while 1 decodes and 2 finishes its prompt
    assert batch.num_tokens == 8


def test_admission_respects_max_batch_size_and_kv_capacity():
    scheduler = make_scheduler(num_blocks=6, max_batch_size=2, max_num_tokens=64)
    for i, n in enumerate([8, 8, 4], start=1):
        scheduler.add(make_request(i, num_prompt_tokens=n))
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 8), (2, 8)] and scheduler.num_waiting == 1  # batch slots full
    scheduler.remove(scheduler.running[0])
    assert plan(scheduler.schedule()) == [(2, 8), (3, 4)]

    scheduler = make_scheduler(num_blocks=5, max_batch_size=4, max_num_tokens=64)
    for i, n in enumerate([12, 12, 4], start=1):
        scheduler.add(make_request(i, num_prompt_tokens=n))
    # Request 2 needs 3 blocks but 2 are free: FCFS stops there, request 3 waits behind it.
    assert plan(scheduler.schedule()) == [(1, 12)]
    assert [r.request_id for r in scheduler.waiting] == [2, 3]


def test_preemption_frees_the_latest_request_and_recomputes_it():
    # 4 blocks of 4 tokens. Two requests of 7 prompt tokens hold 2 blocks each; request 1's second
    # generated token (position 8) needs a third block: request 2 (the latest admitted) is preempted.
    scheduler = make_scheduler(num_blocks=4, max_batch_size=4, max_num_tokens=16)
    r1, r2 = make_request(1, num_prompt_tokens=7, max_tokens=4), make_request(2, num_prompt_tokens=7, max_tokens=4)
    scheduler.add(r1)
    scheduler.add(r2)
    run_step(scheduler, scheduler.schedule())  # both prompts; 8 tokens each now
    assert scheduler.kv_cache.num_free_blocks == 0
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 1), (2, 1)]  # position 7 still fits the second block
    run_step(scheduler, batch)
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 1)]
    assert batch.preempted == [r2]
    assert r2.status is RequestStatus.WAITING and r2.num_computed_tokens == 0 and r2.num_preemptions == 1
    assert r2.num_generated_tokens == 2  # keeps its generated tokens
    while scheduler.has_work():
        run_step(scheduler, scheduler.schedule())
    # Request 2 was re-admitted after request 1 finished and recomputed its prompt + generated tokens.
    assert r1.num_generated_tokens == 4 and r2.num_generated_tokens == 4
    assert scheduler.kv_cache.num_free_blocks == 4


def test_removed_requests_return_all_blocks():
    scheduler = make_scheduler()
    requests = [make_request(i, num_prompt_tokens=5 + i) for i in range(1, 4)]
    for r in requests:
        scheduler.add(r)
    run_step(scheduler, scheduler.schedule())
    for r in requests:
        scheduler.remove(r)
    assert scheduler.kv_cache.num_free_blocks == 16 and not scheduler.has_work()


def test_update_advances_computed_tokens_and_appends_only_completed_sequences():
    scheduler = make_scheduler(max_num_tokens=8)
    long_one, short = make_request(1, num_prompt_tokens=10), make_request(2, num_prompt_tokens=3)
    scheduler.add(short)
    scheduler.add(long_one)
    batch = scheduler.schedule()
    assert plan(batch) == [(2, 3), (1, 5)]
    assert scheduler.update(batch, [[42]]) == [short]  # the long prompt's first chunk samples nothing
    assert (short.num_computed_tokens, short.token_ids[-1], short.num_generated_tokens) == (3, 42, 1)
    assert (long_one.num_computed_tokens, long_one.num_generated_tokens) == (5, 0)
    assert short.first_token_time_s is not None and long_one.first_token_time_s is None


def test_update_finishes_on_an_end_id_without_appending_it_and_frees_the_blocks():
    scheduler = make_scheduler()
    request = make_request(1, num_prompt_tokens=5, end_ids=frozenset({2}))
    scheduler.add(request)
    assert scheduler.update(scheduler.schedule(), [[9]]) == [request]
    assert scheduler.update(scheduler.schedule(), [[2]]) == [request]
    assert request.finished and request.finish_reason is FinishReason.END_ID
    assert request.output_token_ids == [9]
    assert not scheduler.has_work() and scheduler.kv_cache.num_free_blocks == 16


def test_update_finishes_at_max_tokens_and_at_max_num_tokens():
    scheduler = make_scheduler()
    request = make_request(1, num_prompt_tokens=4, max_tokens=2)
    scheduler.add(request)
    run_step(scheduler, scheduler.schedule())
    assert request.status is RequestStatus.RUNNING
    run_step(scheduler, scheduler.schedule())
    assert request.finish_reason is FinishReason.LENGTH and request.output_token_ids == [7, 7]
    # The engine's max_seq_len caps max_num_tokens below prompt + max_tokens.
    capped = make_request(2, num_prompt_tokens=4, max_tokens=10)
    capped.max_num_tokens = 5
    scheduler.add(capped)
    run_step(scheduler, scheduler.schedule())
    assert capped.finish_reason is FinishReason.LENGTH and capped.num_tokens == 5
    assert scheduler.kv_cache.num_free_blocks == 16


def test_update_registers_full_computed_blocks_for_prefix_reuse():
    scheduler = make_scheduler(max_num_tokens=6, enable_kv_cache_reuse=True)
    first = make_request(1, num_prompt_tokens=10)
    scheduler.add(first)
    run_step(scheduler, scheduler.schedule())  # 6 of 10 prompt tokens: one full block
    assert scheduler.kv_cache.num_cached_blocks == 1
    run_step(scheduler, scheduler.schedule())  # the other 4 (and a sampled token): two full blocks
    assert scheduler.kv_cache.num_cached_blocks == 2
    second = make_request(2, first.prompt_token_ids[:8] + [5, 6])
    scheduler.add(second)
    scheduler.schedule()
    assert second.num_computed_tokens == 8  # both full blocks reused


def test_requests_submitted_together_compute_their_shared_prefix_once():
    """Four requests sharing a 3-block prefix arrive together: the first computes the prefix while the
    others wait, then each takes the prefix's blocks and computes only its own tail."""
    scheduler = make_scheduler(num_blocks=32, max_num_tokens=64, enable_kv_cache_reuse=True)
    prefix = list(range(100, 112))
    requests = [make_request(i, prefix + [i] * 3, max_tokens=2) for i in range(1, 5)]
    for request in requests:
        scheduler.add(request)
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 15)]  # 2, 3 and 4 wait for the blocks request 1 computes
    run_step(scheduler, batch)
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 1), (2, 3), (3, 3), (4, 3)]
    assert all(scheduler.kv_cache.block_table(r.request_id)[:3] == scheduler.kv_cache.block_table(1)[:3]
               for r in requests[1:])
    while scheduler.has_work():
        run_step(scheduler, scheduler.schedule())
    assert scheduler.kv_cache.num_free_blocks == 32
    assert scheduler.kv_cache.num_reused_blocks == 9


def test_without_prefix_caching_requests_submitted_together_each_compute_their_prompt():
    scheduler = make_scheduler(num_blocks=32, max_num_tokens=64)
    for i in range(1, 5):
        scheduler.add(make_request(i, list(range(100, 112)) + [i] * 3))
    assert plan(scheduler.schedule()) == [(i, 15) for i in range(1, 5)]


def test_update_skips_requests_finished_before_it():
    scheduler = make_scheduler()
    failed, chunked = make_request(1, num_prompt_tokens=2), make_request(2, num_prompt_tokens=12)
    scheduler.add(failed)
    scheduler.add(chunked)
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 2), (2, 6)]
    scheduler.finish(failed, FinishReason.ERROR, "sampling failed")  # as the executor does when sampling fails
    assert scheduler.update(batch, []) == []
    assert failed.num_computed_tokens == 0 and chunked.num_computed_tokens == 6
    assert failed.error_message == "sampling failed" and failed not in scheduler.running


# ------------------------------------------------------------------------ batch_scheduler_policy
def run_to_completion(scheduler: Scheduler, requests: list) -> tuple[int, int]:
    """Add ``requests``, then step until every one finished. Returns (most sequences in one step,
    preemptions)."""
    for request in requests:
        scheduler.add(request)
    max_seqs = num_preempted = 0
    while scheduler.has_work():
        batch = scheduler.schedule()
        max_seqs = max(max_seqs, len(batch.seqs))
        num_preempted += len(batch.preempted)
        run_step(scheduler, batch)
    return max_seqs, num_preempted


def test_guaranteed_no_evict_admits_fewer_and_never_preempts_max_utilization_preempts():
    # 6 blocks of 4 tokens; 3 requests of 4 prompt tokens that may grow to 4 + 8 = 12 tokens (3 blocks).
    requests = {policy: [make_request(i, num_prompt_tokens=4, max_tokens=8) for i in (1, 2, 3)]
                for policy in ("max_utilization", "guaranteed_no_evict")}
    greedy = make_scheduler(num_blocks=6, max_num_tokens=16, policy="max_utilization")
    assert run_to_completion(greedy, requests["max_utilization"]) == (3, 1)  # all 3 admitted; one preempted
    safe = make_scheduler(num_blocks=6, max_num_tokens=16, policy="guaranteed_no_evict")
    for request in requests["guaranteed_no_evict"]:
        safe.add(request)
    batch = safe.schedule()
    # Request 1 reserves 3 blocks, request 2 the other 3: request 3 waits although 4 blocks are free now.
    assert plan(batch) == [(1, 4), (2, 4)] and safe.kv_cache.num_free_blocks == 4
    assert [r.request_id for r in safe.waiting] == [3]
    run_step(safe, batch)
    assert run_to_completion(safe, []) == (2, 0)
    for policy, finished in requests.items():
        assert [r.output_token_ids for r in finished] == [[7] * 8] * 3, policy
        assert all(r.finish_reason is FinishReason.LENGTH for r in finished)
    assert greedy.kv_cache.num_free_blocks == safe.kv_cache.num_free_blocks == 6


def test_guaranteed_no_evict_counts_prefix_hits_and_the_reserve_of_running_requests():
    scheduler = make_scheduler(num_blocks=8, max_num_tokens=32, enable_kv_cache_reuse=True,
                               policy="guaranteed_no_evict")
    first = make_request(1, num_prompt_tokens=9, max_tokens=3)  # 12 tokens: 3 blocks
    scheduler.add(first)
    run_step(scheduler, scheduler.schedule())  # 2 full blocks cached; 10 tokens in 3 blocks
    assert scheduler.kv_cache.num_missing_blocks(1, first.max_num_tokens) == 0
    # Shares first's 2 full blocks and may grow to 9 + 15 = 24 tokens (6 blocks): needs 4 new ones, and 5
    # are free.
    second = make_request(2, first.prompt_token_ids[:8] + [5], max_tokens=15)
    assert scheduler.kv_cache.num_blocks_to_allocate(second.token_ids, second.max_num_tokens) == 4
    # A third of 4 + 4 tokens (2 blocks) no longer fits next to second's reserve (3 blocks): 1 free left.
    third = make_request(3, num_prompt_tokens=4, max_tokens=4)
    scheduler.add(second)
    scheduler.add(third)
    assert plan(scheduler.schedule()) == [(1, 1), (2, 1)]
    assert second.num_computed_tokens == 8 and [r.request_id for r in scheduler.waiting] == [3]


def test_unknown_policy_names_the_choices():
    with pytest.raises(KilnError, match="batch_scheduler_policy is 'fcfs': it must be one of max_utilization, "
                                        "guaranteed_no_evict"):
        BatchSchedulerPolicy.from_name("fcfs")


# ---------------------------------------------------------------------------------- chunked context off
def test_without_chunked_context_a_context_waits_for_a_step_with_room_for_all_of_it():
    scheduler = make_scheduler(max_num_tokens=8, enable_chunked_context=False)
    decoding = make_request(1, num_prompt_tokens=3, max_tokens=3)
    scheduler.add(decoding)
    run_step(scheduler, scheduler.schedule())
    scheduler.add(make_request(2, num_prompt_tokens=8))
    scheduler.add(make_request(3, num_prompt_tokens=2))
    plans = []
    for _ in range(4):
        batch = scheduler.schedule()
        plans.append(plan(batch))
        run_step(scheduler, batch)
    # 8 prompt tokens never fit next to a generation token: request 2 (and request 3 behind it) wait until
    # request 1 finished; then request 2 runs whole and request 3 follows.
    assert plans == [[(1, 1)], [(1, 1)], [(2, 8)], [(2, 1), (3, 2)]]


def test_without_chunked_context_a_recomputation_longer_than_the_budget_is_still_chunked():
    # 3 blocks of 4 tokens. Request 2 (7 prompt tokens, 2 generated: 9 tokens) is preempted when request 1's
    # 5th token needs a block; its recomputation can never fit a step of 8 whole, so it alone is chunked.
    scheduler = make_scheduler(num_blocks=3, max_num_tokens=8, enable_chunked_context=False)
    short, long_one = make_request(1, num_prompt_tokens=2, max_tokens=8), make_request(2, num_prompt_tokens=7, max_tokens=4)
    scheduler.add(short)
    scheduler.add(long_one)
    plans = []
    while scheduler.has_work():
        batch = scheduler.schedule()
        plans.append((plan(batch), [r.request_id for r in batch.preempted]))
        run_step(scheduler, batch)
    assert plans[:4] == [([(1, 2)], []), ([(1, 1), (2, 7)], []), ([(1, 1), (2, 1)], []), ([(1, 1)], [2])]
    assert plans[4:] == [([(1, 1)], [])] * 4 + [([(2, 8)], []), ([(2, 1)], []), ([(2, 1)], [])]
    assert long_one.num_preemptions == 1 and long_one.output_token_ids == [7] * 4 and short.output_token_ids == [7] * 8
