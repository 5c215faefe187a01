"""Streaming detokenization and stop strings.

Decoding one token at a time loses information twice: a token may hold only part of a multi-byte UTF-8
character (decoding it alone gives '\\ufffd'), and some decoders drop the leading space of the first token
they see (SentencePiece's metaspace). :class:`IncrementalDetokenizer` therefore decodes a small window::

    token ids  | ... | prefix_offset ......... read_offset ......... end |
                       |<- already emitted ->|<- new, not yet emitted ->|
    delta = decode(ids[prefix_offset:]) minus decode(ids[prefix_offset:read_offset])

and emits nothing while the window's text ends in '\\ufffd' (an incomplete character). The concatenated
deltas equal ``decode(all output ids)``. (The same scheme as Hugging Face text-generation-inference's and
vLLM's incremental detokenizers.)
"""

from __future__ import annotations

from collections.abc import Sequence

from kilnlm.runtime.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output so that the output's first token decodes with its context.
NUM_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the text that became final (possibly "")."""
        self._ids.extend(token_ids)
        return self._emit(final=False)

    def flush(self) -> str:
        """At the end of the sequence: return whatever is held back (even an incomplete character)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if not final and (len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd")):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full_text[len(prefix_text) :]


def find_stop(text: str, stop: Sequence[str], start: int = 0) -> int | None:
    """Index in ``text`` where the earliest stop string begins (searching from ``start``), or None."""
    found = [i for s in stop if (i := text.find(s, start)) != -1]
    return min(found) if found else None


def num_held_back_chars(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string: those characters
    must not be streamed yet, the next tokens may complete the stop string."""
    longest = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest
