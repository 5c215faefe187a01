"""Deploy-test fixtures: a tampered copy of the tiny engine, and tritonservers serving deployed
repositories (``servers.running_tritonserver``). ``s3_server`` and ``launcher`` come from tests/conftest.py."""

from __future__ import annotations

import contextlib
import itertools
import shutil
from pathlib import Path

import pytest
from servers import running_tritonserver


@pytest.fixture
def tampered_engine(tiny_engine_dir, tmp_path) -> Path:
    """A copy of the tiny engine with one byte of its compiled package flipped."""
    engine = tmp_path / "tampered"
    shutil.copytree(tiny_engine_dir, engine)
    package = engine / "model.pt2"
    data = bytearray(package.read_bytes())
    data[len(data) // 2] ^= 0x01
    package.write_bytes(bytes(data))
    return engine


@pytest.fixture
def start_deployed_server(tmp_path):
    """``start_deployed_server(repository, extra_env, repository_poll_s=None) -> TritonServer``: a real
    tritonserver serving ``repository`` as it is (the launcher's mode without --engine), started as
    ``scripts/launch_triton.py`` starts it with ``extra_env`` added to its environment, waited for on
    /v2/health/ready, and stopped (with its leftover stubs) after the test."""
    numbers = itertools.count()
    with contextlib.ExitStack() as stack:
        def start(repository: Path, extra_env: dict[str, str], repository_poll_s: int | None = None):
            work_dir = tmp_path / f"triton-{next(numbers)}"  # one per server: its log stays
            return stack.enter_context(running_tritonserver(
                work_dir, model_repository=repository, repository_poll_s=repository_poll_s, extra_env=extra_env))

        yield start
