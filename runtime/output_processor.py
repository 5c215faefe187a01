"""Output processing: requests' new tokens -> the :class:`Response` stream a client reads.

Runs on the executor's loop thread after :meth:`Scheduler.update` has appended each sampled token (or
finished the request on an end id or its length). Per request it owns the streamed text:

- detokenizing incrementally (:class:`IncrementalDetokenizer`: no broken multi-byte characters, no lost
  leading spaces);
- stop strings, found across token boundaries in the text so far; the output is cut before the first one
  and the request finishes with reason "stop" (which takes precedence over "length" on the same token);
- hold-back: text that may be the start of a stop string (or an incomplete character) is not streamed
  until the next tokens decide it; the final response carries whatever is still held back::

      output_text  | streamed ...... num_text_sent | visible, not yet sent | held back (stop prefix?) |

- the :class:`Response` of every step: new token ids (never an end id), new text, finish reason, the
  sequence's ``sequence_index`` under its client's request id (``Request.parent_request_id``) and, when the
  request asked for them, the new tokens' log-probs (``Request.last_logprobs``, which the executor set
  from the sampler's output) and the running ``cum_log_prob``.
"""

from __future__ import annotations

from kilnlm.runtime.detokenizer import IncrementalDetokenizer, find_stop, num_held_back_chars
from kilnlm.runtime.request import FinishReason, Request, Response
from kilnlm.runtime.tokenizer import Tokenizer


class OutputProcessor:
    """One :class:`IncrementalDetokenizer` per live request, and the responses. Not thread-safe: only the
    executor's loop thread calls it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._detokenizers: dict[int, IncrementalDetokenizer] = {}

    def add_request(self, request: Request) -> None:
        """Start the request's text (its prompt's last tokens give the first output token its context)."""
        self._detokenizers[request.request_id] = IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids)

    def process(self, request: Request) -> Response:
        """The response for a request :meth:`Scheduler.update` just gave tokens: it is running with its
        ``num_step_tokens`` new tokens appended (several when it speculated), or finished with reason
        "end_id" (the end token was not appended) or "length". Finds stop strings in the new text token by
        token: then drops the tokens after the one that completed it, sets ``request.finish_reason`` to
        "stop" and returns a finished response; the caller finishes the request in the scheduler
        (:meth:`Scheduler.finish`). Raises whatever the tokenizer raises (the caller fails the request)."""
        reason = request.finish_reason
        new_token_ids = request.token_ids[len(request.token_ids) - request.num_step_tokens :] if request.num_step_tokens else []
        if request.last_logprobs is not None and new_token_ids:  # log-probs: one token per step (no speculation)
            request.cum_log_prob += request.last_logprobs.log_prob
        detokenizer = self._detokenizers[request.request_id]
        stop = request.params.stop
        for i, token_id in enumerate(new_token_ids):
            delta = detokenizer.add([token_id])
            if stop and delta:
                search_from = max(0, len(request.output_text) - max(map(len, stop)) + 1)
                request.output_text += delta
                stop_at = find_stop(request.output_text, stop, search_from)
                if stop_at is not None:
                    request.output_text = request.output_text[:stop_at]
                    request.finish_reason = FinishReason.STOP
                    del request.token_ids[len(request.token_ids) - (len(new_token_ids) - i - 1) :]
                    return self.final_response(request, new_token_ids[: i + 1])
            else:
                request.output_text += delta
        if reason is FinishReason.END_ID or reason is FinishReason.LENGTH:
            return self.final_response(request, new_token_ids)
        num_visible = len(request.output_text) - num_held_back_chars(request.output_text, stop)
        text = request.output_text[request.num_text_sent : num_visible]
        request.num_text_sent = max(request.num_text_sent, num_visible)
        return _response(request, new_token_ids, text, finished=False)

    def final_response(self, request: Request, new_token_ids: list[int] | None = None) -> Response:
        """The last response of a finished request (``request.finish_reason`` set): all text still held
        back -- the detokenizer's too, except after "stop" (the text was cut) or "error". Forgets the
        request."""
        reason = request.finish_reason
        detokenizer = self._detokenizers.pop(request.request_id, None)
        if reason is not FinishReason.STOP and reason is not FinishReason.ERROR and detokenizer is not None:
            request.output_text += detokenizer.flush()
        text = request.output_text[request.num_text_sent :]
        request.num_text_sent = len(request.output_text)
        return _response(request, new_token_ids or [], text, finished=True)


def _response(request: Request, token_ids: list[int], text: str, finished: bool) -> Response:
    """The response carrying ``token_ids`` (empty, or the tokens the request just appended) and ``text``;
    with their log-probs when the request asked for them (one token per step then)."""
    response = Response(request.parent_request_id, token_ids, text, finished, request.finish_reason if finished else None,
                        request.num_prompt_tokens, request.num_generated_tokens,
                        request.error_message if finished else None, sequence_index=request.sequence_index)
    if request.params.logprobs is not None:
        if token_ids and request.last_logprobs is not None:
            response.log_probs = [request.last_logprobs.log_prob]
            response.top_logprobs = [request.last_logprobs.top_logprobs]
        response.cum_log_prob = request.cum_log_prob
    return response
