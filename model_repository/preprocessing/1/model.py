"""preprocessing: text -> token ids (TensorRT-LLM's preprocessing tensors), with the engine's tokenizer (parameter ``tokenizer_dir``).
A thin adapter over :func:`kilnlm.runtime.serving.trtllm.preprocess`; a bad request gets an INVALID_ARG error
naming the input. Loads no engine and no torch.
"""

from __future__ import annotations

import json
import os
import site
import sys


def _add_launcher_python_path() -> None:
    """Put the launching interpreter's package folders on sys.path (the stubs nvidia-pytriton ships embed
    the system's libpython, which ignores PYTHONPATH; the launcher, kilnlm.runtime.serving.launcher,
    exports its sys.path as PYTHONPATH). Its package folders (not another interpreter's standard library)
    go first, their .pth files processed (a venv's editable installs)."""
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    packages = [p for p in entries if os.path.isdir(p) and not os.path.exists(os.path.join(p, "os.py"))
                and not p.rstrip("/").endswith("lib-dynload") and p not in sys.path]
    sys.path[0:0] = packages
    for p in packages:
        site.addsitedir(p)


_add_launcher_python_path()

import triton_python_backend_utils as pb_utils  # noqa: E402  (after the path set-up above)

from kilnlm.runtime.errors import RequestError  # noqa: E402
from kilnlm.runtime.serving import triton_backend  # noqa: E402
from kilnlm.runtime.serving.parameters import parameter_value  # noqa: E402
from kilnlm.runtime.serving.trtllm import preprocess  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = triton_backend.model_parameters(json.loads(args["model_config"]))
        self._tokenizer = triton_backend.load_tokenizer(args["model_repository"], params)
        self._add_special_tokens = parameter_value(params.get("add_special_tokens", "true"), "bool") is not False

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                outputs = preprocess(triton_backend.array_reader(pb_utils, request), self._tokenizer, self._add_special_tokens)
            except RequestError as exc:
                responses.append(triton_backend.error_response(pb_utils, str(exc), internal=False))
                continue
            responses.append(pb_utils.InferenceResponse(
                output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()]))
        return responses
