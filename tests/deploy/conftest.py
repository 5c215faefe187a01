"""Deploy-test fixtures: the cache tests' moto S3 server (``s3_server``, loaded from tests/cache/conftest.py
so both areas start it the same way), the launcher module, and a tampered copy of the tiny engine."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


s3_server = _load("kilnlm_tests_cache_conftest", TESTS_DIR / "cache" / "conftest.py").s3_server
_serving = _load("kilnlm_tests_serving_conftest", TESTS_DIR / "serving" / "conftest.py")
launcher = _serving.launcher


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
def start_deployed_server(launcher, tmp_path):
    """``start_deployed_server(repository, extra_env, repository_poll_s=None) -> TritonServer``: a real
    tritonserver serving ``repository`` as it is (the launcher's mode without --engine), started as
    ``scripts/launch_triton.py`` starts it with ``extra_env`` added to its environment, waited for on
    /v2/health/ready, and stopped (with its leftover stubs) after the test."""
    import subprocess
    import time

    processes = []

    def start(repository: Path, extra_env: dict[str, str], repository_poll_s: int | None = None):
        http_port, grpc_port, metrics_port = launcher.free_ports(3)
        config = launcher.ServerConfig(
            model_repository=repository, work_dir=tmp_path / "triton", address="127.0.0.1",
            http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
            repository_poll_s=repository_poll_s)
        try:
            prepared = launcher.prepare_server(config)
        except launcher.LaunchError as exc:
            pytest.skip(f"tritonserver cannot be started here: {exc}")
        log_path = tmp_path / "tritonserver.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(launcher.server_command(config, prepared),
                                       env={**launcher.server_environment(prepared), **extra_env},
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        processes.append(process)
        server = _serving.TritonServer(process, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}",
                                       f"http://127.0.0.1:{metrics_port}/metrics", log_path)
        deadline_s = time.monotonic() + _serving.SERVER_START_TIMEOUT_S
        while not _serving._ready(server.http_url):
            if process.poll() is not None:
                pytest.fail(f"tritonserver exited with status {process.returncode} while starting; "
                            f"its log:\n{server.failure_report()}")
            if time.monotonic() > deadline_s:
                pytest.fail(f"tritonserver was not ready after {_serving.SERVER_START_TIMEOUT_S:.0f} s; "
                            f"its log:\n{server.failure_report()}")
            time.sleep(0.5)
        return server

    yield start
    for process in processes:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(_serving.SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        launcher.kill_leftovers(process.pid)
