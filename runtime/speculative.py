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
from dataclasses import dataclass

import numpy as np
import torch

from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.request import Request

SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """A parsed ``speculative_config`` (vLLM's field names): ``method`` (one of :data:`SPECULATIVE_METHODS`),
    ``num_speculative_tokens`` (draft tokens per step, k >= 1), ``prompt_lookup_max`` / ``prompt_lookup_min``
    (the n-gram sizes the ``ngram`` method matches, 1 <= min <= max)."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1


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
    known = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
    unknown = sorted(set(spec) - set(known))
    if unknown:
        raise KilnError(f"speculative_config has unknown fields {unknown} for method {method!r}: it takes {', '.join(known)}")
    if "num_speculative_tokens" not in spec:
        raise KilnError("speculative_config needs num_speculative_tokens (draft tokens per step, e.g. 4)")
    values = {}
    for name in known:
        if name in spec:
            value = spec[name]
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise KilnError(f"speculative_config {name} is {value!r}: it must be an integer >= 1")
            values[name] = value
    config = SpeculativeConfig(method=method, **values)
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise KilnError(f"speculative_config prompt_lookup_min {config.prompt_lookup_min} exceeds prompt_lookup_max "
                        f"{config.prompt_lookup_max}")
    return config


def speculates(request: Request) -> bool:
    """Whether ``request``'s distribution at a draft position depends only on that position's logits: no
    penalties, ``min_tokens``, ``bad_words``, log-probabilities or guided decoding."""
    p = request.params
    return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and p.min_tokens == 0 and not p.bad_words and p.logprobs is None and p.guided_decoding is None)


class NgramProposer:
    """Prompt lookup decoding (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    def propose(self, token_ids: list[int], max_tokens: int) -> list[int]:
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
