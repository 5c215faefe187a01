"""In-flight batching: which requests run in the next engine forward, and how many of their tokens.

Two small policies, composed in :meth:`Scheduler.schedule` (TensorRT-LLM's capacity scheduler + micro-batch
scheduler):

1. **Capacity (admission)** -- first come, first served: a waiting request is admitted when a batch slot is
   free (``max_batch_size``) and the KV-cache manager can hold its whole current sequence (prompt, plus the
   tokens generated before a preemption). Admission stops at the first request that does not fit, so a long
   prompt is never starved by shorter ones behind it.
2. **Packing (this iteration)** -- within the token budget ``max_num_tokens``: generation-phase requests
   first (one token each, growing their block table as they cross a block boundary), then context-phase
   requests in admission order, each with the largest chunk of its prompt that still fits (chunked
   context: a long prompt spreads over several iterations while others keep decoding).

When a generation-phase request needs a new block and none is free, the most recently admitted running
request is preempted: its blocks are freed and it returns to the front of the waiting queue, to be
recomputed (as one context) when blocks free up again. Requests join and leave between iterations.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kilnlm.runtime.kv_cache import KVCacheManager
from kilnlm.runtime.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_size: int  # sequences per forward
    max_num_tokens: int  # packed new tokens per forward (context chunks + generation tokens)


@dataclass
class ScheduledSeq:
    """One sequence of the batch: its tokens ``token_ids[start:start + num_new_tokens]`` are computed this
    step (``start == request.num_computed_tokens``)."""

    request: Request
    num_new_tokens: int

    @property
    def completes_sequence(self) -> bool:
        """True if this step computes the request's last pending token, so its logits are sampled (a
        non-final context chunk yields logits that are discarded)."""
        return self.num_new_tokens == self.request.num_pending_tokens


@dataclass
class ScheduledBatch:
    """What the next engine forward computes: generation-phase sequences first, then context chunks."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)  # requests that lost their blocks this step

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Owns the waiting queue and the running list; asks the :class:`KVCacheManager` for blocks.

    Not thread-safe: only the executor's loop thread calls it.
    """

    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out (finished, cancelled or failed) and free its blocks. Idempotent."""
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        self.kv_cache.free(request.request_id)

    def schedule(self) -> ScheduledBatch:
        """The next iteration's batch: admit what fits in the KV cache, then pack generation tokens and
        context chunks into the token budget. Empty only when nothing is running."""
        self._admit()
        batch = ScheduledBatch()
        token_budget = self._schedule_generation(batch, self.config.max_num_tokens)
        self._schedule_context(batch, token_budget)
        return batch

    # ------------------------------------------------------------------------------------ policies
    def _admit(self) -> None:
        """Capacity policy: FCFS admission while a batch slot and the KV blocks for the sequence exist."""
        while self.waiting and len(self.running) < self.config.max_batch_size:
            request = self.waiting[0]
            num_cached_tokens = self.kv_cache.allocate(request.request_id, request.token_ids)
            if num_cached_tokens is None:
                return
            self.waiting.popleft()
            request.num_computed_tokens = num_cached_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)

    def _schedule_generation(self, batch: ScheduledBatch, token_budget: int) -> int:
        """One token for each generation-phase request, preempting from the back when blocks run out."""
        for request in list(self.running):
            if request not in self.running or not self._in_generation_phase(request) or token_budget == 0:
                continue
            while not self.kv_cache.append_slots(request.request_id, request.num_tokens):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is request:
                    break
            if request in self.running:
                batch.seqs.append(ScheduledSeq(request, 1))
                token_budget -= 1
        return token_budget

    def _schedule_context(self, batch: ScheduledBatch, token_budget: int) -> None:
        """Chunks of pending prompt tokens, in admission order, while the token budget lasts."""
        for request in self.running:
            if token_budget == 0:
                return
            if self._in_generation_phase(request):
                continue
            num_new_tokens = min(request.num_pending_tokens, token_budget)
            batch.seqs.append(ScheduledSeq(request, num_new_tokens))
            token_budget -= num_new_tokens

    # ----------------------------------------------------------------------------------- internals
    @staticmethod
    def _in_generation_phase(request: Request) -> bool:
        return request.num_pending_tokens == 1 and request.num_generated_tokens > 0

    def _preempt(self, request: Request, batch: ScheduledBatch) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        batch.preempted.append(request)
