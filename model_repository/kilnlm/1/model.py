"""Triton Python-backend model (decoupled) hosting kilnlm's in-flight-batching executor.

A thin adapter over :mod:`kilnlm.runtime.serving`: Triton hands each request to ``execute`` as it arrives
(max_batch_size 0); it is parsed, tokenized and submitted to one executor by a
:class:`~kilnlm.runtime.serving.dispatcher.RequestDispatcher`, and ``execute`` returns at once. The
executor's loop batches all live requests in flight; one dispatcher thread alone sends their responses.

Request tensors: TensorRT-LLM's ``inflight_batcher_llm`` names, see
:mod:`kilnlm.runtime.serving.request_parsing`. Response tensors (``text_output``, ``output_ids``,
``sequence_length``, ``finish_reason``): see :mod:`kilnlm.runtime.serving.responses`. Metrics
(``kilnlm_*``, on Triton's metrics port): see :mod:`kilnlm.runtime.serving.metrics`.

Errors: a bad request (empty text, max_tokens < 1, top_p outside (0, 1], a prompt too long for the
engine, ...) gets one final error response (INVALID_ARG; over HTTP a 400) and never affects other
requests; an executor failure gets INTERNAL. A request whose client cancels (gRPC stream closed, HTTP
connection dropped) is cancelled in the executor, which frees its KV-cache blocks.

Parameters (config.pbtxt): where the engine comes from (``engine_dir``, ``engine_ref``,
``engine_cache_dir``; a version's ``engine/`` or ``engine.json`` first: see
:mod:`kilnlm.runtime.distribution.engine_source`), ``default_max_tokens``, and any ``ExecutorConfig`` field
(see :mod:`kilnlm.runtime.serving.parameters`).
"""

from __future__ import annotations

import json
import os
import site
import sys


def _add_launcher_python_path() -> None:
    """Make the launching interpreter's packages (kilnlm among them) importable in this backend stub.

    The stubs nvidia-pytriton ships embed the system's libpython, which ignores PYTHONPATH. The
    launcher (kilnlm.runtime.serving.launcher) exports its interpreter's sys.path as PYTHONPATH; its package
    folders (not another interpreter's standard library) go in front of the system's dist-packages,
    and their .pth files are processed (that is how a venv's editable/dev installs are found).
    """
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    packages = [p for p in entries if os.path.isdir(p) and not os.path.exists(os.path.join(p, "os.py"))
                and not p.rstrip("/").endswith("lib-dynload") and p not in sys.path]
    sys.path[0:0] = packages
    for p in packages:
        site.addsitedir(p)


_add_launcher_python_path()

import triton_python_backend_utils as pb_utils  # noqa: E402  (after the path set-up above)

from kilnlm.runtime.distribution.engine_source import resolve_served_engine  # noqa: E402
from kilnlm.runtime.executor import Executor, ExecutorConfig  # noqa: E402
from kilnlm.runtime.serving import parameters, triton_backend  # noqa: E402
from kilnlm.runtime.serving.dispatcher import RequestDispatcher  # noqa: E402
from kilnlm.runtime.serving.metrics import Metrics  # noqa: E402


class TritonPythonModel:
    """One executor per model instance, served through one request dispatcher."""

    def initialize(self, args):
        params = triton_backend.model_parameters(json.loads(args["model_config"]))
        served = resolve_served_engine(args["model_repository"], args["model_version"],
                                       {"engine_dir": "engine", **params}, log=pb_utils.Logger.log_info)
        overrides = parameters.executor_overrides(params)
        pb_utils.Logger.log_info(f"kilnlm: loading engine {served.engine_dir} ({served.source}) with "
                                 f"{overrides or 'defaults'}")
        executor = Executor.from_engine_dir(str(served.engine_dir), ExecutorConfig(**overrides))
        metrics = Metrics(triton_backend.TritonMetricsBackend(pb_utils), args["model_name"])
        self._dispatcher = RequestDispatcher(executor, metrics, parameters.default_max_tokens(params),
                                             log=triton_backend.TritonLog(pb_utils))

    def execute(self, requests):
        for request in requests:
            self._dispatcher.submit(triton_backend.input_reader(pb_utils, request),
                                    triton_backend.TritonClient(pb_utils, request.get_response_sender()))
        return None

    def finalize(self):
        pb_utils.Logger.log_info("kilnlm: finalize: shutting the executor down")
        self._dispatcher.shutdown()  # unfinished requests end as "cancelled"
        pb_utils.Logger.log_info("kilnlm: finalize: done")
