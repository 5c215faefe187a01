"""TensorRT-LLM's ``inflight_batcher_llm`` tensor conventions, framework-free: what the ``preprocessing``,
``tensorrt_llm`` and ``postprocessing`` models of ``model_repository/`` compute (their ``model.py`` files
only move tensors in and out of Triton).

Every model has ``max_batch_size`` > 0, as TensorRT-LLM's, so each tensor carries a leading batch dimension
``B`` (a client's ``[1, 1]``-shaped scalar, Triton's ``generate`` endpoint adds it to JSON values).

Word lists (``stop_words_list`` / ``bad_words_list``, preprocessing's ``*_WORDS_IDS``): TensorRT-LLM's
``[2, N]`` int32 offsets format, one per batch row::

    row 0: the words' token ids, concatenated, padded with 0      e.g. [ 9,  4, 7,  0]  (words [9, 4], [7])
    row 1: each word's end offset into row 0, padded with -1           [ 2,  3, -1, -1]

No words is ``[[0], [-1]]``.

``tensorrt_llm`` (:class:`LLMProtocol`): inputs -> ``SamplingParams`` (:func:`parse_llm_request`); one
request per call (``B`` = 1: send one request per prompt; the executor batches in flight). Sampling as
TensorRT-LLM decides it: greedy when ``runtime_top_k`` is 1, or when neither ``runtime_top_k`` > 1 nor
``runtime_top_p`` in (0, 1) is sent; otherwise sampling at ``temperature`` (default 1.0).
``runtime_top_p`` 0 means "off" (kilnlm's 1.0). Stop words arrive as token ids while kilnlm's executor
stops on strings: each id sequence is decoded to its text (special tokens kept) and becomes a stop string,
so generation stops when that text appears in the output, also across other token boundaries than the
ids sent (TensorRT-LLM matches the exact ids); the output is cut before it, as TensorRT-LLM's.
Inputs kilnlm cannot honour (:data:`REFUSED_INPUTS`) are refused, naming the input, when a request sends
a value other than TensorRT-LLM's default.

Outputs per response (:meth:`LLMShaper.add`), TensorRT-LLM's names and dtypes, beam dimension 1::

    output_ids        [1, 1, n]  int32    streaming: the new ids; else the whole sequence (the prompt's
                                          ids first unless exclude_input_in_output)
    sequence_length   [1, 1]     int32    n
    cum_log_probs     [1, 1]     float32  sum of the generated tokens' log-probs (0 without return_log_probs)
    output_log_probs  [1, 1, m]  float32  each generated token's log-prob, m = generated tokens in output_ids
    sequence_index    [1, 1]     int32    which of num_return_sequences
    batch_index       [1, 1]     int32    0
    num_input_tokens  [1, 1]     int32    prompt tokens
    num_output_tokens [1, 1]     int32    generated tokens in this response
    output_text       [1, 1]     bytes    kilnlm extension: the same tokens as text, detokenized
                                          incrementally by the executor (whole characters, spaces kept)
    finish_reason     [1, 1]     bytes    kilnlm extension: "" until a sequence's last response

Streamed text: decoding each response's new ids alone drops a word's leading space (SentencePiece / BPE
decoders strip it at the start of a sequence) and splits multi-byte characters across responses, TensorRT-
LLM's known streaming defects. ``output_text`` carries the executor's incrementally detokenized text
instead; the ensemble maps it to postprocessing's optional ``OUTPUT_TEXT`` input, which postprocessing
passes through in preference to decoding ``TOKENS_BATCH`` (:func:`postprocess`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from kilnlm.runtime.errors import RequestError

if TYPE_CHECKING:
    from kilnlm.runtime.request import Response, SamplingParams

ArrayReader = Callable[[str], "np.ndarray | None"]  # an input tensor by name (None when not sent)

# TensorRT-LLM inputs kilnlm cannot honour -> the value that changes nothing (None: any value is refused).
REFUSED_INPUTS: dict[str, Any] = {
    "beam_width": 1, "len_penalty": 1.0, "early_stopping": False, "beam_search_diversity_rate": 0.0,
    "return_context_logits": False, "return_generation_logits": False, "return_perf_metrics": False,
    "stop": False, "runtime_top_p_min": None, "runtime_top_p_decay": None, "runtime_top_p_reset_ids": None,
    "embedding_bias": None, "prompt_embedding_table": None, "prompt_vocab_size": None,
    "prompt_table_extra_ids": None, "lora_task_id": None, "lora_weights": None, "lora_config": None,
    "draft_input_ids": None, "draft_logits": None, "draft_acceptance_threshold": None,
    "encoder_input_features": None, "decoder_input_ids": None,
}
REFUSAL_REASONS = {"beam_width": "kilnlm samples one beam per sequence: use num_return_sequences for several",
                   "lora_task_id": "kilnlm engines carry no LoRA adapters", "lora_weights": "kilnlm engines "
                   "carry no LoRA adapters", "lora_config": "kilnlm engines carry no LoRA adapters"}


class BadRequest(RequestError):
    """A request's tensors are invalid or ask for what kilnlm cannot do; the message names the input."""


# ------------------------------------------------------------------------------------------ word lists
def encode_words_list(words: Sequence[Sequence[int]]) -> np.ndarray:
    """Token-id words -> TensorRT-LLM's ``[2, N]`` int32 offsets array (see the module docstring)."""
    words = [list(w) for w in words if len(w)]
    flat = [t for w in words for t in w]
    width = max(len(flat), len(words), 1)
    out = np.zeros((2, width), dtype=np.int32)
    out[1, :] = -1
    out[0, :len(flat)] = flat
    out[1, :len(words)] = np.cumsum([len(w) for w in words], dtype=np.int64) if words else []
    return out


def decode_words_list(array: np.ndarray) -> list[list[int]]:
    """TensorRT-LLM's ``[2, N]`` offsets array -> its words. Raises :class:`BadRequest` for a malformed one."""
    array = np.asarray(array)
    if array.ndim != 2 or array.shape[0] != 2:
        raise BadRequest(f"a words list must have shape [2, N] (ids, end offsets), got {list(array.shape)}")
    ids, offsets = array[0].tolist(), [int(o) for o in array[1].tolist() if o >= 0]
    if any(b <= a for a, b in zip([0, *offsets], offsets)) or (offsets and offsets[-1] > len(ids)):
        raise BadRequest(f"a words list's end offsets {offsets} must increase and stay within its {len(ids)} ids")
    return [ids[a:b] for a, b in zip([0, *offsets], offsets)]


# --------------------------------------------------------------------------------------- preprocessing
def _strings(array: np.ndarray | None) -> list[str]:
    if array is None:
        return []
    try:
        return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in np.asarray(array).reshape(-1)]
    except UnicodeDecodeError as exc:
        raise BadRequest(f"a text input is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _row(array: np.ndarray | None, row: int) -> np.ndarray | None:
    return None if array is None else np.asarray(array)[row]


def preprocess(read: ArrayReader, tokenizer, add_special_tokens: bool = True) -> dict[str, np.ndarray]:
    """The ``preprocessing`` model: ``QUERY [B, 1]`` text, ``REQUEST_OUTPUT_LEN [B, 1]``, optional
    ``BAD_WORDS_DICT`` / ``STOP_WORDS_DICT [B, W]`` strings (each one word; "" ignored), ``END_ID`` /
    ``PAD_ID [B, 1]``, kilnlm's ``APPLY_CHAT_TEMPLATE [B, 1]`` (true: the query is one user message in the
    engine's chat template, tokenized without adding special tokens again) -> ``INPUT_ID [B, L]`` int32 (padded with the pad id), ``REQUEST_INPUT_LEN [B, 1]``,
    ``BAD_WORDS_IDS`` / ``STOP_WORDS_IDS [B, 2, N]``, ``REQUEST_OUTPUT_LEN [B, 1]``, ``OUT_END_ID`` /
    ``OUT_PAD_ID [B, 1]`` (default: the tokenizer's EOS id; pad defaults to the end id).

    Words are tokenized without special tokens (a stop word as the model writes it after a space should be
    sent with its space). Raises :class:`BadRequest` for a missing or empty QUERY, or text not UTF-8.
    """
    queries = read("QUERY")
    if queries is None:
        raise BadRequest("'QUERY' (text_input) is required")
    batch = np.asarray(queries).shape[0]
    texts = [_strings(_row(queries, b)) for b in range(batch)]
    if any(len(t) != 1 or not t[0] for t in texts):
        raise BadRequest("'text_input' must be one non-empty UTF-8 string per request")
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    end_ids = read("END_ID")
    pad_ids = read("PAD_ID")
    end = [int(np.asarray(end_ids)[b].reshape(-1)[0]) if end_ids is not None else eos for b in range(batch)]
    pad = [int(np.asarray(pad_ids)[b].reshape(-1)[0]) if pad_ids is not None else end[b] for b in range(batch)]
    chat = read("APPLY_CHAT_TEMPLATE")
    chat = [False] * batch if chat is None else [bool(np.asarray(chat)[b].reshape(-1)[0]) for b in range(batch)]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t[0]}]),
                                add_special_tokens=False) if chat[b] else
               tokenizer.encode(t[0], add_special_tokens=add_special_tokens) for b, t in enumerate(texts)]
    input_ids = np.array([[*p, *[pad[b]] * (max(map(len, prompts)) - len(p))] for b, p in enumerate(prompts)],
                         dtype=np.int32)

    def words(name: str) -> np.ndarray:
        lists = [encode_words_list([tokenizer.encode(w, add_special_tokens=False)
                                    for w in _strings(_row(read(name), b)) if w]) for b in range(batch)]
        width = max(a.shape[1] for a in lists)
        out = np.zeros((batch, 2, width), dtype=np.int32)
        out[:, 1, :] = -1
        for b, a in enumerate(lists):
            out[b, :, :a.shape[1]] = a
        return out

    output_len = read("REQUEST_OUTPUT_LEN")
    if output_len is None:
        raise BadRequest("'REQUEST_OUTPUT_LEN' (max_tokens) is required")
    return {
        "INPUT_ID": input_ids,
        "REQUEST_INPUT_LEN": np.array([[len(p)] for p in prompts], dtype=np.int32),
        "BAD_WORDS_IDS": words("BAD_WORDS_DICT"),
        "STOP_WORDS_IDS": words("STOP_WORDS_DICT"),
        "REQUEST_OUTPUT_LEN": np.asarray(output_len, dtype=np.int32).reshape(batch, -1)[:, :1],
        "OUT_END_ID": np.array([[e] for e in end], dtype=np.int32),
        "OUT_PAD_ID": np.array([[p] for p in pad], dtype=np.int32),
    }


# -------------------------------------------------------------------------------------- postprocessing
def postprocess(read: ArrayReader, tokenizer, skip_special_tokens: bool = True) -> dict[str, np.ndarray]:
    """The ``postprocessing`` model: ``TOKENS_BATCH [B, beams, L]`` int32 and ``SEQUENCE_LENGTH [B, beams]``
    -> ``OUTPUT [B, beams]`` text (UTF-8 bytes). When the optional kilnlm input ``OUTPUT_TEXT [B, beams]``
    (the executor's incrementally detokenized text, see the module docstring) is sent, it is the output;
    otherwise the first SEQUENCE_LENGTH ids of each beam are decoded."""
    text = read("OUTPUT_TEXT")
    if text is not None:
        return {"OUTPUT": np.asarray(text, dtype=np.object_)}
    tokens, lengths = read("TOKENS_BATCH"), read("SEQUENCE_LENGTH")
    if tokens is None or lengths is None:
        raise BadRequest("'TOKENS_BATCH' and 'SEQUENCE_LENGTH' are required")
    tokens, lengths = np.asarray(tokens), np.asarray(lengths).reshape(tokens.shape[:2])
    out = np.empty(tokens.shape[:2], dtype=np.object_)
    for b in range(tokens.shape[0]):
        for beam in range(tokens.shape[1]):
            ids = tokens[b, beam, :int(lengths[b, beam])].tolist()
            out[b, beam] = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).encode("utf-8")
    return {"OUTPUT": out}


# ---------------------------------------------------------------------------------------- tensorrt_llm
@dataclasses.dataclass(frozen=True)
class LLMRequest:
    """A ``tensorrt_llm`` request after parsing: ``prompt_ids``, ``sampling``, ``streaming``,
    ``exclude_input_in_output``."""

    prompt_ids: list[int]
    sampling: "SamplingParams"
    streaming: bool = False
    exclude_input_in_output: bool = False


def _scalar(read: ArrayReader, name: str, kind: type, default=None):
    array = read(name)
    if array is None:
        return default
    values = np.asarray(array).reshape(-1)
    if values.size == 0:
        return default
    if values.size != 1:
        raise BadRequest(f"'{name}' must hold one value per request, got {values.size}")
    return kind(values[0].item() if hasattr(values[0], "item") else values[0])


def refuse_unsupported(read: ArrayReader) -> None:
    """Raise :class:`BadRequest` naming the first :data:`REFUSED_INPUTS` input whose value is not its
    harmless default."""
    for name, harmless in REFUSED_INPUTS.items():
        array = read(name)
        if array is None or np.asarray(array).size == 0:
            continue
        values = np.asarray(array).reshape(-1).tolist()
        if harmless is not None and all(v == harmless for v in values):
            continue
        reason = REFUSAL_REASONS.get(name, "kilnlm does not implement it")
        raise BadRequest(f"'{name}' = {values[:4]} is not supported ({reason}); leave it out"
                         + ("" if harmless is None else f" or send {harmless!r}"))


def parse_llm_request(read: ArrayReader, tokenizer) -> LLMRequest:
    """The ``tensorrt_llm`` model's inputs (see the module docstring) -> an :class:`LLMRequest`.

    Raises:
        BadRequest: a batch of several requests, missing ``input_ids`` / ``request_output_len``, a malformed
            words list, a guide type without a guide, or a refused input (:func:`refuse_unsupported`).
            Value ranges are checked by ``SamplingParams.validate`` when the executor takes the request.
    """
    from kilnlm.runtime.request import GuidedDecodingParams, SamplingParams

    refuse_unsupported(read)
    input_ids = read("input_ids")
    if input_ids is None:
        raise BadRequest("'input_ids' is required")
    input_ids = np.asarray(input_ids)
    if input_ids.ndim == 2 and input_ids.shape[0] != 1:
        raise BadRequest(f"a tensorrt_llm request carries a batch of {input_ids.shape[0]}: send one request "
                         "per prompt (the executor batches them in flight)")
    ids = input_ids.reshape(-1).tolist()
    length = _scalar(read, "input_lengths", int, len(ids))
    if not 0 < length <= len(ids):
        raise BadRequest(f"'input_lengths' is {length}: it must be in [1, {len(ids)}] (the ids sent)")
    max_tokens = _scalar(read, "request_output_len", int)
    if max_tokens is None:
        raise BadRequest("'request_output_len' is required")
    top_k = _scalar(read, "runtime_top_k", int, 0)
    top_p = _scalar(read, "runtime_top_p", float, 0.0)
    top_p = 1.0 if top_p == 0.0 else top_p  # TensorRT-LLM's "off" is 0 (out-of-range values: validate refuses)
    greedy = top_k == 1 or (top_k == 0 and top_p == 1.0)
    temperature = 0.0 if greedy else _scalar(read, "temperature", float, 1.0)
    guide_type = _scalar(read, "guided_decoding_guide_type", lambda v: _strings(np.array([v]))[0])
    guide = _scalar(read, "guided_decoding_guide", lambda v: _strings(np.array([v]))[0])
    if guide is not None and guide_type is None:
        raise BadRequest("'guided_decoding_guide' needs 'guided_decoding_guide_type'")

    def word_list(name: str) -> list[list[int]]:
        array = read(name)
        return [] if array is None else decode_words_list(np.asarray(array).reshape(2, -1))

    stop = tuple(tokenizer.decode(w, skip_special_tokens=False) for w in word_list("stop_words_list"))
    optional = {"end_id": _scalar(read, "end_id", int), "seed": _scalar(read, "seed", int),
                "num_speculative_tokens": _scalar(read, "num_speculative_tokens", int)}
    sampling = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_k=0 if greedy else top_k,
        top_p=top_p, stop=tuple(s for s in stop if s),
        bad_words=word_list("bad_words_list"),
        repetition_penalty=_scalar(read, "repetition_penalty", float, 1.0),
        presence_penalty=_scalar(read, "presence_penalty", float, 0.0),
        frequency_penalty=_scalar(read, "frequency_penalty", float, 0.0),
        min_tokens=_scalar(read, "min_tokens", int, 0),
        n=_scalar(read, "num_return_sequences", int, 1),
        logprobs=0 if _scalar(read, "return_log_probs", bool, False) else None,
        guided_decoding=None if guide_type is None else GuidedDecodingParams(guide_type, guide),
        **{k: v for k, v in optional.items() if v is not None},
    )
    return LLMRequest(ids[:length], sampling, streaming=_scalar(read, "streaming", bool, False),
                      exclude_input_in_output=_scalar(read, "exclude_input_in_output", bool, False))


@dataclasses.dataclass(frozen=True)
class LLMReply:
    """One response of the ``tensorrt_llm`` model: its output tensors (``outputs``), ``final`` (the
    request's last), ``finish_reason`` (of its sequence; "" before its last), ``error`` (an executor failure)."""

    outputs: dict[str, np.ndarray]
    final: bool = False
    finish_reason: str = ""
    error: str | None = None


@dataclasses.dataclass
class _Sequence:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    log_probs: list[float] = dataclasses.field(default_factory=list)
    text: list[str] = dataclasses.field(default_factory=list)
    cum_log_prob: float = 0.0
    finished: bool = False


class LLMShaper:
    """One ``tensorrt_llm`` request's executor responses -> its :class:`LLMReply`\\ s (the module
    docstring's outputs). Streaming: one reply per response with new ids; else one reply per sequence,
    when it finishes. ``final`` is set on the reply after which every sequence has finished. Not
    thread-safe: one owner (the dispatcher thread)."""

    def __init__(self, request: LLMRequest, prompt_text: str) -> None:
        self._request = request
        self._prompt_text = prompt_text
        self._sequences = [_Sequence() for _ in range(request.sampling.n)]

    def add(self, response: "Response") -> LLMReply | None:
        from kilnlm.runtime.serving.responses import finish_reason_name

        seq = self._sequences[response.sequence_index]
        reason = finish_reason_name(response) if response.finished else ""
        seq.finished = seq.finished or response.finished
        final = all(s.finished for s in self._sequences)
        if reason == "error":
            return LLMReply({}, final=True, finish_reason=reason, error=f"kilnlm executor error: {response.error}")
        new_ids = list(response.token_ids)
        new_log_probs = list(response.log_probs) or [0.0] * len(new_ids)
        if response.cum_log_prob is not None:
            seq.cum_log_prob = float(response.cum_log_prob)
        if self._request.streaming:
            if not (new_ids or response.text or response.finished):
                return None
            return self._reply(response, new_ids, new_log_probs, response.text, reason, final)
        seq.token_ids += new_ids
        seq.log_probs += new_log_probs
        seq.text.append(response.text)
        if not response.finished:
            return None
        ids, text = seq.token_ids, "".join(seq.text)
        if not self._request.exclude_input_in_output:
            ids, text = [*self._request.prompt_ids, *ids], self._prompt_text + text
        return self._reply(response, ids, seq.log_probs, text, reason, final)

    def _reply(self, response, ids, log_probs, text, reason, final) -> LLMReply:
        seq = self._sequences[response.sequence_index]
        num_generated = len(log_probs)
        scalar = lambda v, dtype=np.int32: np.array([[v]], dtype=dtype)  # noqa: E731
        return LLMReply({
            "output_ids": np.array([[ids]], dtype=np.int32).reshape(1, 1, len(ids)),
            "sequence_length": scalar(len(ids)),
            "cum_log_probs": scalar(seq.cum_log_prob, np.float32),
            "output_log_probs": np.array(log_probs, dtype=np.float32).reshape(1, 1, num_generated),
            "sequence_index": scalar(response.sequence_index),
            "batch_index": scalar(0),
            "num_input_tokens": scalar(len(self._request.prompt_ids)),
            "num_output_tokens": scalar(num_generated),
            "output_text": np.array([[text.encode("utf-8")]], dtype=np.object_),
            "finish_reason": np.array([[reason.encode("utf-8")]], dtype=np.object_),
        }, final=final, finish_reason=reason)


class LLMProtocol:
    """The ``tensorrt_llm`` model's protocol for :class:`~kilnlm.runtime.serving.dispatcher.RequestDispatcher`:
    ``prepare(read, tokenizer) -> (prompt_ids, sampling, shaper)``.

    ``eos_token_ids``: the engine's end ids. An ``end_id`` among them (preprocessing sends the tokenizer's
    EOS id when the client sends none) keeps all of them as end ids, as the engine's generation defaults
    say; another ``end_id`` replaces them. ``decoupled``: whether the model is served decoupled; a model
    that is not answers each request exactly once, so ``streaming`` and ``num_return_sequences`` > 1 are
    refused there (:class:`BadRequest` naming the input), as TensorRT-LLM refuses streaming."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset(), decoupled: bool = True) -> None:
        self._eos_token_ids = frozenset(eos_token_ids)
        self._decoupled = decoupled

    def prepare(self, read: ArrayReader, tokenizer):
        request = parse_llm_request(read, tokenizer)
        if not self._decoupled and (request.streaming or request.sampling.n > 1):
            name = "streaming" if request.streaming else "num_return_sequences"
            raise BadRequest(f"'{name}' needs several responses per request, but the tensorrt_llm model is not "
                             "decoupled: serve it with decoupled_mode true (model_transaction_policy "
                             "{ decoupled: true }; launch_triton.py --decoupled-mode true)")
        if request.sampling.end_id in self._eos_token_ids:
            request = dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, end_id=None))
        prompt_text = "" if request.exclude_input_in_output or request.streaming else \
            tokenizer.decode(request.prompt_ids, skip_special_tokens=True)
        return request.prompt_ids, request.sampling, LLMShaper(request, prompt_text)


# ------------------------------------------------------------------------------------- the ensemble's wiring
# The ensemble's steps as {step tensor: ensemble or intermediate tensor} maps (the wiring of
# model_repository/ensemble/config.pbtxt; tensorrt_llm_bls follows it with BLS calls).
# preprocessing input <- ensemble input
PREPROCESSING_INPUTS: dict[str, str] = {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT":
    "bad_words", "STOP_WORDS_DICT": "stop_words", "END_ID": "end_id", "PAD_ID": "pad_id",
    "APPLY_CHAT_TEMPLATE": "apply_chat_template"}
# preprocessing output -> intermediate
PREPROCESSING_OUTPUTS: dict[str, str] = {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
    "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS": "_STOP_WORDS_IDS", "BAD_WORDS_IDS":
    "_BAD_WORDS_IDS", "OUT_END_ID": "_PREPROCESSOR_END_ID", "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID"}
# tensorrt_llm input <- ensemble input or intermediate
LLM_INPUTS: dict[str, str] = {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
    "request_output_len": "_REQUEST_OUTPUT_LEN", "stop_words_list": "_STOP_WORDS_IDS",
    "bad_words_list": "_BAD_WORDS_IDS", "end_id": "_PREPROCESSOR_END_ID", "pad_id": "_PREPROCESSOR_PAD_ID",
    "exclude_input_in_output": "exclude_input_in_output", "runtime_top_k": "top_k", "runtime_top_p": "top_p",
    "temperature": "temperature", "len_penalty": "length_penalty", "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens", "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "seed": "seed", "return_log_probs": "return_log_probs", "return_context_logits": "return_context_logits",
    "return_generation_logits": "return_generation_logits", "return_perf_metrics": "return_perf_metrics",
    "return_num_input_tokens": "return_num_input_tokens", "return_num_output_tokens": "return_num_output_tokens",
    "num_return_sequences": "num_return_sequences", "num_speculative_tokens": "num_speculative_tokens",
    "beam_width": "beam_width", "streaming": "stream", "prompt_embedding_table": "prompt_embedding_table",
    "prompt_vocab_size": "prompt_vocab_size", "lora_task_id": "lora_task_id", "lora_weights": "lora_weights",
    "lora_config": "lora_config", "guided_decoding_guide_type": "guided_decoding_guide_type",
    "guided_decoding_guide": "guided_decoding_guide"}
# tensorrt_llm output -> ensemble output or intermediate
LLM_OUTPUTS: dict[str, str] = {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH", "output_text":
    "_OUTPUT_TEXT", "cum_log_probs": "cum_log_probs", "output_log_probs": "output_log_probs", "batch_index":
    "batch_index", "sequence_index": "sequence_index", "num_input_tokens": "num_input_tokens", "num_output_tokens":
    "num_output_tokens", "finish_reason": "finish_reason"}
# postprocessing input <- intermediate
POSTPROCESSING_INPUTS: dict[str, str] = {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH",
    "OUTPUT_TEXT": "_OUTPUT_TEXT"}
# postprocessing output -> ensemble output
POSTPROCESSING_OUTPUTS: dict[str, str] = {"OUTPUT": "text_output"}
