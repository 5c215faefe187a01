"""The executor: in-flight batching around one engine, shaped like TensorRT-LLM's ``Executor``.

Clients (any thread) ``submit`` requests and read their ``Response`` stream; a background loop thread owns
every request once submitted and runs, per iteration (:meth:`Executor.step`)::

    schedule -> prepare inputs -> engine forward -> sample -> update requests -> emit responses
    Scheduler   InputBuilder     Engine            Sampler   Scheduler.update   OutputProcessor

Submissions and cancellations cross threads through an inbox guarded by one lock; responses go back
through one queue per request.

A request with ``SamplingParams.n = k`` runs as k sequences (:mod:`kilnlm.runtime.request`) under one
request id: one response stream, each ``Response`` tagged with its ``sequence_index``, ended after every
sequence's final response; ``cancel`` ends all k. With ``enable_kv_cache_reuse`` the prompt is computed
once: sequence 0 is scheduled alone and sequences 1..k-1 join the scheduler's waiting queue once it has
sampled its first token (its prompt's full blocks are then in the prefix cache, so their admission reuses
them and computes only the prompt's last partial block, at least one token); without reuse all k are
queued at once and compute the prompt independently (as they do when the prompt has no full block to
share). The loop never dies on a request's error: the failing request (or, if the
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from kilnlm.runtime.errors import EngineError, KilnError, QueueFullError, RequestError
from kilnlm.runtime.guided_decoding import GuidedDecoder
from kilnlm.runtime.inputs import InputBuilder, InputLimits
from kilnlm.runtime.kv_cache import DEFAULT_MAX_KV_CACHE_BYTES, KVCacheConfig, KVCacheManager, num_kv_cache_blocks
from kilnlm.runtime.openmp import release_calling_thread_workers
from kilnlm.runtime.output_processor import OutputProcessor
from kilnlm.runtime.request import FinishReason, Request, Response, SamplingParams
from kilnlm.runtime.sampler import Sampler
from kilnlm.runtime.scheduler import BatchSchedulerPolicy, ScheduledBatch, Scheduler, SchedulerConfig
from kilnlm.runtime.signing import FROM_ENVIRONMENT
from kilnlm.runtime.speculative import make_proposer, parse_speculative_config, verify_greedy, verify_sampled
from kilnlm.runtime.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_KV_CACHE_BYTES", "Executor", "ExecutorConfig", "IterationStats"]


@dataclass(frozen=True)
class ExecutorConfig:
    """Runtime settings. ``None`` limits take the engine's build limits (and may only lower them).

    ``kv_cache_bytes``: size of the paged KV pool; default: enough for ``max_batch_size`` sequences of
    ``max_seq_len`` tokens each, capped at ``DEFAULT_MAX_KV_CACHE_BYTES`` but never below one full
    ``max_seq_len`` sequence (:func:`kilnlm.runtime.kv_cache.num_kv_cache_blocks`).
    ``max_tokens_in_paged_kv_cache`` (TensorRT-LLM's name): the pool's size in tokens instead of bytes
    (give at most one of the two).

    The rest carry TensorRT-LLM's names: ``batch_scheduler_policy`` ("max_utilization": admit greedily,
    preempt and recompute when blocks run out; "guaranteed_no_evict": admit a request only when its
    whole prompt + ``max_tokens`` fits, never preempt), ``max_queue_size`` (requests waiting for
    admission beyond which ``submit`` raises :class:`~kilnlm.runtime.errors.QueueFullError`; None =
    unbounded), ``enable_kv_cache_reuse`` (prefix reuse), ``enable_chunked_context`` (a prompt longer
    than the step's token budget is computed over several iterations; off: it waits for a step with
    room for all of it, and ``submit`` refuses a prompt longer than ``max_num_tokens``).
    :func:`kilnlm.runtime.serving.parameters.executor_options` lists every field with its help.
    Raises :class:`KilnError` (from the :class:`Executor`) for an unknown policy or a bad size.
    """

    # Each field's ``help`` (and ``choices``) is what `kilnlm serve --help` and config.pbtxt's docs show
    # (kilnlm.runtime.serving.parameters.executor_options).
    kv_cache_bytes: int | None = field(default=None, metadata={
        "help": "KV pool size in bytes (default: max_batch_size sequences of max_seq_len, at most "
                f"{DEFAULT_MAX_KV_CACHE_BYTES >> 30} GiB)"})
    max_tokens_in_paged_kv_cache: int | None = field(default=None, metadata={
        "help": "KV pool size in tokens, instead of kv_cache_bytes"})
    enable_kv_cache_reuse: bool = field(default=True, metadata={
        "help": "reuse the KV blocks of shared prompt prefixes (prefix caching)"})
    enable_chunked_context: bool = field(default=True, metadata={
        "help": "compute long prompts over several steps; off: a prompt waits for a step with room for all of it"})
    batch_scheduler_policy: str = field(default=BatchSchedulerPolicy.MAX_UTILIZATION.value, metadata={
        "help": "max_utilization: admit greedily, preempt when KV blocks run out; guaranteed_no_evict: admit "
                "only when prompt + max_tokens fits, never preempt",
        "choices": tuple(p.value for p in BatchSchedulerPolicy)})
    max_queue_size: int | None = field(default=None, metadata={
        "help": "requests that may wait for admission; beyond it requests are refused (default: unbounded)"})
    max_batch_size: int | None = field(default=None, metadata={
        "help": "sequences per step (default: the engine's build limit, which it may only lower)"})
    max_num_tokens: int | None = field(default=None, metadata={
        "help": "tokens per step (default: the engine's build limit, which it may only lower)"})
    speculative_config: str | None = field(default=None, metadata={
        "help": 'speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                '"prompt_lookup_max": 3} or {"method": "draft", "model": DRAFT_ENGINE_DIR, "num_speculative_tokens": 3} '
                '(requests without penalties, bad words, log-probs or a grammar; default: off)'})


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
    num_reused_blocks: int = 0  # since start: blocks requests took from the prefix cache
    num_needed_blocks: int = 0  # since start: blocks admissions needed (reused + newly allocated)
    total_draft_tokens: int = 0  # since start: speculative draft tokens verified (TensorRT-LLM's names)
    total_accepted_draft_tokens: int = 0  # since start: of those, accepted
    timestamp_s: float = 0.0  # when this snapshot was taken: time.time(), seconds since the epoch


@dataclass
class _ResponseStream:
    """A client request's responses (all its sequences) and how many sequences have not finished yet."""

    num_open_sequences: int
    responses: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


class Executor:
    def __init__(self, engine, tokenizer: Tokenizer, config: ExecutorConfig | None = None,
                 trusted_keys=FROM_ENVIRONMENT) -> None:
        """``engine``: a loaded :class:`kilnlm.runtime.engine.Engine` (or anything with its ``manifest``,
        ``allocate_kv_cache``, ``kv_cache_bytes_per_block`` and ``forward``); ``trusted_keys``: the policy a
        ``speculative_config`` draft engine loads under (:meth:`from_engine_dir` passes the target's).
        Starts the loop thread."""
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config = config or ExecutorConfig()
        build = engine.manifest.build
        self.max_seq_len = build.max_seq_len
        self.vocab_size = engine.manifest.model.vocab_size
        self.eos_token_ids = frozenset(engine.manifest.generation.eos_token_ids)
        max_batch_size = _lower_limit("max_batch_size", config.max_batch_size, build.max_batch_size)
        max_num_tokens = _lower_limit("max_num_tokens", config.max_num_tokens, build.max_num_tokens)
        policy = BatchSchedulerPolicy.from_name(config.batch_scheduler_policy)
        if config.max_queue_size is not None and config.max_queue_size < 1:
            raise KilnError(f"max_queue_size={config.max_queue_size} must be >= 1 (or None for an unbounded queue)")
        self.max_batch_size = max_batch_size
        self.max_num_tokens = max_num_tokens
        max_blocks_per_seq = -(-build.max_seq_len // build.tokens_per_block)
        num_blocks = num_kv_cache_blocks(config.kv_cache_bytes, engine.kv_cache_bytes_per_block(), max_batch_size,
                                         build.max_seq_len, build.tokens_per_block, config.max_tokens_in_paged_kv_cache)
        self.kv_cache = engine.allocate_kv_cache(num_blocks)
        self.kv_manager = KVCacheManager(KVCacheConfig(num_blocks, build.tokens_per_block, config.enable_kv_cache_reuse))
        self.speculative_config = parse_speculative_config(config.speculative_config)
        proposer = make_proposer(self.speculative_config, engine, max_batch_size, trusted_keys)
        self.scheduler = Scheduler(SchedulerConfig(max_batch_size, max_num_tokens, policy, config.enable_chunked_context),
                                   self.kv_manager, proposer)
        self.sampler = Sampler()
        self.input_builder = InputBuilder(InputLimits(max_num_tokens, max_batch_size, max_blocks_per_seq, build.tokens_per_block))
        self.output_processor = OutputProcessor(tokenizer)
        self.guided_decoder = GuidedDecoder(tokenizer, self.vocab_size, self.eos_token_ids, max_batch_size)

        self._lock = threading.Condition()
        self._inbox: list[Request] = []
        self._cancels: set[int] = set()
        self._streams: dict[int, _ResponseStream] = {}  # client request id -> its responses
        self._next_id = itertools.count(1)
        self._stopping = False
        self._owned_engine = None  # the engine from_engine_dir loaded, closed by shutdown
        self._engine_error: str | None = None  # set when the engine broke (Engine.broken): the loop has stopped
        self._stats = IterationStats(num_free_blocks=num_blocks, num_total_blocks=num_blocks,
                                     max_num_active_requests=max_batch_size, tokens_per_block=build.tokens_per_block)
        # Loop-thread state.
        self._requests: dict[int, Request] = {}  # sequence's request id -> submitted, final response not yet sent
        self._held_sequences: dict[int, list[Request]] = {}  # n > 1: sequence 0's id -> sequences 1..n-1
        self._last_batch = _LastBatch()
        self._num_iterations = 0
        self._num_preemptions = 0
        self._num_draft_tokens = 0
        self._num_accepted_draft_tokens = 0
        # This thread's OpenMP workers (an engine's load copies its weights on them, from_engine_dir's and a
        # draft engine's alike) would slow every forward of the loop thread by 2x or more (kilnlm.runtime.openmp).
        release_calling_thread_workers()
        self._thread = threading.Thread(target=self._loop, name="kilnlm-executor", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_dir(cls, engine_dir: str | os.PathLike, config: ExecutorConfig | None = None,
                        trusted_keys=FROM_ENVIRONMENT) -> "Executor":
        """Verify and load the engine in ``engine_dir`` (``trusted_keys``: a
        :class:`~kilnlm.runtime.signing.TrustedKeys` its signature must match; by default
        ``$KILNLM_TRUSTED_KEYS``'s, None: no check; a ``speculative_config`` draft engine's must match too)
        and its tokenizer, and start the loop thread. The executor owns that engine: :meth:`shutdown` closes it
        (a tensor-parallel engine's other ranks stop). A new process that calls
        :func:`kilnlm.runtime.manifest.prehash_engine_files` before importing torch has the verification's
        SHA-256 checks done during the import."""
        from kilnlm.runtime.engine import TOKENIZER_DIR, Engine, verify_engine

        root = Path(engine_dir)
        manifest = verify_engine(root, trusted_keys)
        # The tokenizer parses (0.15 s for SmolLM2's, holding the GIL throughout) and compiles its chat template
        # (~40 ms of Python) while the engine's package loads, in the longest call of the load that releases the
        # GIL (Engine.load_verified's while_loading). Started with the load, the parse would hold the GIL while
        # the package's extraction waits for it between its copies: the two would run one after the other.
        loading = threading.Event()

        def prepare_tokenizer() -> Tokenizer:
            loading.wait()
            tokenizer = Tokenizer.from_dir(root / TOKENIZER_DIR)
            tokenizer.prepare_chat_template()
            return tokenizer

        with ThreadPoolExecutor(1, thread_name_prefix="kilnlm-tokenizer") as pool:
            tokenizer = pool.submit(prepare_tokenizer)
            try:
                engine = Engine.load_verified(root, manifest, while_loading=loading.set)
            finally:
                loading.set()  # a backend that does not call it, or a load that failed before it
        try:
            executor = cls(engine, tokenizer.result(), config, trusted_keys)
        except BaseException:
            engine.close()
            raise
        executor._owned_engine = engine
        return executor

    # ------------------------------------------------------------------------------- client API
    @property
    def engine_error(self) -> str | None:
        """Why the engine cannot run any more (:attr:`Engine.broken`: a tensor-parallel rank died), or None
        while it can. Once the loop has seen it, every request has failed with it and :meth:`submit` raises
        :class:`EngineError`. Servers exit on it."""
        return self._engine_error or getattr(self.engine, "broken", None)

    def submit(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> int:
        """Queue a request (``params.n`` sequences of it); returns its id. Thread-safe. Raises
        :class:`RequestError` for an empty prompt, a prompt of ``max_seq_len`` tokens or more, token ids
        outside the vocabulary, bad sampling params, more sequences (``n``) than ``max_batch_size``, a sequence that cannot fit the KV cache even alone, a
        ``guided_decoding`` guide that does not compile (or without xgrammar installed), or (without chunked
        context) a prompt longer than ``max_num_tokens``; :class:`QueueFullError` when ``max_queue_size``
        requests already wait for admission (retry later); :class:`EngineError` once the engine broke
        (:attr:`engine_error`).

        The KV-capacity check is per sequence, not for ``n`` at once: the sequences are separate requests
        to the scheduler, which admits what fits and queues (or preempts) the rest, so a request whose one
        sequence fits the pool alone always completes. Each waiting sequence counts against
        ``max_queue_size``."""
        params = params or SamplingParams()
        params.validate(self.vocab_size)
        if params.n > self.max_batch_size:
            raise RequestError(f"n (num_return_sequences) is {params.n:,}: at most max_batch_size={self.max_batch_size} "
                               "sequences per request")
        self.guided_decoder.check(params)
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
        if not self.config.enable_chunked_context and len(prompt) > self.max_num_tokens:
            raise RequestError(
                f"the prompt has {len(prompt):,} tokens but one step computes at most max_num_tokens="
                f"{self.max_num_tokens:,} and chunked context is off: enable chunked context "
                "(enable_chunked_context) or raise max_num_tokens"
            )
        max_num_tokens = min(len(prompt) + params.max_tokens, self.max_seq_len)
        capacity_tokens = self.kv_manager.num_total_blocks * self.kv_manager.tokens_per_block
        if max_num_tokens > capacity_tokens:
            raise RequestError(
                f"the request needs up to {max_num_tokens:,} tokens of KV cache but the pool holds "
                f"{capacity_tokens:,}: lower max_tokens or raise the executor's kv_cache_bytes "
                "(or max_tokens_in_paged_kv_cache)"
            )
        end_ids = frozenset() if params.ignore_eos else (frozenset({params.end_id}) if params.end_id is not None else self.eos_token_ids)
        with self._lock:
            # The engine is asked too, not only what the loop recorded: the loop fails a broken step's
            # requests before it records the error, and a client that saw those failures must not get a
            # new request accepted. After a shutdown (which closes an owned engine) the shutdown is the reason.
            engine_error = self._engine_error if self._stopping else self.engine_error
            if engine_error is not None:
                raise EngineError(f"the engine cannot run any more ({engine_error}): restart the server")
            if self._stopping:
                raise RequestError("the executor is shut down: create a new one")
            max_queue_size = self.config.max_queue_size
            if max_queue_size is not None and len(self._inbox) + self.scheduler.num_waiting >= max_queue_size:
                raise QueueFullError(f"the executor's queue is full: {max_queue_size:,} requests already wait for "
                                     "admission (max_queue_size): retry later")
            request_id = next(self._next_id)
            sequence_ids = [request_id] + [next(self._next_id) for _ in range(params.n - 1)]
            self._streams[request_id] = _ResponseStream(params.n)
            self._inbox += [Request(sequence_id, prompt, params, end_ids=end_ids, max_num_tokens=max_num_tokens,
                                    parent_request_id=request_id, sequence_index=i)
                            for i, sequence_id in enumerate(sequence_ids)]
            self._lock.notify()
        return request_id

    def stream(self, request_id: int, timeout_s: float | None = None) -> Iterator[Response]:
        """Yield the request's responses (of all its ``n`` sequences, interleaved; ``Response.sequence_index``
        tells them apart) until every sequence's finished one. Raises :class:`RequestError` for an unknown
        (or already fully streamed) id and ``TimeoutError`` if no response arrives within ``timeout_s``."""
        with self._lock:
            stream = self._streams.get(request_id)
        if stream is None:
            raise RequestError(f"request {request_id} is unknown or its responses were already consumed")
        while True:
            try:
                response = stream.responses.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no response for request {request_id} within {timeout_s} s") from None
            if response.finished:
                stream.num_open_sequences -= 1
                if stream.num_open_sequences == 0:
                    with self._lock:
                        self._streams.pop(request_id, None)
            yield response
            if stream.num_open_sequences == 0:
                return

    def generate(self, prompt_token_ids: list[int], params: SamplingParams | None = None, timeout_s: float | None = None) -> Response:
        """Submit and wait; the returned response holds all output token ids, the full text and (when
        asked) all log-probs. Raises :class:`RequestError` for ``n > 1``: use :meth:`generate_all`."""
        if params is not None and params.n > 1:
            raise RequestError(f"n is {params.n}: generate returns one sequence; use generate_all for n > 1")
        return self.generate_all(prompt_token_ids, params, timeout_s)[0]

    def generate_all(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                     timeout_s: float | None = None) -> list[Response]:
        """Submit and wait for all ``params.n`` sequences: one whole-result response per sequence (as
        :meth:`generate` returns), in ``sequence_index`` order."""
        request_id = self.submit(prompt_token_ids, params)
        per_sequence: dict[int, list[Response]] = {}
        for response in self.stream(request_id, timeout_s):
            per_sequence.setdefault(response.sequence_index, []).append(response)
        return [_merge(per_sequence[i]) for i in sorted(per_sequence)]

    def cancel(self, request_id: int) -> None:
        """Finish the request (every one of its ``n`` sequences) with reason "cancelled"; its blocks return
        to the pool before the next iteration. Thread-safe; a no-op for finished or unknown ids."""
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
        if self._owned_engine is not None and not self._thread.is_alive():
            self._owned_engine.close()

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
                # Under the lock, so that submit counts every request waiting for admission exactly once
                # (inbox + waiting queue; the lock is re-entrant for the responses of cancelled requests).
                self._accept(new_requests, cancels)
            if self.scheduler.has_work():
                try:
                    self.step()
                except Exception as exc:  # a bug outside any one request: fail everything live, keep serving
                    logger.exception("executor iteration failed")
                    for request in list(self._requests.values()):
                        self._finish(request, FinishReason.ERROR, f"executor iteration failed: {exc!r}")
                broken = self.engine_error
                if broken is not None:  # e.g. a tensor-parallel rank died: nothing can run any more
                    logger.error("the engine cannot run any more (%s): failing every request and stopping", broken)
                    with self._lock:
                        self._engine_error = broken
                        self._stopping = True
            self._publish_stats()
        with self._lock:
            new_requests, self._inbox = self._inbox, []
            self._accept(new_requests, set())
        for request in list(self._requests.values()):
            if self._engine_error is None:
                self._finish(request, FinishReason.CANCELLED)
            else:
                self._finish(request, FinishReason.ERROR, f"the engine cannot run any more: {self._engine_error}")
        self._publish_stats()

    def _accept(self, new_requests: list[Request], cancels: set[int]) -> None:
        for request in new_requests:
            self._requests[request.request_id] = request
            self.output_processor.add_request(request)
            try:
                self.guided_decoder.add_request(request)
            except KilnError as exc:  # its guide compiled at submit; only a failing recompile gets here
                self._finish(request, FinishReason.ERROR, str(exc))
                continue
            if request.sequence_index == 0 or not self._shares_prompt_blocks(request):
                self.scheduler.add(request)
            else:  # waits for sequence 0's prompt blocks (_release_held_sequences)
                self._held_sequences.setdefault(request.parent_request_id, []).append(request)
        if cancels:
            for request in [r for r in self._requests.values() if r.parent_request_id in cancels]:
                self._finish(request, FinishReason.CANCELLED)

    def _shares_prompt_blocks(self, request: Request) -> bool:
        """Whether sequences 1..n-1 of ``request``'s client request can reuse sequence 0's prompt blocks:
        prefix reuse is on and the prompt has a full block before its last token (the one always computed)."""
        return self.config.enable_kv_cache_reuse and request.num_prompt_tokens - 1 >= self.kv_manager.tokens_per_block

    def _release_held_sequences(self, request: Request) -> None:
        """Queue the sequences held back for ``request`` (sequence 0 of an ``n > 1`` request), now that
        its prompt was computed -- or that it finished, after which they compute what they need."""
        for sequence in self._held_sequences.pop(request.request_id, ()):
            if not sequence.finished:
                self.scheduler.add(sequence)

    def step(self) -> None:
        """One iteration. Runs on the loop thread."""
        start_s = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch:
            return
        logits = self._forward(batch)
        if logits is None:
            return
        updated = self._update(batch, self._sample(batch, logits))
        self._record_iteration(batch, time.perf_counter() - start_s)
        self._respond(updated)

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

    def _sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> list[list[int]]:
        """The tokens of each sequence whose pending tokens were all computed, in batch order (a non-final
        context chunk's logits are dropped): one sampled token, or for a sequence with draft tokens the
        verification's 1 to k + 1 (:meth:`_verify_drafts`); each request's ``last_logprobs`` set. Empty
        after failing those requests if sampling fails.

        ``logits`` holds one row per sequence, plus one per draft token after its sequence's row."""
        first_rows, completing, row = [], [], 0
        for seq in batch.seqs:
            if seq.completes_sequence:
                first_rows.append(row)
                completing.append(seq)
            row += 1 + len(seq.draft_token_ids)
        if not completing:
            return []
        requests = [seq.request for seq in completing]
        try:
            token_bitmask = self.guided_decoder.fill_token_bitmask(requests)
            sampled = self.sampler.sample(logits if len(first_rows) == len(logits) else logits[first_rows], requests,
                                          token_bitmask)
            step_tokens = [[token] for token in sampled.token_ids]
            if batch.num_draft_tokens:
                self._verify_drafts(completing, first_rows, logits, step_tokens)
        except Exception as exc:
            logger.exception("sampling failed")
            for request in requests:
                self._finish(request, FinishReason.ERROR, f"sampling failed: {exc!r}")
            return []
        for request, entry in zip(requests, sampled.logprobs):
            request.last_logprobs = entry
        return step_tokens

    def _verify_drafts(self, seqs: list, first_rows: list[int], logits: torch.Tensor, step_tokens: list[list[int]]) -> None:
        """Replace each speculating sequence's sampled token by what verifying its drafts yields, in place: a
        greedy one's argmax extended by the argmax after each accepted draft (:func:`verify_greedy`), a
        sampling one's draws by the rejection rule over its rows' sampling distributions
        (:func:`verify_sampled`); count drafts and acceptances."""
        for seq, row, tokens in zip(seqs, first_rows, step_tokens):
            num_drafts = len(seq.draft_token_ids)
            if not num_drafts:
                continue
            request = seq.request
            if request.params.greedy:
                draft_argmax = logits[row + 1 : row + 1 + num_drafts].numpy().argmax(axis=-1).tolist()
                tokens[:] = verify_greedy(tokens[0], seq.draft_token_ids, draft_argmax)
            else:
                probs = self.sampler.sampling_probs(logits[row : row + 1 + num_drafts], [request] * (num_drafts + 1))
                tokens[:] = verify_sampled(probs, seq.draft_token_ids, request.generator)
            self._num_draft_tokens += num_drafts
            self._num_accepted_draft_tokens += len(tokens) - 1

    def _update(self, batch: ScheduledBatch, sampled_token_ids: list[list[int]]) -> list[Request]:
        """Apply the step to the requests (:meth:`Scheduler.update`) and advance the guided ones' grammar
        matchers; a request whose matcher rejects its token finishes with reason "error". Returns the
        requests that got a token and are still to be responded to."""
        updated = self.scheduler.update(batch, sampled_token_ids)
        rejected = self.guided_decoder.accept_tokens(updated)
        if not rejected:
            return updated
        for request, message in rejected:
            self._finish(request, FinishReason.ERROR, message)
        failed = {request for request, _ in rejected}
        return [request for request in updated if request not in failed]

    def _respond(self, requests: list[Request]) -> None:
        """Make the responses of the requests that got a token (the output processor), finish those a stop
        string ended, then emit. A request whose response fails finishes with reason "error" alone."""
        responses: list[Response] = []
        any_finished = False
        for request in requests:
            if request.request_id in self._held_sequences:
                self._release_held_sequences(request)
            try:
                response = self.output_processor.process(request)
            except Exception as exc:
                logger.exception("request %d failed", request.request_id)
                self.scheduler.finish(request, FinishReason.ERROR, f"request handling failed: {exc!r}")
                response = self.output_processor.final_response(request)
            response.queue_time_s = _queue_time_s(request)
            if response.finished:
                if not request.finished:  # a stop string ended it
                    self.scheduler.finish(request, response.finish_reason)
                del self._requests[request.request_id]
                self.guided_decoder.remove_request(request)
                any_finished = True
            responses.append(response)
        if any_finished:
            self._publish_stats()  # a client that saw its final response sees the blocks back in stats()
        self._emit(responses)

    def _record_iteration(self, batch: ScheduledBatch, iteration_s: float) -> None:
        num_generation = batch.num_generation_seqs
        self._last_batch = _LastBatch(batch.num_tokens, len(batch.seqs), len(batch.seqs) - num_generation,
                                      batch.num_context_tokens, num_generation, len(batch.preempted), iteration_s)
        self._num_iterations += 1
        self._num_preemptions += len(batch.preempted)

    def _finish(self, request: Request, reason: FinishReason, error: str | None = None) -> None:
        """End a live request outside the token path (cancelled, failed, shut down): free its blocks and
        send its final response (all text still held back). A no-op once its final response was sent."""
        if self._requests.pop(request.request_id, None) is None:
            return
        self._release_held_sequences(request)
        self.guided_decoder.remove_request(request)
        self.scheduler.finish(request, reason, error)
        response = self.output_processor.final_response(request)
        response.queue_time_s = _queue_time_s(request)
        self._publish_stats()  # a client that saw its final response sees the blocks back in stats()
        self._emit([response])

    def _emit(self, responses: list[Response]) -> None:
        with self._lock:
            for response in responses:
                stream = self._streams.get(response.request_id)
                if stream is not None:
                    stream.responses.put(response)

    def _publish_stats(self) -> None:
        last, kv = self._last_batch, self.kv_manager
        with self._lock:
            self._stats = IterationStats(
                num_active_requests=self.scheduler.num_running,
                max_num_active_requests=self.max_batch_size,
                num_queued=self.scheduler.num_waiting + len(self._inbox),
                num_free_blocks=kv.num_free_blocks,
                num_total_blocks=kv.num_total_blocks,
                num_cached_blocks=kv.num_cached_blocks,
                tokens_per_block=kv.tokens_per_block,
                num_iterations=self._num_iterations,
                last_num_tokens=last.num_tokens,
                last_num_seqs=last.num_seqs,
                last_num_context_requests=last.num_context_requests,
                last_num_context_tokens=last.num_context_tokens,
                last_num_generation_requests=last.num_generation_requests,
                last_num_paused_requests=last.num_paused_requests,
                last_iteration_s=last.iteration_s,
                num_preemptions=self._num_preemptions,
                num_reused_blocks=kv.num_reused_blocks,
                num_needed_blocks=kv.num_needed_blocks,
                total_draft_tokens=self._num_draft_tokens,
                total_accepted_draft_tokens=self._num_accepted_draft_tokens,
                timestamp_s=time.time(),
            )


@dataclass(frozen=True)
class _LastBatch:
    """What the last iteration ran (loop-thread state behind IterationStats' ``last_*`` fields)."""

    num_tokens: int = 0
    num_seqs: int = 0
    num_context_requests: int = 0
    num_context_tokens: int = 0
    num_generation_requests: int = 0
    num_paused_requests: int = 0
    iteration_s: float = 0.0


def _queue_time_s(request: Request) -> float | None:
    """Seconds from the request's arrival to its first admission (None while it never was admitted)."""
    if request.first_scheduled_time_s is None:
        return None
    return request.first_scheduled_time_s - request.arrival_time_s


def _merge(responses: list[Response]) -> Response:
    """One sequence's streamed responses as one: all token ids, text and log-probs, the last one's rest."""
    return replace(responses[-1], token_ids=[t for r in responses for t in r.token_ids],
                   text="".join(r.text for r in responses),
                   log_probs=[p for r in responses for p in r.log_probs],
                   top_logprobs=[p for r in responses for p in r.top_logprobs])


def _lower_limit(name: str, requested: int | None, built: int) -> int:
    if requested is None:
        return built
    if not (1 <= requested <= built):
        raise KilnError(f"{name}={requested} must be between 1 and the engine's build limit {built}: lower it or rebuild the engine")
    return requested
