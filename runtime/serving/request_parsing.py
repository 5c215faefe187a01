"""A generate request's named inputs -> what the executor is given (prompt token ids + ``SamplingParams``).

The inputs carry the names of TensorRT-LLM's ``inflight_batcher_llm`` ensemble, so its clients work
unchanged. All but ``text_input`` are optional; each holds one value except the word lists:

==========================  ==========================================================================
``text_input``              the prompt (UTF-8), tokenized as is unless ``apply_chat_template``
``apply_chat_template``     kilnlm extension: true wraps ``text_input`` as one user message in the
                            engine's chat template (default false, as TensorRT-LLM's ensemble)
``max_tokens``              number of tokens to generate (default: the model's ``default_max_tokens``)
``stream``                  true: one response per new piece of text; false: one final response
``temperature``             0 = greedy (default); > 0 samples
``top_k`` / ``top_p``       0 = off / 1.0 = off
``seed``                    random seed of this request's sampler
``end_id``                  token id that ends generation (default: the engine's EOS ids)
``stop_words``              [N] strings, each one stop string (no comma splitting); generation stops at
                            the first, which is cut from the output (finish reason "stop").
``bad_words``               [N] strings, each tokenized without special tokens; the executor never
                            generates those token sequences. Honoured for that tokenization only (the
                            same word tokenized differently in context, e.g. after a space, is not banned).
``pad_id``                  accepted for compatibility and ignored: responses are never padded
``exclude_input_in_output`` false (default, as TensorRT-LLM): a non-streamed ``text_output`` starts with
                            the prompt; true: only the completion. Streamed responses never repeat it.
==========================  ==========================================================================

How a front hands its inputs over: an :data:`InputReader`, ``read(name) -> list | None``, the input's values
flattened (bytes are decoded as UTF-8 here), or None when the request does not carry it. A Triton request's
tensors and a JSON body (:func:`json_reader`) both fit.

Value ranges are checked once, by ``SamplingParams.validate`` in ``Executor.submit`` (its
:class:`~kilnlm.runtime.errors.RequestError` goes back to the client); parsing checks presence, shapes,
encodings and types, raising :class:`BadRequest` (also a ``RequestError``) with a message naming the input.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

from kilnlm.runtime.errors import RequestError
from kilnlm.runtime.request import SamplingParams

InputReader = Callable[[str], "Sequence[Any] | None"]


class BadRequest(RequestError):
    """A request's inputs are invalid; the message says which input and what is allowed."""


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """What one generate request asks for, after parsing.

    Attributes:
        text: the prompt, non-empty.
        apply_chat_template: wrap ``text`` as one user message in the engine's chat template.
        stream: one reply per new piece of text (True) or one final reply (False).
        exclude_input_in_output: a non-streamed reply's text leaves the prompt out.
        sampling: the sampling parameters, without ``bad_words`` (they need the tokenizer: see
            :func:`prepare_submission`).
        bad_words: strings never to generate, tokenized by :func:`prepare_submission`.
    """

    text: str
    apply_chat_template: bool = False
    stream: bool = False
    exclude_input_in_output: bool = False
    sampling: SamplingParams = SamplingParams()
    bad_words: tuple[str, ...] = ()


def json_reader(body: Mapping[str, Any]) -> InputReader:
    """An :data:`InputReader` over a JSON object (e.g. Triton's ``generate`` body): a scalar is one value,
    a list its values, a missing key or null None."""

    def read(name: str) -> list | None:
        value = body.get(name)
        if value is None:
            return None
        return list(value) if isinstance(value, (list, tuple)) else [value]

    return read


def _values(read: InputReader, name: str) -> list | None:
    values = read(name)
    if values is None:
        return None
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else v for v in values]
    except UnicodeDecodeError as exc:
        raise BadRequest(f"'{name}' is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _scalar(read: InputReader, name: str, default, kind: type | None = None):
    values = _values(read, name)
    if not values:
        return default
    if len(values) != 1:
        raise BadRequest(f"'{name}' must hold one value, got {len(values)}")
    if kind is None:
        return values[0]
    try:
        return kind(values[0])
    except (TypeError, ValueError):
        raise BadRequest(f"'{name}' must be {'an integer' if kind is int else 'a number'}, "
                         f"got {values[0]!r}") from None


def _words(read: InputReader, name: str) -> tuple[str, ...]:
    return tuple(str(w) for w in (_values(read, name) or []) if w)


def parse_request(read: InputReader, default_max_tokens: int) -> GenerateRequest:
    """Read a request's inputs (see the module docstring) into a :class:`GenerateRequest`.

    Args:
        read: the request's inputs by name (an :data:`InputReader`).
        default_max_tokens: ``max_tokens`` when the request does not send one.

    Raises:
        BadRequest: a missing/empty ``text_input``, an input that is not valid UTF-8, a scalar input holding
            several values, or a numeric input that is not a number.
    """
    text = _scalar(read, "text_input", None)
    if not isinstance(text, str) or not text:
        raise BadRequest("'text_input' must be a non-empty UTF-8 string")
    optional = {name: _scalar(read, name, None, int) for name in ("seed", "end_id")}
    sampling = SamplingParams(
        max_tokens=_scalar(read, "max_tokens", default_max_tokens, int),
        temperature=_scalar(read, "temperature", 0.0, float),
        top_k=_scalar(read, "top_k", 0, int),
        top_p=_scalar(read, "top_p", 1.0, float),
        stop=_words(read, "stop_words"),
        **{name: value for name, value in optional.items() if value is not None},
    )
    return GenerateRequest(
        text=text,
        apply_chat_template=bool(_scalar(read, "apply_chat_template", False)),
        stream=bool(_scalar(read, "stream", False)),
        exclude_input_in_output=bool(_scalar(read, "exclude_input_in_output", False)),
        sampling=sampling,
        bad_words=_words(read, "bad_words"),
    )


def prepare_submission(request: GenerateRequest, tokenizer) -> tuple[list[int], SamplingParams]:
    """The arguments of ``Executor.submit`` for ``request``: the prompt token ids (the chat template applied
    when asked, then tokenized without adding special tokens again; else tokenized as is) and the sampling
    parameters with the bad words tokenized (without special tokens; words that tokenize to nothing are
    dropped).

    ``tokenizer``: a :class:`kilnlm.runtime.tokenizer.Tokenizer` (``encode``, ``apply_chat_template``).
    Raises whatever the tokenizer raises for a template it cannot render (a ``RequestError`` where kilnlm's
    template says so).
    """
    bad_words = [tokenizer.encode(w, add_special_tokens=False) for w in request.bad_words]
    params = dataclasses.replace(request.sampling, bad_words=[w for w in bad_words if w])
    if request.apply_chat_template:
        chat = tokenizer.apply_chat_template([{"role": "user", "content": request.text}])
        prompt_ids = tokenizer.encode(chat, add_special_tokens=False)
    else:
        prompt_ids = tokenizer.encode(request.text)
    return list(prompt_ids), params
