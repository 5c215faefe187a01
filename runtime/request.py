"""Requests as the executor sees them: what the client asked for (``SamplingParams``), the live state of one
sequence (``Request``) and what is streamed back (``Response``).

A request's tokens and how far the engine has computed them::

    token_ids           | prompt tokens ............ | generated tokens ... |
    num_computed_tokens |<--- K/V written in pool -->|                      (<= num_tokens)
    pending             |                             |<-- next step's new --|

A request in the *context phase* has many pending tokens (computed in chunks); in the *generation phase*
exactly one (the last sampled token). Preemption (free and recompute) just sets ``num_computed_tokens``
back to 0, so the prompt and the tokens generated so far are recomputed as one context.
"""

from __future__ import annotations

import enum
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
class SamplingParams:
    """How one request samples and when it stops.

    ``temperature`` 0 means greedy (argmax); ``top_k`` 0 and ``top_p`` 1.0 disable those filters.
    ``seed`` makes sampling reproducible and independent of which other requests share the batch (each
    request owns a ``torch.Generator``); ``None`` draws a random seed. ``end_id`` replaces the engine's EOS
    ids as the end token(s); ``ignore_eos`` generates exactly ``max_tokens`` tokens. ``stop`` holds string
    stop sequences (the output is truncated before the first one, finish reason "stop");
    ``bad_words`` holds token-id sequences that are never generated (the last token of a sequence is
    banned whenever the output ends with the rest of it).
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
        for word in self.bad_words:
            if not word or any(not (0 <= t < vocab_size) for t in word):
                raise RequestError(f"bad_words entry {list(word)} must be a non-empty list of token ids in [0, {vocab_size})")


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no KV blocks
    RUNNING = "running"  # admitted, holds KV blocks
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence inside the executor. Owned by the executor's loop thread once submitted. Compared by
    identity (the scheduler looks requests up in its queues)."""

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
    first_token_time_s: float | None = None
    generator: torch.Generator | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        if not self.params.greedy:
            seed = self.params.seed if self.params.seed is not None else secrets.randbits(63)
            self.generator = torch.Generator().manual_seed(seed)

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
    """

    request_id: int
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_generated_tokens: int
    error: str | None = None
