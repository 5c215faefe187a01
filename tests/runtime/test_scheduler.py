"""Scheduler policies on tiny configs: admission by KV capacity, packing by token budget, chunked context,
generation-first ordering, preemption by recompute. No engine: a step "computes" what was scheduled."""

from __future__ import annotations

from kilnlm.runtime.kv_cache import KVCacheConfig, KVCacheManager
from kilnlm.runtime.request import Request, RequestStatus, SamplingParams
from kilnlm.runtime.scheduler import ScheduledBatch, Scheduler, SchedulerConfig


def make_request(request_id: int, num_prompt_tokens: int, max_tokens: int = 8) -> Request:
    prompt = [(request_id * 1000 + i) % 50000 for i in range(num_prompt_tokens)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens), end_ids=frozenset(),
                   max_num_tokens=num_prompt_tokens + max_tokens)


def make_scheduler(num_blocks=16, tokens_per_block=4, max_batch_size=4, max_num_tokens=8) -> Scheduler:
    kv = KVCacheManager(KVCacheConfig(num_blocks, tokens_per_block, enable_prefix_caching=False))
    return Scheduler(SchedulerConfig(max_batch_size, max_num_tokens), kv)


def run_step(scheduler: Scheduler, batch: ScheduledBatch, next_token: int = 7) -> None:
    """What the executor does after the forward: advance computed tokens, append a token where sampled."""
    for seq in batch.seqs:
        completes = seq.completes_sequence
        seq.request.num_computed_tokens += seq.num_new_tokens
        if completes:
            seq.request.token_ids.append(next_token)
            if seq.request.num_generated_tokens >= seq.request.params.max_tokens:
                scheduler.remove(seq.request)
                seq.request.status = RequestStatus.FINISHED


def plan(batch: ScheduledBatch) -> list[tuple[int, int]]:
    return [(s.request.request_id, s.num_new_tokens) for s in batch.seqs]


def test_long_prompt_is_chunked_across_iterations():
    scheduler = make_scheduler(max_num_tokens=8)
    scheduler.add(make_request(1, 20, max_tokens=2))
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
    scheduler.add(make_request(1, 3))
    run_step(scheduler, scheduler.schedule())  # request 1's prompt; it samples its first token
    scheduler.add(make_request(2, 12))
    scheduler.add(make_request(3, 5))
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 1), (2, 7)]  # decode first; request 2 gets the rest of the budget
    run_step(scheduler, batch)
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 1), (2, 5), (3, 2)]  # request 3 joins while 1 decodes and 2 finishes its prompt
    assert batch.num_tokens == 8


def test_admission_respects_max_batch_size_and_kv_capacity():
    scheduler = make_scheduler(num_blocks=6, max_batch_size=2, max_num_tokens=64)
    for i, n in enumerate([8, 8, 4], start=1):
        scheduler.add(make_request(i, n))
    batch = scheduler.schedule()
    assert plan(batch) == [(1, 8), (2, 8)] and scheduler.num_waiting == 1  # batch slots full
    scheduler.remove(scheduler.running[0])
    assert plan(scheduler.schedule()) == [(2, 8), (3, 4)]

    scheduler = make_scheduler(num_blocks=5, max_batch_size=4, max_num_tokens=64)
    for i, n in enumerate([12, 12, 4], start=1):
        scheduler.add(make_request(i, n))
    # Request 2 needs 3 blocks but 2 are free: FCFS stops there, request 3 waits behind it.
    assert plan(scheduler.schedule()) == [(1, 12)]
    assert [r.request_id for r in scheduler.waiting] == [2, 3]


def test_preemption_frees_the_latest_request_and_recomputes_it():
    # 4 blocks of 4 tokens. Two requests of 7 prompt tokens hold 2 blocks each; request 1's second
    # generated token (position 8) needs a third block: request 2 (the latest admitted) is preempted.
    scheduler = make_scheduler(num_blocks=4, max_batch_size=4, max_num_tokens=16)
    r1, r2 = make_request(1, 7, max_tokens=4), make_request(2, 7, max_tokens=4)
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
    requests = [make_request(i, 5 + i) for i in range(1, 4)]
    for r in requests:
        scheduler.add(r)
    run_step(scheduler, scheduler.schedule())
    for r in requests:
        scheduler.remove(r)
    assert scheduler.kv_cache.num_free_blocks == 16 and not scheduler.has_work()
