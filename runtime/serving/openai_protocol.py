"""OpenAI's API, as ``kilnlm serve`` speaks it: request bodies (pydantic models) -> ``SamplingParams``, and
the executor's ``Response``\\ s -> OpenAI's JSON objects (completions, chat completions, their chunks,
log-probabilities, usage, errors).

Request fields (OpenAI's names, plus vLLM's extras that its clients send):

==================================  ==========================================================================
``model``                           must be the served model's name (404 otherwise); may be left out
``prompt`` (completions)            a string, or token ids; one prompt per request
``messages`` (chat)                 rendered with the engine's chat template (``content``: a string or a
                                    list of ``{"type": "text", "text": ...}`` parts)
``max_tokens``                      tokens to generate (chat: ``max_completion_tokens`` wins); default:
                                    the server's ``--default-max-tokens``
``temperature`` / ``top_p``         OpenAI's defaults 1.0 / 1.0; temperature 0 is greedy
``n``                               sequences sampled from the prompt (choices, ``index`` = sequence)
``stop``                            a string or a list of strings; the output ends before the first
``seed``                            makes sampling reproducible
``presence_penalty`` /              OpenAI's penalties (0 = off)
``frequency_penalty``
``logprobs`` / ``top_logprobs``     chat: ``logprobs`` true + ``top_logprobs`` alternatives (0-20);
                                    completions: ``logprobs`` = number of alternatives (0-20)
``response_format``                 ``{"type": "json_object"}`` (any JSON) or ``{"type": "json_schema",
                                    "json_schema": {"schema": {...}}}``: structured output
``stream`` / ``stream_options``     SSE chunks; ``include_usage`` adds a last chunk with usage, no choices
``top_k``, ``repetition_penalty``,  vLLM's extras (0 = off, 1.0 = off, 0, false)
``min_tokens``, ``ignore_eos``
``num_speculative_tokens``          kilnlm's extra: 0 turns speculative decoding off for the request, n caps
                                    its draft tokens per step (null: the server's ``--speculative-config``)
==================================  ==========================================================================

Unknown fields are ignored (clients send ``user`` and the like); fields kilnlm cannot honour with a value
that asks for something (``echo``, ``best_of`` > ``n``, ``suffix``, ``logit_bias``, ``tools``) are refused
with a 400 naming them. Ranges are checked once, by ``SamplingParams.validate`` in ``Executor.submit``.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kilnlm.runtime.errors import RequestError
from kilnlm.runtime.request import GuidedDecodingParams, Response, SamplingParams

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: a request that sends no temperature samples
FINISH_REASONS = {"end_id": "stop", "stop": "stop", "length": "length",
                  "cancelled": "abort"}  # (vLLM's word for a request the server ended: OpenAI has none)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchema(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    def guided_decoding(self) -> GuidedDecodingParams | None:
        if self.type == "json_object":
            return GuidedDecodingParams("json")
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise RequestError("response_format.json_schema.schema is missing: send the JSON schema the "
                                   "output must follow")
            return GuidedDecodingParams("json_schema", json.dumps(self.json_schema.schema_))
        return None


class _SamplingRequest(BaseModel):
    """The fields both endpoints share."""

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    response_format: ResponseFormat | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    # kilnlm's extra
    num_speculative_tokens: int | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise RequestError("logit_bias is not supported by kilnlm: leave it out")

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def requested_logprobs(self) -> int | None:
        """``SamplingParams.logprobs``: None (no log-probs) or the number of top alternatives."""
        return None

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """``SamplingParams`` of this request (``default_max_tokens`` when it sends no max_tokens). Raises
        :class:`RequestError` for a field kilnlm cannot honour or a malformed response_format."""
        self._check_unsupported()
        max_tokens = self.requested_max_tokens()
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=default_max_tokens if max_tokens is None else max_tokens,
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(self.top_k or 0, 0),  # vLLM writes "off" as -1
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            min_tokens=self.min_tokens,
            n=self.n,
            logprobs=self.requested_logprobs(),
            guided_decoding=self.response_format.guided_decoding() if self.response_format else None,
            num_speculative_tokens=self.num_speculative_tokens,
        )


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def _check_unsupported(self) -> None:
        super()._check_unsupported()
        if self.echo:
            raise RequestError("echo is not supported by kilnlm: leave it out or set it to false")
        if self.suffix:
            raise RequestError("suffix is not supported by kilnlm: leave it out")
        if self.best_of is not None and self.best_of != self.n:
            raise RequestError(f"best_of={self.best_of} is not supported by kilnlm: leave it out (n={self.n} "
                               "sequences are sampled and all returned)")

    def prompt_token_ids(self, tokenizer) -> list[int]:
        """The prompt's token ids: a string tokenized with the tokenizer's special tokens, or the ids sent.
        Raises :class:`RequestError` for several prompts or an empty one."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise RequestError(f"prompt holds {len(prompt)} prompts: kilnlm takes one prompt per request")
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty: send at least one character")
            return tokenizer.encode(prompt)
        return list(prompt)


class ContentPart(BaseModel):
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template reads it (text parts joined by newlines)."""
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" for part in content):
                raise RequestError("messages: only text content parts are supported (type 'text')")
            content = "\n".join(part.text or "" for part in content)
        return {**(self.model_extra or {}), "role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def _check_unsupported(self) -> None:
        super()._check_unsupported()
        if self.tools:
            raise RequestError("tools is not supported by kilnlm: leave it out")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: set logprobs to true")

    def prompt_token_ids(self, tokenizer) -> list[int]:
        """The messages rendered with the engine's chat template (generation prompt added), tokenized
        without adding special tokens again. Raises :class:`RequestError` where the template refuses."""
        text = tokenizer.apply_chat_template([m.template_message() for m in self.messages],
                                             add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)


# ------------------------------------------------------------------------------------------- responses
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def finish_reason(response: Response) -> str | None:
    """OpenAI's finish reason of a sequence's final response ("stop" | "length" | "abort"), else None."""
    if not response.finished or response.finish_reason is None:
        return None
    return FINISH_REASONS.get(response.finish_reason.value, response.finish_reason.value)


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class TokenText:
    """Token id -> its text (a token's own string, special tokens kept), memoised per server."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text


class CompletionFormat:
    """``/v1/completions``: objects "text_completion", choices with ``text``, legacy log-probs."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, token_text: TokenText) -> None:
        self._token_text = token_text

    def choice(self, index: int, text: str, logprobs: list | None, reason: str | None) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": reason}

    chunk_choice = choice

    def first_chunk_choice(self, index: int) -> dict[str, Any] | None:
        return None

    def logprob_entries(self, response: Response) -> list:
        return [(self._token_text(token_id), response.log_probs[i],
                 {self._token_text(t): lp for t, lp in response.top_logprobs[i].items()}
                 if i < len(response.top_logprobs) else {})
                for i, token_id in enumerate(response.token_ids[:len(response.log_probs)])]

    @staticmethod
    def _logprobs(entries: list | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        offsets, offset = [], 0
        for token, _, _ in entries:
            offsets.append(offset)
            offset += len(token)
        return {"tokens": [e[0] for e in entries], "token_logprobs": [e[1] for e in entries],
                "top_logprobs": [e[2] for e in entries], "text_offset": offsets}


class ChatFormat:
    """``/v1/chat/completions``: objects "chat.completion" / "chat.completion.chunk", choices with a
    ``message`` (``delta`` when streamed), log-probs as ``{"content": [...]}``."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, token_text: TokenText) -> None:
        self._token_text = token_text

    def choice(self, index: int, text: str, logprobs: list | None, reason: str | None) -> dict[str, Any]:
        return {"index": index, "message": {"role": "assistant", "content": text},
                "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": reason}

    def chunk_choice(self, index: int, text: str, logprobs: list | None, reason: str | None) -> dict[str, Any]:
        return {"index": index, "delta": {"content": text} if text else {},
                "logprobs": None if logprobs is None else {"content": logprobs}, "finish_reason": reason}

    def first_chunk_choice(self, index: int) -> dict[str, Any]:
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None}

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self._token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    def logprob_entries(self, response: Response) -> list:
        entries = []
        for i, token_id in enumerate(response.token_ids[:len(response.log_probs)]):
            top = response.top_logprobs[i] if i < len(response.top_logprobs) else {}
            entries.append({**self._entry(token_id, response.log_probs[i]),
                            "top_logprobs": [self._entry(t, lp) for t, lp in
                                             sorted(top.items(), key=lambda item: -item[1])]})
        return entries


def envelope(fmt, request_id: str, model: str, created: int, choices: list, chunk: bool,
             usage_: dict[str, int] | None = None, include_usage: bool = False) -> dict[str, Any]:
    """A completion object, or a chunk (``chunk``) of one; a chunk carries ``usage`` only when the request
    asked for usage (None but in its last chunk)."""
    body = {"id": request_id, "object": fmt.chunk_object_name if chunk else fmt.object_name,
            "created": created, "model": model, "choices": choices}
    if not chunk or include_usage:
        body["usage"] = usage_
    return body


def now_s() -> int:
    return int(time.time())
