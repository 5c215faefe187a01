"""The executor: in-flight batching around one engine, shaped like TensorRT-LLM's ``Executor``.

Clients (any thread) ``submit`` requests and read their ``Response`` stream; a background loop thread owns
every request once submitted and runs, per iteration (:meth:`Executor.step`)::

    schedule -> prepare inputs -> engine forward -> sample -> update requests -> emit responses
    Scheduler   InputBuilder     Engine            Sampler   Scheduler.update   OutputProcessor

Submissions and cancellations cross threads through an inbox guarded by one lock; responses go back
through one queue per request. The loop never dies on a request's error: the failing request (or, if the
engine forward itself fails, every request of that batch) finishes with reason "error" and its KV blocks
return to the pool.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from kilnlm.runtime.errors import KilnError, RequestError
from kilnlm.runtime.inputs import InputBuilder, InputLimits
from kilnlm.runtime.kv_cache import DEFAULT_MAX_KV_CACHE_BYTES, KVCacheConfig, KVCacheManager, num_kv_cache_blocks
from kilnlm.runtime.openmp import release_calling_thread_workers
from kilnlm.runtime.output_processor import OutputProcessor
from kilnlm.runtime.request import FinishReason, Request, Response, SamplingParams
from kilnlm.runtime.sampler import Sampler
from kilnlm.runtime.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from kilnlm.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_KV_CACHE_BYTES", "Executor", "ExecutorConfig", "IterationStats"]


@dataclass(frozen=True)
class ExecutorConfig:
    """Runtime settings. ``None`` limits take the engine's build limits (and may only lower them).

    ``kv_cache_bytes``: size of the paged KV pool; default: enough for ``max_batch_size`` sequences of
    ``max_seq_len`` tokens each, capped at ``DEFAULT_MAX_KV_CACHE_BYTES`` but never below one full
    ``max_seq_len`` sequence (:func:`kilnlm.runtime.kv_cache.num_kv_cache_blocks`).
    ``max_tokens_in_paged_kv_cache`` (TensorRT-LLM's name): the pool's size in tokens instead of bytes.

    The rest carry TensorRT-LLM's names: ``batch_scheduler_policy`` ("max_utilization": admit greedily,
    preempt and recompute when blocks run out; "guaranteed_no_evict": admit a request only when its
    whole prompt + ``max_tokens`` fits, never preempt), ``max_queue_size`` (requests waiting for
    admission beyond which ``submit`` raises :class:`~kilnlm.runtime.errors.QueueFullError`; None =
    unbounded), ``enable_kv_cache_reuse`` (prefix reuse), ``enable_chunked_context`` (a prompt longer
    than the step's token budget is computed over several iterations; off: it waits for a step with
    room for all of it).
    """

    kv_cache_bytes: int | None = None
    max_tokens_in_paged_kv_cache: int | None = None
    enable_kv_cache_reuse: bool = True
    enable_chunked_context: bool = True
    batch_scheduler_policy: str = "max_utilization"
    max_queue_size: int | None = None
    max_batch_size: int | None = None
    max_num_tokens: int | None = None


@dataclass(frozen=True)
class IterationStats:
    """A snapshot of the loop's counters (what TensorRT-LLM's ``nv_trt_llm_*`` metrics report)."""

    num_active_requests: int = 0  # admitted (holding KV blocks)
    max_num_active_requests: int = 0  # the executor's max_batch_size
    num_queued: int = 0  # submitted, waiting for admission
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_blocks: int = 0  # free or used blocks reusable by prefix hash
    tokens_per_block: int = 0
    num_iterations: int = 0
    last_num_tokens: int = 0  # packed tokens of the last iteration
    last_num_seqs: int = 0  # = num_context_requests + num_generation_requests of the last iteration
    last_num_context_requests: int = 0  # sequences of the last iteration in the context phase
    last_num_context_tokens: int = 0  # their packed tokens
    last_num_generation_requests: int = 0  # sequences of the last iteration in the generation phase
    last_num_paused_requests: int = 0  # preempted in the last iteration
    last_iteration_s: float = 0.0  # wall time of the last iteration (prepare + forward + sample + update)
    num_preemptions: int = 0
    num_reused_blocks: int = 0  # since start: blocks admissions took from the prefix cache
    num_needed_blocks: int = 0  # since start: blocks admissions needed (reused + newly allocated)


class Executor:
    def __init__(self, engine, tokenizer: Tokenizer, config: ExecutorConfig | None = None) -> None:
        """``engine``: a loaded :class:`kilnlm.runtime.engine.Engine` (or anything with its ``manifest``,
        ``allocate_kv_cache``, ``kv_cache_bytes_per_block`` and ``forward``). Starts the loop thread."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config = config or ExecutorConfig()
        build = engine.manifest.build
        self.max_seq_len = build.max_seq_len
        self.vocab_size = engine.manifest.model.vocab_size
        self.eos_token_ids = frozenset(engine.manifest.generation.eos_token_ids)
        max_batch_size = _lower_limit("max_batch_size", config.max_batch_size, build.max_batch_size)
        max_num_tokens = _lower_limit("max_num_tokens", config.max_num_tokens, build.max_num_tokens)
        max_blocks_per_seq = -(-build.max_seq_len // build.tokens_per_block)
        num_blocks = num_kv_cache_blocks(config.kv_cache_bytes, engine.kv_cache_bytes_per_block(), max_batch_size,
                                         build.max_seq_len, build.tokens_per_block)
        self.kv_cache = engine.allocate_kv_cache(num_blocks)
        self.kv_manager = KVCacheManager(KVCacheConfig(num_blocks, build.tokens_per_block, config.enable_kv_cache_reuse))
        self.scheduler = Scheduler(SchedulerConfig(max_batch_size, max_num_tokens), self.kv_manager)
        self.sampler = Sampler()
        self.input_builder = InputBuilder(InputLimits(max_num_tokens, max_batch_size, max_blocks_per_seq, build.tokens_per_block))
        self.output_processor = OutputProcessor(tokenizer)

        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._cancels: set[int] = set()
        self._streams: dict[int, queue.SimpleQueue[Response]] = {}
        self._next_id = itertools.count(1)
        self._stopping = False
        self._stats = IterationStats(num_free_blocks=num_blocks, num_total_blocks=num_blocks)
        # Loop-thread state.
        self._requests: dict[int, Request] = {}  # submitted, final response not yet sent
        self._last_batch: tuple[int, int, float] = (0, 0, 0.0)  # num_tokens, num_seqs, iteration_s
        self._num_iterations = 0
        self._num_preemptions = 0
        # This thread's OpenMP workers (the KV-cache allocation above made them) would slow every forward
        # of the loop thread by 2x or more (kilnlm.runtime.openmp).
        release_calling_thread_workers()
        self._thread = threading.Thread(target=self._loop, name="kilnlm-executor", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_dir(cls, engine_dir: str | os.PathLike, config: ExecutorConfig | None = None) -> "Executor":
        """Verify and load the engine in ``engine_dir`` and its tokenizer, and start the loop thread."""
        from kilnlm.runtime.engine import Engine

        engine = Engine.load(engine_dir)
        return cls(engine, Tokenizer.from_dir(engine.tokenizer_dir), config)

    # ------------------------------------------------------------------------------- client API
    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; returns its id. Thread-safe. Raises :class:`RequestError` for an empty prompt,
        a prompt of ``max_seq_len`` tokens or more, token ids outside the vocabulary, bad sampling params,
        or a sequence that cannot fit the KV cache even alone."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        prompt = [int(t) for t in prompt_token_ids]
        if not prompt:
            raise RequestError("the prompt is empty: send at least one token")
        if len(prompt) >= self.max_seq_len:
            raise RequestError(
                f"the prompt has {len(prompt):,} tokens but the engine's max_seq_len is {self.max_seq_len:,} "
                "(prompt + generated tokens): shorten the prompt or rebuild the engine with a larger --max-seq-len"
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise RequestError(f"the prompt holds token ids outside the vocabulary [0, {self.vocab_size})")
        max_num_tokens = min(len(prompt) + params.max_tokens, self.max_seq_len)
        capacity_tokens = self.kv_manager.num_total_blocks * self.kv_manager.tokens_per_block
        if max_num_tokens > capacity_tokens:
            raise RequestError(
                f"the request needs up to {max_num_tokens:,} tokens of KV cache but the pool holds "
                f"{capacity_tokens:,}: lower max_tokens or raise the executor's kv_cache_bytes"
            )
        end_ids = frozenset() if params.ignore_eos else (frozenset({params.end_id}) if params.end_id is not None else self.eos_token_ids)
        with self._lock:
            if self._stopping:
                raise RequestError("the executor is shut down: create a new one")
            request_id = next(self._next_id)
            request = Request(request_id, prompt, params, end_ids=end_ids, max_num_tokens=max_num_tokens)
            self._streams[request_id] = queue.SimpleQueue()
            self._inbox.append(request)
            self._lock.notify()
        return request_id

    def stream(self, request_id: int, timeout_s: float | None = None) -> Iterator[Response]:
        """Yield the request's responses until the finished one. Raises :class:`RequestError` for an unknown
        (or already fully streamed) id and ``TimeoutError`` if no response arrives within ``timeout_s``."""
        with self._lock:
            responses = self._streams.get(request_id)
        if responses is None:
            raise RequestError(f"request {request_id} is unknown or its responses were already consumed")
        while True:
            try:
                response = responses.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no response for request {request_id} within {timeout_s} s") from None
            if response.finished:
                with self._lock:
                    self._streams.pop(request_id, None)
            yield response
            if response.finished:
                return

    def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None, timeout_s: float | None = None) -> Response:
        """Submit and wait; the returned response holds all output token ids and the full text."""
        request_id = self.submit(prompt_token_ids, params)
        token_ids: list[int] = []
        text: list[str] = []
        for response in self.stream(request_id, timeout_s):
            token_ids += response.token_ids
            text.append(response.text)
        return replace(response, token_ids=token_ids, text="".join(text))

    def cancel(self, request_id: int) -> None:
        """Finish the request with reason "cancelled"; its blocks return to the pool before the next
        iteration. Thread-safe; a no-op for finished or unknown ids."""
        with self._lock:
            self._cancels.add(request_id)
            self._lock.notify()

    def stats(self) -> IterationStats:
        with self._lock:
            return self._stats

    @property
    def running(self) -> bool:
        """Whether the loop thread serves requests (started, not shut down, not dead): a server's health."""
        with self._lock:
            return self._thread.is_alive() and not self._stopping

    def shutdown(self, timeout_s: float | None = 30.0) -> None:
        """Stop the loop; unfinished requests finish with reason "cancelled". Idempotent."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def __enter__(self) -> "Executor":
        return self

    def __exit__(self, *exc_info) -> None:
        self.shutdown()

    # -------------------------------------------------------------------------------- loop thread
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not (self._stopping or self._inbox or self._cancels or self.scheduler.has_work()):
                    self._lock.wait()
                if self._stopping:
                    break
                new_requests, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, set()
            self._accept(new_requests, cancels)
            if self.scheduler.has_work():
                try:
                    self.step()
                except Exception as exc:  # a bug outside any one request: fail everything live, keep serving
                    logger.exception("executor iteration failed")
                    for request in list(self._requests.values()):
                        self._finish(request, FinishReason.ERROR, f"executor iteration failed: {exc!r}")
            self._publish_stats()
        with self._lock:
            new_requests, self._inbox = self._inbox, []
        self._accept(new_requests, set())
        for request in list(self._requests.values()):
            self._finish(request, FinishReason.CANCELLED)
        self._publish_stats()

    def _accept(self, new_requests: list[Request], cancels: set[int]) -> None:
        for request in new_requests:
            self._requests[request.request_id] = request
            self.output_processor.add_request(request)
            self.scheduler.add(request)
        for request_id in cancels:
            if (request := self._requests.get(request_id)) is not None:
                self._finish(request, FinishReason.CANCELLED)

    def step(self) -> None:
        """One iteration. Runs on the loop thread."""
        start_s = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return
        logits = self._forward(batch)
        if logits is None:
            return
        sampled_token_ids = self._sample(batch, logits)
        updated = self.scheduler.update(batch, sampled_token_ids)
        self._respond(updated)
        self._record_iteration(batch, time.perf_counter() - start_s)

    def _forward(self, batch: ScheduledBatch) -> torch.Tensor | None:
        """Prepare inputs and run the engine: ``logits [B, vocab] float32``, or None after failing every
        request of the batch (the engine's error is theirs; the loop goes on)."""
        try:
            inputs = self.input_builder.build(batch, self.kv_manager)
            return self.engine.forward(inputs, self.kv_cache)
        except Exception as exc:
            logger.exception("engine forward failed")
            for seq in batch.seqs:
                self._finish(seq.request, FinishReason.ERROR, f"engine forward failed: {exc!r}")
            return None

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[int]:
        """One token per sequence whose pending tokens were all computed, in batch order (a non-final
        context chunk's logits are dropped); empty after failing those requests if sampling fails."""
        rows = [b for b, seq in enumerate(batch.seqs) if seq.completes_sequence]
        if not rows:
            return []
        requests = [batch.seqs[b].request for b in rows]
        try:
            return self.sampler.sample(logits if len(rows) == len(logits) else logits[rows], requests)
        except Exception as exc:
            logger.exception("sampling failed")
            for request in requests:
                self._finish(request, FinishReason.ERROR, f"sampling failed: {exc!r}")
            return []

    def _respond(self, requests: list[Request]) -> None:
        """Make the responses of the requests that got a token (the output processor), finish those a stop
        string ended, then emit. A request whose response fails finishes with reason "error" alone."""
        responses: list[Response] = []
        any_finished = False
        for request in requests:
            try:
                response = self.output_processor.process(request)
            except Exception as exc:
                logger.exception("request %d failed", request.request_id)
                self.scheduler.finish(request, FinishReason.ERROR, f"request handling failed: {exc!r}")
                response = self.output_processor.final_response(request)
            if response.finished:
                if not request.finished:  # a stop string ended it
                    self.scheduler.finish(request, response.finish_reason)
                del self._requests[request.request_id]
                any_finished = True
            responses.append(response)
        if any_finished:
            self._publish_stats()  # a client that saw its final response sees the blocks back in stats()
        self._emit(responses)

    def _record_iteration(self, batch: ScheduledBatch, iteration_s: float) -> None:
        self._last_batch = (batch.num_tokens, len(batch.seqs), iteration_s)
        self._num_iterations += 1
        self._num_preemptions += len(batch.preempted)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a live request outside the token path (cancelled, failed, shut down): free its blocks and
        send its final response (all text still held back). A no-op once its final response was sent."""
        if self._requests.pop(request.request_id, None) is None:
            return
        self.scheduler.finish(request, reason, error)
        response = self.output_processor.final_response(request)
        self._publish_stats()  # a client that saw its final response sees the blocks back in stats()
        self._emit([response])

    def _emit(self, responses: list[Response]) -> None:
        with self._lock:
            for response in responses:
                stream = self._streams.get(response.request_id)
                if stream is not None:
                    stream.put(response)

    def _publish_stats(self) -> None:
        last_num_tokens, last_num_seqs, last_iteration_s = self._last_batch
        stats = IterationStats(
            num_active_requests=self.scheduler.num_running,
            num_queued=self.scheduler.num_waiting,
            num_free_blocks=self.kv_manager.num_free_blocks,
            num_total_blocks=self.kv_manager.num_total_blocks,
            num_cached_blocks=self.kv_manager.num_cached_blocks,
            num_iterations=self._num_iterations,
            last_num_tokens=last_num_tokens,
            last_num_seqs=last_num_seqs,
            last_iteration_s=last_iteration_s,
            num_preemptions=self._num_preemptions,
        )
        with self._lock:
            self._stats = stats


def _lower_limit(name: str, requested: int | None, built: int) -> int:
    if requested is None:
        return built
    if not (1 <= requested <= built):
        raise KilnError(f"{name}={requested} must be between 1 and the engine's build limit {built}: lower it or rebuild the engine")
    return requested
