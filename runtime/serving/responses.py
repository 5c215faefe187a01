"""The executor's streamed responses of one request -> the replies its client gets, and their output tensors.

A streamed request (``stream`` true) gets one reply per executor response that carries new text or token ids,
then a final reply with the finish reason. A non-streamed request gets one final reply holding the whole
completion (after the prompt unless ``exclude_input_in_output``). An executor failure ("error") becomes a
final reply whose ``error`` is set; the front reports it as an internal error.

Output tensors (TensorRT-LLM's ``inflight_batcher_llm`` names), from :func:`output_arrays`::

    text_output      [1]  object (UTF-8 bytes)   the reply's text
    output_ids       [n]  int32                  the token ids it carries
    sequence_length  [1]  int32                  n
    finish_reason    [1]  object (UTF-8 bytes)   "" until the final reply, then "length", "stop",
                                                 "end_id" or "cancelled"
"""

from __future__ import annotations

import dataclasses
import enum
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # (not imported at run time: the executor-less models import this without torch)
    from kilnlm.runtime.request import Response
    from kilnlm.runtime.serving.request_parsing import GenerateRequest

class ErrorKind(str, enum.Enum):
    """Whose an error reply is, which decides its status: the client's to fix (Triton INVALID_ARG, HTTP
    400), kilnlm busy (UNAVAILABLE, HTTP 503: the queue is full, retry later) or kilnlm's (INTERNAL, 500)."""

    INVALID_REQUEST = "invalid_request"
    UNAVAILABLE = "unavailable"
    INTERNAL = "internal"


OUTPUT_NAMES = ("text_output", "output_ids", "sequence_length", "finish_reason")


@dataclasses.dataclass(frozen=True)
class Reply:
    """One reply to a client.

    Attributes:
        text: new text (streamed) or the whole text (non-streamed final reply).
        token_ids: the token ids the reply carries (end ids never included).
        finish_reason: "" until the final reply; then the executor's finish reason.
        final: the request's last reply.
        error: set on a final reply when the executor failed the request (the message for the client).
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: str = ""
    final: bool = False
    error: str | None = None


def finish_reason_name(response: "Response") -> str:
    """The response's finish reason as a string ("" when it has none)."""
    reason = response.finish_reason
    return str(getattr(reason, "value", reason) or "")


class ResponseShaper:
    """Turns one request's executor responses, in order, into its replies.

    Not thread-safe: one owner per request (the dispatcher thread).
    """

    def __init__(self, request: "GenerateRequest") -> None:
        self._request = request
        self._text_parts: list[str] = []  # non-streamed: the completion so far
        self._token_ids: list[int] = []

    def add(self, response: "Response") -> Reply | None:
        """The reply ``response`` makes, or None when it makes none yet (a non-streamed request before its
        final response, or a streamed response with neither text nor token ids)."""
        new_ids = tuple(response.token_ids)
        if not response.finished:
            if self._request.stream:
                return Reply(response.text, new_ids) if (response.text or new_ids) else None
            self._text_parts.append(response.text)
            self._token_ids.extend(new_ids)
            return None
        finish_reason = finish_reason_name(response)
        if finish_reason == "error":
            return Reply("", (), finish_reason, final=True, error=f"kilnlm executor error: {response.error}")
        if self._request.stream:
            return Reply(response.text, new_ids, finish_reason, final=True)
        prefix = "" if self._request.exclude_input_in_output else self._request.text
        text = prefix + "".join(self._text_parts) + response.text
        return Reply(text, (*self._token_ids, *new_ids), finish_reason, final=True)


def output_arrays(reply: Reply) -> dict[str, np.ndarray]:
    """The output tensors of ``reply`` (see the module docstring), by name, in OUTPUT_NAMES order."""
    return {
        "text_output": np.array([reply.text.encode("utf-8")], dtype=np.object_),
        "output_ids": np.array(reply.token_ids, dtype=np.int32),
        "sequence_length": np.array([len(reply.token_ids)], dtype=np.int32),
        "finish_reason": np.array([reply.finish_reason.encode("utf-8")], dtype=np.object_),
    }
