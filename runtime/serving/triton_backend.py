"""Triton's Python backend, adapted to the framework-free serving modules: request tensors as an
:data:`~kilnlm.runtime.serving.request_parsing.InputReader`, response senders as a dispatcher
:class:`~kilnlm.runtime.serving.dispatcher.Client`, custom metric families as a metrics backend, Triton's
logger as a ``logging.Logger``-like object, and the BLS forwarding of the ``kilnlm_sync`` model.

Everything here takes the ``triton_python_backend_utils`` module (``pb_utils``) as an argument: it exists
only inside tritonserver's Python stub, and this module must import anywhere (tests pass a stand-in).
It imports neither torch nor the executor, so the executor-less ``kilnlm_sync`` model stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from kilnlm.runtime.serving.metrics import MetricKind, MetricSpec
from kilnlm.runtime.serving.responses import OUTPUT_NAMES, Reply, output_arrays

if TYPE_CHECKING:
    from kilnlm.runtime.serving.request_parsing import InputReader


def model_parameters(model_config: Mapping[str, Any]) -> dict[str, str]:
    """``{key: string_value}`` of a Triton model configuration's ``parameters`` (``args["model_config"]``
    parsed from JSON)."""
    return {key: value["string_value"] for key, value in model_config.get("parameters", {}).items()}


def input_reader(pb_utils, request) -> "InputReader":
    """The values of ``request``'s input tensors by name, flattened (None for an input it does not carry)."""

    def read(name: str) -> list | None:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        return None if tensor is None else tensor.as_numpy().reshape(-1).tolist()

    return read


def inference_response(pb_utils, reply: Reply):
    """``reply`` as a ``pb_utils.InferenceResponse`` with the output tensors of
    :func:`kilnlm.runtime.serving.responses.output_arrays`."""
    return pb_utils.InferenceResponse(output_tensors=[
        pb_utils.Tensor(name, array) for name, array in output_arrays(reply).items()])


def error_response(pb_utils, message: str, internal: bool):
    """A response carrying only an error: INTERNAL when ``internal``, else INVALID_ARG (HTTP 400)."""
    code = pb_utils.TritonError.INTERNAL if internal else pb_utils.TritonError.INVALID_ARG
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

    def send_error(self, message: str, internal: bool) -> None:
        self._sender.send(error_response(self._pb_utils, message, internal),
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


def forward_to_decoupled(pb_utils, request, target_model: str, input_names: list[str]):
    """Forward ``request`` (BLS) to the decoupled model ``target_model`` with ``stream`` forced to false and
    return its final response: its output tensors, or its error (code kept) unchanged."""
    inputs = [pb_utils.Tensor("stream", np.array([False]))]
    for name in input_names:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None and name != "stream":
            inputs.append(tensor)
    bls_request = pb_utils.InferenceRequest(model_name=target_model, inputs=inputs,
                                            requested_output_names=list(OUTPUT_NAMES))
    final = None
    for response in bls_request.exec(decoupled=True):
        if response.has_error():
            error = response.error()
            return pb_utils.InferenceResponse(
                output_tensors=[], error=pb_utils.TritonError(error.message(), error.code()))
        if response.output_tensors():
            final = response
    if final is None:
        return pb_utils.InferenceResponse(
            output_tensors=[], error=pb_utils.TritonError(f"model '{target_model}' sent no response"))
    return pb_utils.InferenceResponse(output_tensors=final.output_tensors())
