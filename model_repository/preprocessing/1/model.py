"""preprocessing: text -> token ids (TensorRT-LLM's preprocessing tensors), with the engine's tokenizer (parameter ``tokenizer_dir``).
A thin adapter over :func:`kilnlm.runtime.serving.trtllm.preprocess`; a bad request gets an INVALID_ARG error
naming the input. Loads no engine (:class:`kilnlm.runtime.serving.triton_backend.TokenizerModel`).
"""

from __future__ import annotations

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
from kilnlm.runtime.serving.trtllm import preprocess  # noqa: E402


class TritonPythonModel:
    def initialize(self, args):
        self._model = triton_backend.TokenizerModel(pb_utils, args, preprocess, "add_special_tokens")

    def execute(self, requests):
        return self._model.execute(requests)
