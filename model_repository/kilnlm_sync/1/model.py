"""kilnlm_sync: forwards each plain (non-streaming) request to the decoupled ``kilnlm`` model through
BLS and returns its single final response.

Triton serves decoupled models only over gRPC streaming and the HTTP generate extension; HTTP ``/infer``
and gRPC ``ModelInfer`` need a model that answers each request with exactly one response. This model is
that face: same tensors as ``kilnlm`` (see its model.py), ``stream`` forced to false, errors (bad
request, executor failure) passed through unchanged. It holds no executor of its own.
"""

from __future__ import annotations

import json
import os
import site
import sys


def _add_launcher_python_path() -> None:
    """Put the launching interpreter's package folders (PYTHONPATH, which this embedded interpreter
    ignores) on sys.path; see kilnlm/1/model.py."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    packages = [p for p in entries if os.path.isdir(p) and not os.path.exists(os.path.join(p, "os.py"))
                and not p.rstrip("/").endswith("lib-dynload") and p not in sys.path]
    sys.path[0:0] = packages
    for p in packages:
        site.addsitedir(p)


_add_launcher_python_path()

import numpy as np  # noqa: E402
import triton_python_backend_utils as pb_utils  # noqa: E402

OUTPUT_NAMES = ["text_output", "output_ids", "sequence_length", "finish_reason"]


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self._target = params.get("target_model", "kilnlm")
        self._input_names = [i["name"] for i in config["input"]]

    def execute(self, requests):
        return [self._forward(request) for request in requests]

    def _forward(self, request):
        inputs = [pb_utils.Tensor("stream", np.array([False]))]
        for name in self._input_names:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None and name != "stream":
                inputs.append(tensor)
        bls_request = pb_utils.InferenceRequest(
            model_name=self._target, inputs=inputs, requested_output_names=OUTPUT_NAMES)
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
                output_tensors=[], error=pb_utils.TritonError(f"model '{self._target}' sent no response"))
        return pb_utils.InferenceResponse(output_tensors=final.output_tensors())
