"""Serving fixtures: one real tritonserver per test session, serving the SmolLM2 fp32 engine, started
as ``scripts/launch_triton.py`` starts it (``servers.running_tritonserver``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from servers import running_tritonserver


@pytest.fixture(scope="session")
def triton_server(smollm2_engine_fp32_dir, tmp_path_factory):
    """tritonserver with the model repository pointed at the SmolLM2 fp32 engine, for the whole session."""
    with running_tritonserver(tmp_path_factory.mktemp("triton"), engine_dir=Path(smollm2_engine_fp32_dir)) as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_executor(smollm2_engine_fp32_dir):
    """The runtime's own executor on the same engine, in this process: the reference for what the
    server must answer."""
    from kilnlm.runtime.executor import Executor, ExecutorConfig

    executor = Executor.from_engine_dir(smollm2_engine_fp32_dir, ExecutorConfig())
    yield executor
    executor.shutdown()
