"""tensorrt_llm_bls: the ensemble's text interface (decoupled), served with BLS calls preprocessing ->
tensorrt_llm -> postprocessing: :func:`kilnlm.runtime.serving.triton_backend.bls_generate`. Holds no
executor and no tokenizer of its own.
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

from kilnlm.runtime.serving import triton_backend  # noqa: E402
from kilnlm.runtime.serving.responses import ErrorKind  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        params = triton_backend.model_parameters(json.loads(args["model_config"]))
        self._llm_model = params.get("tensorrt_llm_model_name") or "tensorrt_llm"

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                triton_backend.bls_generate(pb_utils, request, sender, self._llm_model)
            except Exception as exc:  # a bug must not leave the client waiting: answer, keep serving
                pb_utils.Logger.log_error(f"kilnlm: tensorrt_llm_bls failed: {exc!r}")
                sender.send(triton_backend.error_response(pb_utils, f"tensorrt_llm_bls failed: {exc}", ErrorKind.INTERNAL),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None
