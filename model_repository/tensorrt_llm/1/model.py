"""tensorrt_llm: TensorRT-LLM's LLM model (token ids in, token ids out; decoupled unless served with
decoupled_mode false), hosting kilnlm's in-flight-batching executor. A thin adapter over :mod:`kilnlm.runtime.serving`: each request is parsed
(:class:`kilnlm.runtime.serving.trtllm.LLMProtocol`, TensorRT-LLM's tensors) and submitted to one executor
by a :class:`~kilnlm.runtime.serving.dispatcher.RequestDispatcher`; ``execute`` returns at once, and the
dispatcher thread sends the responses. Bad requests (a refused input such as beam_width 2, a LoRA input,
a value out of range) get one INVALID_ARG error response naming the input; a cancelled client's request is
cancelled in the executor, which frees its KV-cache blocks. Metrics (on Triton's metrics port):
:mod:`kilnlm.runtime.serving.metrics`. Engine and executor settings: the config.pbtxt parameters (see
:mod:`kilnlm.runtime.distribution.engine_source` and :mod:`kilnlm.runtime.serving.parameters`).
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

# Nothing imported here imports torch (1.1-2.0 s): initialize starts the engine's SHA-256 checks first.
from kilnlm.runtime.distribution.engine_source import resolve_served_engine, served_trusted_keys  # noqa: E402
from kilnlm.runtime.manifest import prehash_engine_files  # noqa: E402
from kilnlm.runtime.serving import triton_backend  # noqa: E402


class TritonPythonModel:
    """One executor per model instance, served through one request dispatcher."""

    def initialize(self, args):
        model_config = json.loads(args["model_config"])
        params = triton_backend.model_parameters(model_config)
        decoupled = pb_utils.using_decoupled_model_transaction_policy(model_config)
        served = resolve_served_engine(args["model_repository"], args["model_version"],
                                       {"engine_dir": "engine", **params}, log=pb_utils.Logger.log_info)
        prehash_engine_files(served.engine_dir)  # while torch imports, on the core the import leaves idle
        from kilnlm.runtime.executor import Executor, ExecutorConfig
        from kilnlm.runtime.serving import parameters
        from kilnlm.runtime.serving.dispatcher import RequestDispatcher
        from kilnlm.runtime.serving.metrics import Metrics
        from kilnlm.runtime.serving.trtllm import LLMProtocol

        overrides = parameters.executor_overrides(params, args["model_repository"], args["model_version"])
        pb_utils.Logger.log_info(f"kilnlm: loading engine {served.engine_dir} ({served.source}) with "
                                 f"{overrides or 'defaults'}")
        executor = Executor.from_engine_dir(str(served.engine_dir), ExecutorConfig(**overrides),
                                            served_trusted_keys(args["model_repository"], params))
        metrics = Metrics(triton_backend.TritonMetricsBackend(pb_utils), args["model_name"])
        self._dispatcher = RequestDispatcher(executor, metrics, parameters.default_max_tokens(params),
                                             log=triton_backend.TritonLog(pb_utils),
                                             protocol=LLMProtocol(executor.eos_token_ids, decoupled))

    def execute(self, requests):
        for request in requests:
            self._dispatcher.submit(triton_backend.array_reader(pb_utils, request),
                                    triton_backend.TritonClient(pb_utils, request.get_response_sender()))
        return None

    def finalize(self):
        pb_utils.Logger.log_info("kilnlm: finalize: shutting the executor down")
        self._dispatcher.shutdown()  # unfinished requests end as "cancelled"
