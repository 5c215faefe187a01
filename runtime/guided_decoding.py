"""Guided decoding (structured output): generated tokens kept inside a grammar's language, with xgrammar.

A request's ``SamplingParams.guided_decoding`` names a guide (TensorRT-LLM's ``guided_decoding_guide_type``):
"json" (any JSON value), "json_schema", "regex" or "ebnf_grammar". The :class:`GuidedDecoder` owns all of
it, as TensorRT-LLM's and vLLM's xgrammar backends do (xgrammar: Dong et al. 2024, "XGrammar: Flexible and
Efficient Structured Generation Engine for Large Language Models"):

- xgrammar's ``TokenizerInfo``, built from the engine's ``tokenizers`` vocabulary (no transformers in
  kilnlm; the vocabulary type is xgrammar's own reading of ``tokenizer.json``) with the model's vocab size
  (the logits' width) and the engine's EOS ids as stop tokens;
- one ``GrammarCompiler`` whose cache of compiled grammars is bounded by ``cache_limit_bytes``;
- one ``GrammarMatcher`` per sequence (per :class:`Request` object, so each of a request's ``n`` sequences
  has its own), whose stop tokens are that request's end ids.

Per executor iteration, on the loop thread::

    sample:  fill_token_bitmask(rows)  ->  Sampler masks the disallowed tokens  ->  token per row
    update:  Scheduler.update appends the token  ->  accept_tokens(updated)  advances each matcher

The matcher allows an end id only once the grammar is complete, so a guided request ends through the
ordinary end-id path (finish reason "end_id"); a token the matcher rejects (possible only when another
filter, e.g. ``bad_words``, removed every token the grammar allows) ends that request with reason "error".
Preemption recomputes K/V only (the tokens stay), so matchers need nothing then.

xgrammar (the ``kilnlm[guided]`` extra; it pulls transformers) is imported on the first guided request, or
by :meth:`GuidedDecoder.load`.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kilnlm.runtime.errors import RequestError
from kilnlm.runtime.request import GuidedDecodingParams, Request, SamplingParams
from kilnlm.runtime.tokenizer import Tokenizer

__all__ = ["DEFAULT_GRAMMAR_CACHE_BYTES", "GuidedDecoder", "apply_token_bitmask"]

DEFAULT_GRAMMAR_CACHE_BYTES = 64 << 20  # compiled grammars kept for reuse (a JSON schema: ~40 KB)
ANY_JSON_SCHEMA = "{}"  # the "json" guide: any JSON value
# JSON guides ("json", "json_schema") are compiled with any_whitespace=False: the output is JSON in one line
# with ", " and ": " separators. With free whitespace a small model can emit newlines and spaces until
# max_tokens and never close the value.

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and maybe "Check failed: (...) is false: ".
_XGRAMMAR_ERROR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s+(Check failed: .*? is false:\s*)?")


class GuidedDecoder:
    """Compiles guides and keeps one grammar matcher per guided sequence.

    ``check`` runs on client threads (``Executor.submit``); everything else on the executor's loop thread.
    The xgrammar objects are made once, under a lock, on first use.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Iterable[int], max_batch_size: int,
                 cache_limit_bytes: int = DEFAULT_GRAMMAR_CACHE_BYTES) -> None:
        """``vocab_size``: the model's (the logits' width; the tokenizer's may be smaller).
        ``stop_token_ids``: the engine's EOS ids. ``max_batch_size``: rows of the reused bitmask."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_batch_size = max_batch_size
        self.cache_limit_bytes = cache_limit_bytes
        self._load_lock = threading.Lock()
        self.tokenizer_info: Any = None  # xgrammar's TokenizerInfo, once loaded
        self._xgr: Any = None  # the xgrammar module, once loaded
        self._compiler: Any = None
        self._bitmask: torch.Tensor | None = None  # [max_batch_size, ceil(vocab_size / 32)] int32, reused
        self._matchers: dict[Request, Any] = {}  # loop thread only

    # ------------------------------------------------------------------------------- client threads
    def load(self) -> None:
        """Import xgrammar and build the tokenizer info, the compiler and the bitmask buffer (~2 s, once).
        Idempotent and thread-safe; a server may call it at start-up so that no request waits for it.
        Raises :class:`RequestError` if xgrammar is not installed."""
        with self._load_lock:
            if self._compiler is not None:
                return
            try:
                import xgrammar as xgr
            except ImportError as exc:
                raise RequestError(f"guided_decoding needs xgrammar ({exc}): install it with "
                                   "`pip install 'kilnlm[guided]'`") from None
            self.tokenizer_info = info = xgr.TokenizerInfo(
                _encoded_vocab(self.tokenizer, self.vocab_size),
                **_vocab_metadata(xgr, self.tokenizer),
                vocab_size=self.vocab_size,
                stop_token_ids=self.stop_token_ids,
            )
            self._bitmask = xgr.allocate_token_bitmask(self.max_batch_size, self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, cache_limit_bytes=self.cache_limit_bytes)
            self._xgr = xgr

    def check(self, params: SamplingParams) -> None:
        """Compile the request's guide, if it has one (the compiled grammar stays in the compiler's
        cache for :meth:`add_request`). Raises :class:`RequestError` with xgrammar's message for a schema,
        regular expression or grammar that does not compile, for ``ignore_eos`` with a guide (the output
        ends with an end id once the grammar is complete), and if xgrammar is not installed."""
        guide = params.guided_decoding
        if guide is None:
            return
        if params.ignore_eos:
            raise RequestError("guided_decoding ends the output with an end id once the grammar is complete: "
                               "ignore_eos cannot be combined with it")
        self._compile(guide)

    # ---------------------------------------------------------------------------------- loop thread
    def add_request(self, request: Request) -> None:
        """Give a guided request (one sequence) its grammar matcher; a no-op for others. The grammar comes
        from the compiler's cache (compiled by :meth:`check`; compiled again if evicted since, which raises
        :class:`RequestError` as :meth:`check` would)."""
        guide = request.params.guided_decoding
        if guide is not None:
            stop_token_ids = sorted(request.end_ids)  # the request's end_id or the engine's EOS ids
            self._matchers[request] = self._xgr.GrammarMatcher(self._compile(guide), override_stop_tokens=stop_token_ids)

    def remove_request(self, request: Request) -> None:
        """Forget the request's matcher (finished, cancelled, failed). Idempotent."""
        self._matchers.pop(request, None)

    def fill_token_bitmask(self, requests: Sequence[Request]) -> torch.Tensor | None:
        """The tokens each row may take next, or None when no row is guided.

        Returns ``[len(requests), ceil(vocab_size / 32)]`` int32, CPU: bit ``t % 32`` of word ``t // 32`` of
        row b is 1 when token t is allowed for ``requests[b]`` (xgrammar's layout; rows of unguided
        requests allow every token). A view of a reused buffer, valid until the next call.
        """
        if not self._matchers:
            return None
        rows = [(b, matcher) for b, request in enumerate(requests) if (matcher := self._matchers.get(request)) is not None]
        if not rows:
            return None
        bitmask = self._bitmask[: len(requests)]
        self._xgr.reset_token_bitmask(bitmask)
        for b, matcher in rows:
            matcher.fill_next_token_bitmask(bitmask, b)
        return bitmask

    def accept_tokens(self, requests: Sequence[Request]) -> list[tuple[Request, str]]:
        """Advance the matchers of the guided requests that ``Scheduler.update`` just appended a token to
        (``token_ids[-1]``; finished requests took none). Returns the requests whose matcher rejected the
        token, each with a message; the caller finishes them."""
        rejected: list[tuple[Request, str]] = []
        if not self._matchers:
            return rejected
        for request in requests:
            matcher = self._matchers.get(request)
            if matcher is None or request.finished:
                continue
            token_id = request.token_ids[-1]
            if not matcher.accept_token(token_id):
                rejected.append((request, f"guided_decoding: token {token_id} breaks the {request.params.guided_decoding.guide_type} "
                                          "guide (another sampling filter, e.g. bad_words or min_tokens, removed every token "
                                          "the guide allows)"))
        return rejected

    # ------------------------------------------------------------------------------------ internals
    def _compile(self, guide: GuidedDecodingParams) -> Any:
        """xgrammar's ``CompiledGrammar`` for ``guide`` (from the compiler's cache when compiled before)."""
        self.load()
        compiler = self._compiler
        compile_guide = {
            "json": lambda: compiler.compile_json_schema(ANY_JSON_SCHEMA, any_whitespace=False),
            "json_schema": lambda: compiler.compile_json_schema(guide.guide, any_whitespace=False),
            "regex": lambda: compiler.compile_regex(guide.guide),
            "ebnf_grammar": lambda: compiler.compile_grammar(guide.guide),
        }[guide.guide_type]
        try:
            return compile_guide()
        except (RuntimeError, ValueError) as exc:  # xgrammar raises RuntimeError (C++) or ValueError (Python)
            message = _XGRAMMAR_ERROR_PREFIX.sub("", str(exc)).strip()
            raise RequestError(f"guided_decoding's {guide.guide_type} guide does not compile: {message}") from None


def apply_token_bitmask(logits: torch.Tensor, token_bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` with every token the bitmask disallows set to -inf (a copy; ``logits`` is not modified).

    ``logits``: ``[B, vocab_size]`` float32, CPU. ``token_bitmask``: ``[B, ceil(vocab_size / 32)]`` int32,
    CPU, from :meth:`GuidedDecoder.fill_token_bitmask`. Uses xgrammar's CPU kernel.
    """
    import xgrammar as xgr  # loaded already: a bitmask exists only once GuidedDecoder.load ran

    logits = logits.clone()
    xgr.apply_token_bitmask_inplace(logits, token_bitmask, vocab_size=logits.shape[-1])
    return logits


def _encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """The tokenizer's tokens as spelled in its vocabulary, by id, padded with "" to the model's
    ``vocab_size`` (ids the tokenizer does not have; ids beyond ``vocab_size`` are dropped)."""
    encoded_vocab = [""] * vocab_size
    for token, token_id in tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded_vocab[token_id] = token
    return encoded_vocab


def _vocab_metadata(xgr: Any, tokenizer: Tokenizer) -> dict[str, Any]:
    """``vocab_type`` (raw, byte-fallback or byte-level) and ``add_prefix_space``, read by xgrammar from the
    ``tokenizer.json`` text (the detection ``TokenizerInfo.from_huggingface`` applies to a fast tokenizer)."""
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.backend.to_str())
    return {"vocab_type": metadata["vocab_type"], "add_prefix_space": metadata["add_prefix_space"]}
