"""kilnlm_sync: forwards each plain (non-streaming) request to the decoupled ``kilnlm`` model through
BLS and returns its single final response.

Triton serves decoupled models only over gRPC streaming and the HTTP generate extension; HTTP ``/infer``
and gRPC ``ModelInfer`` need a model that answers each request with exactly one response. This model is
that face: same tensors as ``kilnlm`` (see its model.py), ``stream`` forced to false, errors (bad
request, executor failure) passed through unchanged. It holds no executor of its own. The forwarding is
:func:`kilnlm.runtime.serving.triton_backend.forward_to_decoupled`.
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

import triton_python_backend_utils as pb_utils  # noqa: E402

from kilnlm.runtime.serving.triton_backend import forward_to_decoupled, model_parameters  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self._target = model_parameters(config).get("target_model", "kilnlm")
        self._input_names = [i["name"] for i in config["input"]]

    def execute(self, requests):
        return [forward_to_decoupled(pb_utils, request, self._target, self._input_names) for request in requests]
