"""Triton's Python backend, adapted to the framework-free serving modules: request tensors as an
:data:`~kilnlm.runtime.serving.request_parsing.InputReader`, response senders as a dispatcher
:class:`~kilnlm.runtime.serving.dispatcher.Client`, custom metric families as a metrics backend, Triton's
logger as a ``logging.Logger``-like object, the engine's tokenizer for pre/postprocessing, and the BLS
calls of the ``tensorrt_llm_bls`` model.

Everything here takes the ``triton_python_backend_utils`` module (``pb_utils``) as an argument: it exists
only inside tritonserver's Python stub, and this module must import anywhere (tests pass a stand-in).
It imports neither torch nor the executor, so the executor-less models stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from kilnlm.runtime.errors import RequestError
from kilnlm.runtime.serving.metrics import MetricKind, MetricSpec
from kilnlm.runtime.serving.responses import OUTPUT_NAMES, ErrorKind, Reply, output_arrays
from kilnlm.runtime.serving.trtllm import LLMReply

if TYPE_CHECKING:
    from kilnlm.runtime.serving.request_parsing import InputReader


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """``{key: string_value}`` of a Triton model configuration's ``parameters`` (``args["model_config"]``
    parsed from JSON)."""
    return {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}


def load_tokenizer(model_dir: str, params: dict[str, str]):
    """The engine's tokenizer named by the ``tokenizer_dir`` parameter (absolute, or relative to
    ``model_dir``; default "tokenizer"). Raises :class:`kilnlm.runtime.errors.EngineError` when missing."""
    import os

    from kilnlm.runtime.tokenizer import Tokenizer

    return Tokenizer.from_dir(os.path.join(model_dir, params.get("tokenizer_dir") or "tokenizer"))


class TokenizerModel:
    """The whole of the ``preprocessing`` and ``postprocessing`` models: the engine's tokenizer (parameter
    ``tokenizer_dir``, :func:`load_tokenizer`) and one conversion per request,
    ``convert(read, tokenizer, flag) -> {output name: array}`` (``read``: :func:`array_reader`; ``flag``: the
    boolean model parameter ``flag_name``, default true). A conversion's :class:`RequestError` becomes that
    request's INVALID_ARG response; the other requests of the batch are answered as usual."""

    def __init__(self, pb_utils, args: Mapping[str, Any], convert: Callable, flag_name: str) -> None:
        import json

        from kilnlm.runtime.serving.parameters import parameter_value

        params = model_parameters(json.loads(args["model_config"]))
        self._pb_utils = pb_utils
        self._convert = convert
        self._tokenizer = load_tokenizer(args["model_repository"], params)
        self._flag = parameter_value(params.get(flag_name, "true"), "bool") is not False

    def execute(self, requests) -> list:
        pb_utils = self._pb_utils
        responses = []
        for request in requests:
            try:
                outputs = self._convert(array_reader(pb_utils, request), self._tokenizer, self._flag)
            except RequestError as exc:
                responses.append(error_response(pb_utils, str(exc), ErrorKind.INVALID_REQUEST))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]))
        return responses


def input_reader(pb_utils, request) -> "InputReader":
    """The values of ``request``'s input tensors by name, flattened (None for an input it does not carry)."""

    def read(name: str) -> list | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy().reshape(-1).tolist()

    return read


def inference_response(pb_utils, reply):
    """``reply`` as a ``pb_utils.InferenceResponse``: a :class:`~kilnlm.runtime.serving.trtllm.LLMReply`'s
    ``outputs``, or a text :class:`Reply`'s tensors (:func:`kilnlm.runtime.serving.responses.output_arrays`)."""
    arrays = reply.outputs if isinstance(reply, LLMReply) else output_arrays(reply)
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array) for name, array in arrays.items()])


def array_reader(pb_utils, request):
    """``read(name) -> numpy array | None``: ``request``'s input tensors as they are (batch dimension
    kept), for :mod:`kilnlm.runtime.serving.trtllm`."""

    def read(name: str):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy()

    return read


def error_response(pb_utils, message: str, kind: ErrorKind):
    """A response carrying only an error, with the Triton code of ``kind``: INVALID_ARG (HTTP 400),
    UNAVAILABLE (503) or INTERNAL (500)."""
    code = getattr(pb_utils.TritonError, {ErrorKind.INVALID_REQUEST: "INVALID_ARG", ErrorKind.UNAVAILABLE: "UNAVAILABLE",
                                          ErrorKind.INTERNAL: "INTERNAL"}[kind])
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(message, code))


class TritonClient:
    """A decoupled request's response sender as a dispatcher :class:`Client`."""

    def __init__(self, pb_utils, sender) -> None:
        self._pb_utils = pb_utils
        self._sender = sender

    def send(self, reply: Reply) -> None:
        response = inference_response(self._pb_utils, reply)
        if reply.final:
            self._sender.send(response, flags=self._pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        else:
            self._sender.send(response)

    def send_error(self, message: str, kind: ErrorKind) -> None:
        self._sender.send(error_response(self._pb_utils, message, kind),
                          flags=self._pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def is_cancelled(self) -> bool:
        return self._sender.is_cancelled()

    def close(self) -> None:
        self._sender.send(flags=self._pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


class TritonLog:
    """Triton's logger (``pb_utils.Logger``) with the ``info`` / ``warning`` / ``error`` methods of
    ``logging.Logger``."""

    def __init__(self, pb_utils) -> None:
        self._logger = pb_utils.Logger

    def info(self, message: str) -> None:
        self._logger.log_info(message)

    def warning(self, message: str) -> None:
        self._logger.log_warn(message)

    def error(self, message: str) -> None:
        self._logger.log_error(message)


class _TritonFamily:
    def __init__(self, family) -> None:
        self._family = family

    def metric(self, labels: dict[str, str], buckets: list[float] | None = None):
        if buckets is None:
            return self._family.Metric(labels=labels)
        return self._family.Metric(labels=labels, buckets=buckets)


class TritonMetricsBackend:
    """Triton's custom metrics (``pb_utils.MetricFamily``; served on the metrics port next to Triton's own)
    as a :class:`~kilnlm.runtime.serving.metrics.Metrics` backend."""

    def __init__(self, pb_utils) -> None:
        self._pb_utils = pb_utils

    def family(self, spec: MetricSpec) -> _TritonFamily:
        family_cls = self._pb_utils.MetricFamily
        kind = {MetricKind.GAUGE: family_cls.GAUGE, MetricKind.COUNTER: family_cls.COUNTER,
                MetricKind.HISTOGRAM: family_cls.HISTOGRAM}[spec.kind]
        return _TritonFamily(family_cls(spec.name, spec.description, kind))


def bls_generate(pb_utils, request, sender, llm_model: str = "tensorrt_llm") -> None:
    """Serve one ``tensorrt_llm_bls`` request (the ensemble's text interface, decoupled) with BLS calls
    preprocessing -> ``llm_model`` -> postprocessing, wired as the ensemble
    (:mod:`kilnlm.runtime.serving.trtllm`'s step maps): every ``llm_model`` response (one per streamed
    piece, or one per sequence) is postprocessed and sent; the last carries the final flag. An error of
    any step is sent as the request's final response, its code kept."""
    from kilnlm.runtime.serving import trtllm

    def fail(error) -> None:
        sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
            error.message(), error.code())), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    tensors = {}  # ensemble and intermediate tensors by name
    for name in set(trtllm.PREPROCESSING_INPUTS.values()) | set(trtllm.LLM_INPUTS.values()):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            tensors[name] = tensor.as_numpy()

    def call(model: str, inputs: dict[str, str], outputs: dict[str, str], decoupled: bool):
        bls_inputs = [pb_utils.Tensor(step_name, tensors[name]) for step_name, name in inputs.items()
                      if name in tensors]
        bls_request = pb_utils.InferenceRequest(model_name=model, inputs=bls_inputs,
                                                requested_output_names=list(outputs))
        return bls_request.exec(decoupled=True) if decoupled else [bls_request.exec()]

    [pre] = call("preprocessing", trtllm.PREPROCESSING_INPUTS, trtllm.PREPROCESSING_OUTPUTS, False)
    if pre.has_error():
        return fail(pre.error())
    for step_name, name in trtllm.PREPROCESSING_OUTPUTS.items():
        tensors[name] = pb_utils.get_output_tensor_by_name(pre, step_name).as_numpy()
    num_sequences = int(tensors["num_return_sequences"].reshape(-1)[0]) if "num_return_sequences" in tensors else 1
    num_finished = 0
    for response in call(llm_model, trtllm.LLM_INPUTS, trtllm.LLM_OUTPUTS, True):
        if response.has_error():
            return fail(response.error())
        if not response.output_tensors():
            continue  # the empty final flag of a decoupled stream
        for step_name, name in trtllm.LLM_OUTPUTS.items():
            tensors[name] = pb_utils.get_output_tensor_by_name(response, step_name).as_numpy()
        [post] = call("postprocessing", trtllm.POSTPROCESSING_INPUTS, trtllm.POSTPROCESSING_OUTPUTS, False)
        if post.has_error():
            return fail(post.error())
        tensors["text_output"] = pb_utils.get_output_tensor_by_name(post, "OUTPUT").as_numpy()
        num_finished += any(tensors["finish_reason"].reshape(-1))  # a sequence's last response
        reply = pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(name, tensors[name]) for name in ("text_output", *BLS_PASSED_OUTPUTS)])
        if num_finished >= num_sequences:
            return sender.send(reply, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        sender.send(reply)
    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)


# tensorrt_llm outputs that the ensemble (and tensorrt_llm_bls) return as they are.
BLS_PASSED_OUTPUTS = ("cum_log_probs", "output_log_probs", "batch_index", "sequence_index", "num_input_tokens",
                      "num_output_tokens", "finish_reason")
