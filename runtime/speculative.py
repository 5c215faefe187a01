"""Speculative decoding: draft tokens proposed cheaply, verified by the engine in one packed forward.

A generation-phase request that speculates brings its last token plus ``k`` draft tokens into the step; the
engine returns logits for each of those ``k + 1`` positions (``logits_indices``), and the draft is accepted
up to the first position where the target model's own choice differs, that choice then standing in for the
draft (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding"; for greedy
requests the rule reduces to comparing each draft token with the argmax). A step thus yields between 1 and
``k + 1`` tokens, exactly the tokens non-speculative greedy decoding produces. The KV slots of rejected
drafts are given back (:meth:`kilnlm.runtime.kv_cache.KVCacheManager.trim_slots`) and only accepted tokens'
full blocks enter the prefix cache.

The proposer (vLLM's ``--speculative-config`` JSON, :func:`parse_speculative_config`):

- ``{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": n_max, "prompt_lookup_min": n_min}``:
  prompt lookup decoding (Saxena 2023; vLLM's ``ngram``): the longest suffix of the request's tokens (prompt
  and output) of ``n_max`` down to ``n_min`` tokens that occurred earlier in them proposes the ``k`` tokens
  that followed its most recent earlier occurrence. It costs no model and pays where the output copies its
  input (summaries, edits, code changes).
- ``{"method": "draft", "model": DIR, "num_speculative_tokens": k}``: a draft model (Leviathan et al. 2023;
  vLLM's ``draft_model``): the kilnlm engine in ``DIR``, of the same vocabulary (e.g. the int4_awq engine of
  the target's own checkpoint, a "self-draft"), greedily decodes ``k`` tokens after the request's tokens.
  It runs in the executor's thread with its own paged KV pool (:class:`DraftModelProposer`), one sequence
  per forward: it catches up on the tokens the request gained since its last draft (the accepted drafts and
  the step's own token), then takes ``k - 1`` one-token steps. It pays where a draft step costs a small
  fraction of a target step.

Verification (:func:`verify_greedy`, :func:`verify_sampled`): a greedy request accepts a draft token while it
is the argmax; a sampling request accepts draft token ``d`` at a position with probability ``p(d)``, ``p``
being the distribution it would draw from there (temperature, top-k, top-p), and at the first rejection
draws from ``p`` with ``d`` removed, renormalised; after its last accepted draft it draws a bonus token from
``p``. That is speculative sampling's rejection rule (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023,
"Accelerating Large Language Model Decoding with Speculative Sampling") for a draft distribution that puts
all its mass on the proposed token, which keeps every output token distributed exactly as without
speculation.

Which requests speculate: those without penalties, ``min_tokens``, ``bad_words``, log-probabilities or guided
decoding (their distribution depends on the tokens before each position, which verification does not
re-derive per draft), and not with ``SamplingParams.num_speculative_tokens`` 0 (which a request also uses to
draft fewer tokens than the config's).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.request import Request
from kilnlm.runtime.signing import FROM_ENVIRONMENT

logger = logging.getLogger(__name__)

SPECULATIVE_METHODS = ("ngram", "draft")
# The fields each method takes, beside ``method`` (integers >= 1 unless listed in _STRING_FIELDS or
# _PROBABILITY_FIELDS).
_METHOD_FIELDS = {"ngram": ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"),
                  "draft": ("num_speculative_tokens", "model", "disable_by_batch_size", "draft_p_min")}
_STRING_FIELDS = ("model",)
_PROBABILITY_FIELDS = ("draft_p_min",)  # numbers in (0, 1]


@dataclass(frozen=True)
class SpeculativeConfig:
    """A parsed ``speculative_config`` (vLLM's field names): ``method`` (one of :data:`SPECULATIVE_METHODS`),
    ``num_speculative_tokens`` (draft tokens per step, k >= 1), ``prompt_lookup_max`` / ``prompt_lookup_min``
    (the n-gram sizes the ``ngram`` method matches, 1 <= min <= max), ``model`` (the ``draft`` method's
    engine directory), ``disable_by_batch_size`` (no drafts in a step while more requests than this run;
    None: no limit), ``draft_p_min`` (the ``draft`` method stops drafting for a sequence after a token its
    model gave a probability below this, llama.cpp's ``--draft-p-min``; the token is still proposed, its
    forward being spent; None: always ``num_speculative_tokens``)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1
    model: str | None = None
    disable_by_batch_size: int | None = None
    draft_p_min: float | None = None


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """``text``: vLLM's ``--speculative-config`` JSON (or the dict it holds); None or empty turns speculation
    off. Raises :class:`KilnError` naming the field for malformed JSON, an unknown method or field, or a
    count out of range."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return None
    try:
        spec = json.loads(text) if isinstance(text, str) else dict(text)
    except json.JSONDecodeError as exc:
        raise KilnError(f"speculative_config is not JSON ({exc.msg} at character {exc.pos}): pass e.g. "
                        '{"method": "ngram", "num_speculative_tokens": 4}') from None
    if not isinstance(spec, dict):
        raise KilnError(f"speculative_config must be a JSON object, got {type(spec).__name__}")
    method = spec.pop("method", None)
    if method not in SPECULATIVE_METHODS:
        raise KilnError(f"speculative_config method is {method!r}: it must be one of {', '.join(SPECULATIVE_METHODS)}")
    known = _METHOD_FIELDS[method]
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise KilnError(f"speculative_config has unknown fields {unknown} for method {method!r}: it takes {', '.join(known)}")
    if "num_speculative_tokens" not in spec:
        raise KilnError("speculative_config needs num_speculative_tokens (draft tokens per step, e.g. 4)")
    if method == "draft" and "model" not in spec:
        raise KilnError("speculative_config method 'draft' needs model: the draft engine's directory")
    values = {}
    for name in known:
        if name in spec:
            value = spec[name]
            if name in _STRING_FIELDS:
                if not isinstance(value, str) or not value:
                    raise KilnError(f"speculative_config {name} is {value!r}: it must be a non-empty string")
            elif name in _PROBABILITY_FIELDS:
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 1:
                    raise KilnError(f"speculative_config {name} is {value!r}: it must be a probability in (0, 1]")
                value = float(value)
            elif not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KilnError(f"speculative_config {name} is {value!r}: it must be an integer >= 1")
            values[name] = value
    config = SpeculativeConfig(method=method, **values)
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise KilnError(f"speculative_config prompt_lookup_min {config.prompt_lookup_min} exceeds prompt_lookup_max "
                        f"{config.prompt_lookup_max}")
    return config


def resolve_draft_model(text: str | None, base_dir: str | os.PathLike) -> str | None:
    """``text`` (a ``speculative_config`` JSON) with a relative draft ``model`` directory made absolute under
    ``base_dir``, else ``text`` unchanged. The Triton model resolves it against its model directory, as it
    does its ``engine_dir`` parameter, so a draft engine can sit in the model repository beside the target.
    Raises :class:`KilnError` as :func:`parse_speculative_config` does."""
    config = parse_speculative_config(text)
    if config is None or config.model is None or Path(config.model).is_absolute():
        return text
    return json.dumps({**json.loads(text), "model": str(Path(base_dir) / config.model)})


def speculates(request: Request) -> bool:
    """Whether ``request``'s distribution at a draft position depends only on that position's logits: no
    penalties, ``min_tokens``, ``bad_words``, log-probabilities or guided decoding."""
    p = request.params
    return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and p.min_tokens == 0 and not p.bad_words and p.logprobs is None and p.guided_decoding is None)


class Proposer:
    """What the scheduler asks for draft tokens (:meth:`propose`, :meth:`propose_batch`) and tells when a
    request's state may go (:meth:`release`). Called from the executor's thread only. ``config``: its
    :class:`SpeculativeConfig`."""

    config: SpeculativeConfig

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        """Up to ``max_tokens`` draft tokens continuing ``request.token_ids`` (none is always allowed)."""
        raise NotImplementedError

    def propose_batch(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        """:meth:`propose` for each ``(request, max_tokens)`` of one step, in order (a proposer that batches
        its work across requests overrides this)."""
        return [self.propose(request, max_tokens) for request, max_tokens in items]

    def release(self, request_id: str) -> None:
        """``request_id`` finished, was cancelled or preempted: drop what the proposer holds for it."""


class NgramProposer(Proposer):
    """Prompt lookup decoding (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return self.lookup(request.token_ids, max_tokens)

    def lookup(self, token_ids: list[int], max_tokens: int) -> list[int]:
        """Up to ``min(max_tokens, num_speculative_tokens)`` draft tokens continuing ``token_ids``: for n from
        ``prompt_lookup_max`` down to ``prompt_lookup_min``, the tokens after the most recent earlier
        occurrence of the last n tokens (fewer when that occurrence is near the end); none without a match."""
        k = min(max_tokens, self.config.num_speculative_tokens)
        if k <= 0 or len(token_ids) < 2:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.config.prompt_lookup_max, len(tokens) - 1), self.config.prompt_lookup_min - 1, -1):
            suffix = tokens[-n:]
            # windows[i] = tokens[i:i+n] for the starts i whose match is followed by at least one token
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            starts = np.flatnonzero((windows == suffix).all(axis=1))
            if len(starts):
                follow = int(starts[-1]) + n
                return tokens[follow : follow + k].tolist()
        return []


@dataclass
class _DraftSequence:
    token_ids: list[int]  # the tokens whose K/V are in the draft pool, in order from position 0
    blocks: list[int]  # the draft pool's blocks of this sequence, in position order


class DraftModelProposer(Proposer):
    """Draft tokens from a second engine (see the module docstring), greedy, for all of a step's requests
    at once: their catch-up tokens packed into as few forwards as the draft's ``max_num_tokens`` and
    ``max_batch_size`` allow, then one forward per draft position over every request still drafting (with
    ``draft_p_min``: until it drafts a token its model gave a probability below that).

    ``engine``: a loaded :class:`kilnlm.runtime.engine.Engine` (or anything with its ``manifest``,
    ``forward``, ``allocate_kv_cache``), its vocabulary ``vocab_size`` (the target's). Its KV pool holds
    ``min(max_batch_size, the draft engine's max_batch_size)`` sequences of the draft's ``max_seq_len``
    tokens (``max_batch_size``: the target executor's, None for the draft's own). A request whose tokens
    plus drafts exceed the draft's ``max_seq_len``, or that finds the pool full, gets no drafts (and is
    served as without speculation); so do a step's requests when the draft engine's forward fails (logged).
    Raises :class:`KilnError` when the vocabularies differ."""

    def __init__(self, config: SpeculativeConfig, engine, vocab_size: int, max_batch_size: int | None = None) -> None:
        model, build = engine.manifest.model, engine.manifest.build
        if model.vocab_size != vocab_size:
            raise KilnError(f"the draft engine {config.model or ''} has a vocabulary of {model.vocab_size:,} tokens, the "
                            f"target's {vocab_size:,}: a draft model must share the target's tokenizer")
        self.config, self.engine = config, engine
        self.tokens_per_block = build.tokens_per_block
        self.max_blocks_per_seq = build.max_blocks_per_seq
        self.max_seq_len, self.max_num_tokens, self.max_batch_size = build.max_seq_len, build.max_num_tokens, build.max_batch_size
        num_blocks = min(build.max_batch_size, max_batch_size or build.max_batch_size) * self.max_blocks_per_seq
        self.kv_cache = engine.allocate_kv_cache(num_blocks)
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack: pop() takes the lowest
        self.sequences: dict[str, _DraftSequence] = {}

    def propose(self, request: Request, max_tokens: int) -> list[int]:
        return self.propose_batch([(request, max_tokens)])[0]

    def propose_batch(self, items: list[tuple[Request, int]]) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in items]
        work = []  # (index, sequence, k, tokens to feed)
        for index, (request, max_tokens) in enumerate(items):
            k = min(max_tokens, self.config.num_speculative_tokens)
            tokens = request.token_ids
            if k <= 0 or len(tokens) + k - 1 > self.max_seq_len:
                continue
            seq = self.sequences.setdefault(request.request_id, _DraftSequence([], []))
            # keep the K/V of the longest prefix the request still has (its rejected drafts' go), but feed
            # at least its last token again: its logits give the first draft
            kept = min(len(tokens) - 1, len(seq.token_ids))
            kept = next((i for i in range(kept) if seq.token_ids[i] != tokens[i]), kept)
            del seq.token_ids[kept:]
            if self._reserve(seq, len(tokens) + k - 1):
                work.append((index, seq, k, tokens[kept:]))
        try:
            # catch-up: each sequence's tokens in pieces of at most max_num_tokens, piece j in round j
            pending = {index: (seq, [new[i : i + self.max_num_tokens] for i in range(0, len(new), self.max_num_tokens)])
                       for index, seq, _, new in work}
            p_min = self.config.draft_p_min or 0.0
            unsure = set()  # the sequences that drafted a token below draft_p_min: they draft no further
            while pending:
                parts = [(index, seq, pieces.pop(0)) for index, (seq, pieces) in pending.items()]
                for index, token, p in self._forward_all(parts):
                    if not pending[index][1]:  # the last piece: its logits give the first draft
                        drafts[index].append(token)
                        if p < p_min:
                            unsure.add(index)
                pending = {index: entry for index, entry in pending.items() if entry[1]}
            # one token per sequence per forward for the remaining draft positions
            active = [(index, seq, k) for index, seq, k, _ in work]
            while active := [(index, seq, k) for index, seq, k in active if len(drafts[index]) < k and index not in unsure]:
                for index, token, p in self._forward_all([(index, seq, drafts[index][-1:]) for index, seq, _ in active]):
                    drafts[index].append(token)
                    if p < p_min:
                        unsure.add(index)
        except Exception:  # the draft engine's failure costs this step's drafts, never a request
            logger.exception("the draft model's forward failed: %d requests go on without drafts this step", len(work))
            for index, _, _, _ in work:
                self.release(items[index][0].request_id)
            return [[] for _ in items]
        return drafts

    def release(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id, None)
        if seq is not None:
            self.free_blocks.extend(reversed(seq.blocks))

    def _reserve(self, seq: _DraftSequence, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` positions of ``seq``; False (nothing taken) when the pool lacks them."""
        needed = -(-num_tokens // self.tokens_per_block) - len(seq.blocks)
        if needed > len(self.free_blocks):
            return False
        seq.blocks.extend(self.free_blocks.pop() for _ in range(max(needed, 0)))
        return True

    def _forward_all(self, parts: list[tuple[int, _DraftSequence, list[int]]]) -> list[tuple[int, int, float]]:
        """``(index, sequence, new_ids)`` parts, each sequence at most once, through the draft engine in
        forwards of at most ``max_num_tokens`` tokens and ``max_batch_size`` sequences (every part fits
        one); returns ``(index, argmax after the part's last token, its probability)`` per part, the
        probability computed only with ``draft_p_min`` (else 1.0)."""
        out, group, group_tokens = [], [], 0
        for part in [*parts, None]:
            if part is None or len(group) == self.max_batch_size or group_tokens + len(part[2]) > self.max_num_tokens:
                if group:
                    logits = self._forward([(seq, new) for _, seq, new in group])
                    tokens = logits.argmax(dim=-1).tolist()
                    probs = ([1.0] * len(group) if self.config.draft_p_min is None else
                             torch.exp(logits.max(dim=-1).values - torch.logsumexp(logits, dim=-1)).tolist())
                    out += [(index, token, p) for (index, _, _), token, p in zip(group, tokens, probs)]
                group, group_tokens = [], 0
            if part is not None:
                group.append(part)
                group_tokens += len(part[2])
        return out

    def _forward(self, parts: list[tuple[_DraftSequence, list[int]]]) -> torch.Tensor:
        """One forward of the draft engine over ``parts`` ``(sequence, new_ids)``, packed in order; returns
        the logits after each part's last token ``[len(parts), vocab_size]`` float32 and appends the
        tokens to their sequences."""
        from kilnlm.runtime.abi import pack_sequences

        inputs = pack_sequences([(new_ids, len(seq.token_ids), seq.blocks) for seq, new_ids in parts],
                                self.tokens_per_block, self.max_blocks_per_seq)
        logits = self.engine.forward(inputs, self.kv_cache)
        for seq, new_ids in parts:
            seq.token_ids.extend(new_ids)
        return logits


def make_proposer(config: SpeculativeConfig | None, engine, max_batch_size: int,
                  trusted_keys=FROM_ENVIRONMENT) -> Proposer | None:
    """The proposer of ``config`` for the target ``engine`` run ``max_batch_size`` sequences at a time (None:
    speculation off). The ``draft`` method loads its engine here (:meth:`kilnlm.runtime.engine.Engine.load`
    under ``trusted_keys``, the target's policy: a server that requires signed engines requires a signed
    draft too); raises :class:`KilnError` (an :class:`~kilnlm.runtime.errors.EngineError`
    for a refused draft engine)."""
    if config is None:
        return None
    if config.method == "ngram":
        return NgramProposer(config)
    from kilnlm.runtime.engine import Engine

    try:
        draft = Engine.load(config.model, trusted_keys)
    except KilnError as exc:  # say that it is the draft engine that is refused
        raise type(exc)(f"speculative_config's draft model: {exc}") from exc
    return DraftModelProposer(config, draft, engine.manifest.model.vocab_size, max_batch_size)


def verify_greedy(first_token: int, draft_token_ids: list[int], draft_argmax: list[int]) -> list[int]:
    """The tokens a greedy step yields: ``first_token`` (the argmax after the request's last token), then,
    while the previous token equals the next draft token, the argmax after that draft token
    (``draft_argmax[i]`` follows ``draft_token_ids[i]``). Between 1 and ``len(draft_token_ids) + 1`` tokens."""
    tokens = [first_token]
    for draft, next_token in zip(draft_token_ids, draft_argmax):
        if tokens[-1] != draft:
            break
        tokens.append(next_token)
    return tokens


def _draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from ``probs`` ``[vocab]`` (the sampler's exponential race: ``argmax(p / E)``, ``E ~ Exp(1)``)."""
    return int((probs / torch.empty_like(probs).exponential_(generator=generator)).argmax())


def verify_sampled(probs: torch.Tensor, draft_token_ids: list[int], generator: torch.Generator) -> list[int]:
    """The tokens a sampling step yields (see the module docstring): ``probs`` ``[k + 1, vocab]`` float32 is the
    request's sampling distribution after its last token (row 0) and after each draft token (row ``i + 1``);
    ``generator`` the request's own. Between 1 and ``k + 1`` tokens."""
    tokens = []
    for i, draft in enumerate(draft_token_ids):
        p = probs[i]
        if float(torch.rand((), generator=generator)) < float(p[draft]):
            tokens.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0  # max(0, p - q) with q all on the draft token; _draw needs no normalising
        tokens.append(_draw(residual, generator))
        return tokens
    tokens.append(_draw(probs[len(draft_token_ids)], generator))
    return tokens
