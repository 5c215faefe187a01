"""Next-token sampling for a batch of sequences, each with its own ``SamplingParams``.

One call of :meth:`Sampler.sample` processes the ``[B, vocab]`` logits of the rows that sample this step,
in this order::

    raw logits --> log-probs --> penalties --> masks --> greedy argmax, or temperature / top-k / top-p draw
                   (rows with    (rows with    (bad words, min_tokens' end ids,
                   logprobs)     a penalty)    guided decoding's allowed tokens)

1. **Log-probs** (rows whose ``params.logprobs`` is not None): ``log_softmax`` of the *raw* logits, before
   penalties and temperature (what vLLM returns by default); the sampled token's log-prob and the
   ``logprobs`` most likely tokens are read from it after the draw. Other rows pay nothing.
2. **Penalties**, vectorised over the rows that use one (the counts of the (row, token) pairs present
   come from one ``unique`` and one ``bincount`` over the rows' tokens, :meth:`Sampler._apply_penalties`):

   - ``repetition_penalty`` r (CTRL, Keskar et al. 2019, "CTRL: A Conditional Transformer Language Model
     for Controllable Generation", Sec. 4.1, as Hugging Face's ``RepetitionPenaltyLogitsProcessor`` and
     TensorRT-LLM apply it): for every token present in the prompt or the generated tokens, a positive
     logit is divided by r and a negative one multiplied by r.
   - ``presence_penalty`` a and ``frequency_penalty`` f (OpenAI's API reference, "Parameter details" of
     frequency and presence penalties, as vLLM applies them): ``logit[t] -= a * [c[t] > 0] + f * c[t]``
     with ``c[t]`` the number of times t occurs among the *generated* tokens (the prompt does not count).

   Repetition first, then presence / frequency (vLLM's order).
3. **Masks** (tokens set to ``-inf``): the last token of every ``bad_words`` sequence whose other tokens
   end the current sequence, and the request's end ids (``Request.end_ids``) while fewer than
   ``min_tokens`` tokens were generated; with guided decoding, every token the row's grammar does not
   allow (its xgrammar bitmask, :mod:`kilnlm.runtime.guided_decoding`).
4. **Selection**: greedy rows (temperature 0) take the argmax; the other rows divide by their
   temperature, keep their ``top_k`` largest logits and the smallest set of tokens whose probability
   reaches ``top_p`` (nucleus sampling, Holtzman et al. 2019, "The Curious Case of Neural Text
   Degeneration"), and draw from the renormalised distribution (:meth:`Sampler.sampling_probs`). The draw
   uses each request's own ``torch.Generator`` (the exponential-race form of categorical sampling:
   ``argmax(p / E)`` with ``E ~ Exp(1)`` per token), so a seeded request produces the same tokens whichever
   other requests share its batch.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from kilnlm.runtime.guided_decoding import apply_token_bitmask
from kilnlm.runtime.request import Request, TokenLogprobs


@dataclass
class SamplerOutput:
    """What :meth:`Sampler.sample` returns for B rows: ``token_ids[b]`` is row b's sampled token;
    ``logprobs[b]`` its log-probability and top alternatives, or None when ``requests[b]`` asked for none."""

    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


class Sampler:
    """Stateless; the per-request state (generator, tokens so far) lives in :class:`Request`."""

    def sample(self, logits: torch.Tensor, requests: Sequence[Request],
               token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token per row (the module docstring gives the order of the steps).

        Args:
            logits: ``[B, vocab_size]`` float32, CPU -- row b belongs to ``requests[b]``. Not modified.
            requests: the B requests, for their params, generators and tokens so far.
            token_bitmask: ``[B, ceil(vocab_size / 32)]`` int32, CPU, or None: the tokens each row may take
                (guided decoding, :meth:`kilnlm.runtime.guided_decoding.GuidedDecoder.fill_token_bitmask`);
                applied to the processed logits, after log-probs are taken from the raw ones.
        Returns:
            a :class:`SamplerOutput` of B token ids and B log-prob entries.
        Raises:
            ValueError: ``logits`` is not ``[len(requests), vocab]``.
        """
        if logits.dim() != 2 or logits.shape[0] != len(requests):
            raise ValueError(f"logits must be [num_requests={len(requests)}, vocab], got {tuple(logits.shape)}")
        logprob_rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
        # raw_logprobs: [L, vocab] float32 over the raw logits of the rows that ask
        raw_logprobs = logits[logprob_rows].log_softmax(dim=-1) if logprob_rows else None
        logits = self.process_logits(logits, requests, token_bitmask)
        # numpy's argmax (first maximum, like torch's) takes ~5 us over SmolLM2's 49,152 logits against
        # ~30 us for torch.argmax; at 32 rows ~80 us against ~900 us (measured on the 2-core dev machine).
        next_tokens = logits.numpy().argmax(axis=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            rows = torch.tensor(random_rows, dtype=torch.long)
            next_tokens[random_rows] = self._sample_random(logits[rows], [requests[i] for i in random_rows]).numpy()
        token_ids = next_tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            entries = self._gather_logprobs(raw_logprobs, [token_ids[i] for i in logprob_rows],
                                            [requests[i].params.logprobs for i in logprob_rows])
            for row, entry in zip(logprob_rows, entries):
                logprobs[row] = entry
        return SamplerOutput(token_ids, logprobs)

    def process_logits(self, logits: torch.Tensor, requests: Sequence[Request],
                       token_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """Steps 2 and 3 of the module docstring: penalties, then the masks.

        ``logits``: ``[B, vocab]`` float32, CPU (not modified); ``token_bitmask``: guided decoding's
        ``[B, ceil(vocab / 32)]`` int32 allowed-token bitmask, or None. Returns the processed ``[B, vocab]``
        float32 logits (``logits`` itself when no row has a penalty or a mask).
        """
        logits = self._apply_penalties(logits, requests)
        logits = self._apply_banned_tokens(logits, requests)
        if token_bitmask is not None:  # guided decoding: each row's grammar allows these tokens
            logits = apply_token_bitmask(logits, token_bitmask)
        return logits

    @staticmethod
    def sampling_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The distribution a non-greedy row draws from (step 4): temperature, top-k, top-p, renormalised.

        ``logits``: ``[R, vocab]`` float32 processed logits (:meth:`process_logits`) of R non-greedy rows.
        Returns ``[R, vocab]`` float32 probabilities (rows sum to 1).
        """
        num_rows, vocab_size = logits.shape
        temperature = torch.tensor([r.params.temperature for r in requests], dtype=logits.dtype)
        logits = logits / temperature.unsqueeze(1)
        top_k = torch.tensor([r.params.top_k or vocab_size for r in requests], dtype=torch.long).clamp_(max=vocab_size)
        top_p = torch.tensor([r.params.top_p for r in requests], dtype=logits.dtype)
        if bool((top_k < vocab_size).any()) or bool((top_p < 1.0).any()):
            sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
            rank = torch.arange(vocab_size).expand(num_rows, vocab_size)
            drop = rank >= top_k.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            probs = sorted_logits.softmax(dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p (the top token always stays).
            drop |= (probs.cumsum(dim=-1) - probs) >= top_p.unsqueeze(1)
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter_(1, sorted_ids, sorted_logits)
        return logits.softmax(dim=-1)

    # ------------------------------------------------------------------------------------- internals
    @staticmethod
    def _apply_penalties(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Repetition, then presence / frequency penalties of the rows that set one (module docstring).

        Only the logits of tokens present in a row change, so the counts are kept sparse: every token of
        the penalised rows gets the key ``row * vocab + token id`` into the flattened logits; one
        ``unique`` over the keys gives the S present (row, token) pairs, and one ``bincount`` of the
        generated tokens' pair indices their output counts (a dense ``[R, vocab]`` count and ``where``
        cost several times more at 32 rows of SmolLM2's 49,152 tokens).
        """
        rows = [i for i, r in enumerate(requests) if _has_penalty(r)]
        if not rows:
            return logits
        vocab_size = logits.shape[1]
        penalised = [requests[i] for i in rows]
        num_tokens = torch.tensor([r.num_tokens for r in penalised], dtype=torch.long)
        total = int(num_tokens.sum())
        # keys: [N] int64 over the N prompt + generated tokens of the penalised rows, row by row
        token_ids = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(r.token_ids for r in penalised),
                                                 dtype=np.int64, count=total))
        keys = torch.repeat_interleave(torch.tensor(rows, dtype=torch.long) * vocab_size, num_tokens) + token_ids
        # is_generated: [N] bool -- a token's position in its row is at or past the row's prompt length
        row_start = torch.repeat_interleave(num_tokens.cumsum(0) - num_tokens, num_tokens)
        num_prompt = torch.repeat_interleave(torch.tensor([r.num_prompt_tokens for r in penalised]), num_tokens)
        is_generated = torch.arange(total) - row_start >= num_prompt
        seen, pair_index = keys.unique(return_inverse=True)  # [S] pairs in prompt or output; [N] -> [0, S)
        generated_counts = torch.bincount(pair_index[is_generated], minlength=len(seen)).to(logits.dtype)  # [S]

        repetition, presence, frequency = torch.tensor(
            [[r.params.repetition_penalty, r.params.presence_penalty, r.params.frequency_penalty] for r in requests],
            dtype=logits.dtype).unbind(1)  # each [B]
        row = seen // vocab_size
        logits = logits.clone(memory_format=torch.contiguous_format)
        flat = logits.view(-1)  # [B * vocab]
        values = flat[seen]  # [S]
        values = torch.where(values > 0, values / repetition[row], values * repetition[row])
        values -= presence[row] * (generated_counts > 0).to(logits.dtype) + frequency[row] * generated_counts
        flat[seen] = values
        return logits

    @staticmethod
    def _apply_banned_tokens(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """Set to ``-inf``: the last token of every bad-words sequence whose other tokens end the current
        sequence, and the end ids while fewer than ``min_tokens`` tokens were generated."""
        banned_rows: list[int] = []
        banned_tokens: list[int] = []
        for row, request in enumerate(requests):
            params = request.params
            for word in params.bad_words:
                prefix = list(word[:-1])
                if not prefix or request.token_ids[-len(prefix) :] == prefix:
                    banned_rows.append(row)
                    banned_tokens.append(word[-1])
            if request.num_generated_tokens < params.min_tokens:
                banned_rows += [row] * len(request.end_ids)
                banned_tokens += request.end_ids
        if not banned_rows:
            return logits
        logits = logits.clone()
        logits[banned_rows, banned_tokens] = float("-inf")
        return logits

    def _sample_random(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """``logits``: ``[R, vocab]`` float32 of the non-greedy rows. Returns ``[R]`` int64 token ids."""
        probs = self.sampling_probs(logits, requests)
        vocab_size = logits.shape[1]
        noise = torch.stack([torch.empty(vocab_size).exponential_(generator=r.generator) for r in requests])
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _gather_logprobs(raw_logprobs: torch.Tensor, token_ids: list[int], num_top: list[int]) -> list[TokenLogprobs]:
        """``raw_logprobs``: ``[L, vocab]`` float32; per row the sampled token's log-prob and the
        ``num_top[row]`` most likely tokens ``{token_id: log-prob}`` (most likely first)."""
        sampled = raw_logprobs.gather(1, torch.tensor(token_ids, dtype=torch.long).unsqueeze(1)).squeeze(1).tolist()
        max_top = max(num_top)
        top_values, top_ids = raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None)
        entries = []
        for row, k in enumerate(num_top):
            top = dict(zip(top_ids[row, :k].tolist(), top_values[row, :k].tolist())) if k else {}
            entries.append(TokenLogprobs(sampled[row], top))
        return entries


def _has_penalty(request: Request) -> bool:
    params = request.params
    return params.repetition_penalty != 1.0 or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
