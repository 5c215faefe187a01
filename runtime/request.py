"""Requests as the executor sees them: what the client asked for (``SamplingParams``), the live state of one
sequence (``Request``) and what is streamed back (``Response``).

A request's tokens and how far the engine has computed them::

    token_ids           | prompt tokens ............ | generated tokens ... |
    num_computed_tokens |<--- K/V written in pool -->|                      (<= num_tokens)
    pending             |                             |<-- next step's new --|

A request in the *context phase* has many pending tokens (computed in chunks); in the *generation phase*
exactly one (the last sampled token). Preemption (free and recompute) just sets ``num_computed_tokens``
back to 0, so the prompt and the tokens generated so far are recomputed as one context.

A client request with ``SamplingParams.n = k`` (TensorRT-LLM's ``num_return_sequences``) becomes k
``Request``\\ s, one per sequence, as TensorRT-LLM makes child requests: sequence 0 carries the client's
request id, sequences 1..k-1 ids of their own (the KV-cache manager and the scheduler key on
``request_id``); all carry ``parent_request_id`` (the client's id, which every ``Response`` reports) and
their ``sequence_index``. With a ``seed``, sequence i samples with :func:`sequence_seed` ``(seed, i)``.
"""

from __future__ import annotations

import enum
import hashlib
import math
import secrets
import time
from dataclasses import dataclass, field

import torch

from kilnlm.runtime.errors import RequestError


class FinishReason(str, enum.Enum):
    END_ID = "end_id"  # an end id (the request's end_id or the engine's EOS ids) was sampled
    STOP = "stop"  # a stop string appeared in the output (the output is cut before it)
    LENGTH = "length"  # max_tokens generated, or the sequence reached the engine's max_seq_len
    CANCELLED = "cancelled"
    ERROR = "error"


@dataclass(frozen=True)
class GuidedDecodingParams:
    """Structured output: every generated token keeps the output a prefix of the grammar's language.

    ``guide_type`` (TensorRT-LLM's ``guided_decoding_guide_type`` values): "json" (any JSON value),
    "json_schema" (``guide`` is a JSON schema, as text), "regex" (``guide`` is a regular expression),
    "ebnf_grammar" (``guide`` is a grammar in xgrammar's EBNF). Compiled and enforced with xgrammar.
    """

    guide_type: str
    guide: str | None = None

    GUIDE_TYPES = ("json", "json_schema", "regex", "ebnf_grammar")

    def validate(self) -> None:
        if self.guide_type not in self.GUIDE_TYPES:
            raise RequestError(f"guided_decoding_guide_type is {self.guide_type!r}: it must be one of "
                               f"{', '.join(self.GUIDE_TYPES)}")
        if self.guide_type != "json" and not self.guide:
            raise RequestError(f"guided_decoding_guide_type {self.guide_type!r} needs a guide (the schema, "
                               "regular expression or grammar text)")


MAX_LOGPROBS = 20  # most top alternatives a request may ask log-probabilities for (OpenAI's limit)
# Stop sequences: each is searched for after every token and may hold text back, so their number and length
# are bounded (OpenAI takes 4; TensorRT-LLM's clients send a handful).
MAX_STOP_SEQUENCES = 64
MAX_STOP_CHARS = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature`` 0 means greedy (argmax); ``top_k`` 0 and ``top_p`` 1.0 disable those filters.
    ``seed`` makes sampling reproducible and independent of which other requests share the batch (each
    request owns a ``torch.Generator``); ``None`` draws a random seed. ``end_id`` replaces the engine's EOS
    ids as the end token(s); ``ignore_eos`` generates exactly ``max_tokens`` tokens. ``stop`` holds string
    stop sequences (the output is truncated before the first one, finish reason "stop");
    ``bad_words`` holds token-id sequences that are never generated (the last token of a sequence is
    banned whenever the output ends with the rest of it).

    ``repetition_penalty`` (1.0 = off), ``presence_penalty`` and ``frequency_penalty`` (0.0 = off) adjust
    the logits of tokens already seen (see :mod:`kilnlm.runtime.sampler` for each definition and source);
    ``min_tokens`` suppresses the end ids until that many tokens are generated; ``n`` samples that many
    sequences of the prompt (TensorRT-LLM's ``num_return_sequences``); ``logprobs`` ``None`` returns no
    log-probabilities, ``k`` in ``[0, MAX_LOGPROBS]`` returns each generated token's log-probability and
    its ``k`` most likely alternatives (from the model's distribution, before temperature and penalties);
    ``guided_decoding`` constrains the output to a grammar (structured output); ``num_speculative_tokens``
    caps the draft tokens verified per step for this request where the executor speculates
    (:mod:`kilnlm.runtime.speculative`): None takes the executor's speculative config as it is, 0 turns
    speculation off for the request, n drafts at most ``min(n, the config's num_speculative_tokens)``.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    end_id: int | None = None
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    bad_words: tuple[tuple[int, ...], ...] = ()
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None
    guided_decoding: GuidedDecodingParams | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from callers (JSON, Triton tensors) but keep the object hashable and immutable.
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "bad_words", tuple(tuple(int(t) for t in w) for w in self.bad_words))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise :class:`RequestError` naming the offending parameter and its allowed range."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestError(f"max_tokens is {self.max_tokens!r}: it must be an integer >= 1")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise RequestError(f"temperature is {self.temperature!r}: it must be >= 0 (0 means greedy)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k is {self.top_k!r}: it must be an integer >= 0 (0 disables top-k)")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestError(f"top_p is {self.top_p!r}: it must be in (0, 1] (1 disables top-p)")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise RequestError(f"seed is {self.seed!r}: it must be an integer in [0, 2**63)")
        if self.end_id is not None and not (0 <= self.end_id < vocab_size):
            raise RequestError(f"end_id {self.end_id} is outside the vocabulary [0, {vocab_size})")
        if any(not s for s in self.stop):
            raise RequestError("stop contains an empty string: every stop sequence needs at least one character")
        if len(self.stop) > MAX_STOP_SEQUENCES or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            raise RequestError(f"stop has {len(self.stop):,} sequences of up to {max(map(len, self.stop)):,} characters: "
                               f"at most {MAX_STOP_SEQUENCES} sequences of at most {MAX_STOP_CHARS} characters each")
        for word in self.bad_words:
            if not word or any(not (0 <= t < vocab_size) for t in word):
                raise RequestError(f"bad_words entry {list(word)} must be a non-empty list of token ids in [0, {vocab_size})")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise RequestError(f"repetition_penalty is {self.repetition_penalty!r}: it must be > 0 (1.0 disables it)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):
                raise RequestError(f"{name} is {getattr(self, name)!r}: it must be a finite number (0.0 disables it)")
        if not isinstance(self.min_tokens, int) or not (0 <= self.min_tokens <= self.max_tokens):
            raise RequestError(f"min_tokens is {self.min_tokens!r}: it must be an integer in [0, max_tokens={self.max_tokens}]")
        if not isinstance(self.n, int) or self.n < 1:
            raise RequestError(f"n (num_return_sequences) is {self.n!r}: it must be an integer >= 1")
        if self.logprobs is not None and not (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS):
            raise RequestError(f"logprobs is {self.logprobs!r}: it must be an integer in [0, {MAX_LOGPROBS}]")
        if self.guided_decoding is not None:
            self.guided_decoding.validate()
        if self.num_speculative_tokens is not None and not (isinstance(self.num_speculative_tokens, int)
                                                            and self.num_speculative_tokens >= 0):
            raise RequestError(f"num_speculative_tokens is {self.num_speculative_tokens!r}: it must be an integer >= 0 "
                               "(0 turns speculative decoding off for the request)")


def sequence_seed(seed: int, sequence_index: int) -> int:
    """The seed of sequence ``sequence_index`` of a request seeded with ``seed``: ``seed`` itself for
    sequence 0 (so ``n=1`` and the first of ``n`` sequences draw the same tokens), else the first 8 bytes of
    ``SHA-256(f"{seed}:{sequence_index}")`` as a little-endian integer modulo 2**63 (distinct, deterministic,
    and unrelated to the sequences of a request seeded ``seed + 1``)."""
    if sequence_index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{sequence_index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % 2**63


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's ``log_prob`` (natural log, of the raw logits' softmax) and its ``top_logprobs``
    ``{token_id: log-prob}``: the ``SamplingParams.logprobs`` most likely tokens, most likely first."""

    log_prob: float
    top_logprobs: dict[int, float]


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # admitted, holds KV blocks
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence inside the executor. Owned by the executor's loop thread once submitted. Compared by
    identity (the scheduler looks requests up in its queues).

    ``parent_request_id`` (the client's request id; defaults to ``request_id``) and ``sequence_index``
    place it among the ``n`` sequences of its client request. ``last_logprobs`` is the log-prob entry of
    the token the sampler gave it in the latest step (None when ``params.logprobs`` is None);
    ``cum_log_prob`` sums the log-probs of its generated tokens (an end id that finished it excluded).
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    end_ids: frozenset[int]  # token ids that end this request (empty when ignore_eos)
    max_num_tokens: int  # prompt + generated tokens this request may reach (max_tokens, max_seq_len)
    token_ids: list[int] = field(default_factory=list)  # prompt + generated
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error_message: str | None = None
    output_text: str = ""  # detokenized output so far (before stop-string truncation is applied)
    num_text_sent: int = 0  # characters of output_text already streamed
    num_preemptions: int = 0
    arrival_time_s: float = field(default_factory=time.monotonic)
    first_scheduled_time_s: float | None = None  # first admission (KV blocks granted); queue time ends there
    first_token_time_s: float | None = None
    generator: torch.Generator | None = None
    parent_request_id: int | None = None
    sequence_index: int = 0
    last_logprobs: TokenLogprobs | None = None
    cum_log_prob: float = 0.0
    num_step_tokens: int = 0  # tokens appended to token_ids by the latest step (several when speculating)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if self.parent_request_id is None:
            self.parent_request_id = self.request_id
        if not self.params.greedy:
            seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator().manual_seed(sequence_seed(seed, self.sequence_index))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose K/V is not yet in the pool (1 in the generation phase)."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED


@dataclass
class Response:
    """One streamed update of a request (or, from ``Executor.generate``, its whole result).

    ``token_ids`` and ``text`` are what is new since the previous response of this request; end ids are
    not part of either, and text held back (an incomplete UTF-8 character, a possible start of a stop
    string) arrives with a later response. ``error`` is set when ``finish_reason`` is "error".

    ``sequence_index``: which of the request's ``n`` sequences this response belongs to (``finished``
    is per sequence; the request's stream ends after every sequence's final response). When the request
    asked for ``logprobs``: ``log_probs[i]`` is the natural-log probability of ``token_ids[i]`` and
    ``top_logprobs[i]`` its ``logprobs`` most likely alternatives ``{token_id: log-prob}``;
    ``cum_log_prob`` is the sum over every token generated so far in this sequence (the log-probs are
    those of the model's distribution: the raw logits' ``log_softmax``, before penalties and temperature;
    an end id that finished the sequence is in neither ``token_ids`` nor the log-probs). Without
    ``logprobs`` the lists stay empty and ``cum_log_prob`` None.

    ``queue_time_s``: seconds from the request's arrival (``submit``) to its first admission by the
    scheduler; set on every response once the request was admitted (None on the final response of a
    request cancelled or failed while it waited).
    """

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_generated_tokens: int
    error: str | None = None
    sequence_index: int = 0
    log_probs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)
    cum_log_prob: float | None = None
    queue_time_s: float | None = None
