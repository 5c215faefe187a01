"""Serving fixtures: one real tritonserver per test session, serving the SmolLM2 fp32 engine.

The server is started exactly as ``scripts/launch_triton.py`` starts it (its module,
:mod:`kilnlm.runtime.serving.launcher`), on free loopback ports, and waited for on ``/v2/health/ready``. Its log is kept in the session's
temporary directory and printed when it fails to start.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

SERVER_START_TIMEOUT_S = 300.0
SERVER_STOP_TIMEOUT_S = 60.0


@pytest.fixture(scope="session")
def launcher():
    """The tritonserver launcher module (what scripts/launch_triton.py runs)."""
    from kilnlm.runtime.serving import launcher

    return launcher


@dataclasses.dataclass
class TritonServer:
    """A running tritonserver and how to reach it."""

    process: subprocess.Popen
    http_url: str  # "http://127.0.0.1:<port>"
    grpc_address: str  # "127.0.0.1:<port>" (tritonclient.grpc's form)
    metrics_url: str  # "http://127.0.0.1:<port>/metrics"
    log_path: Path

    def log_tail(self, num_chars: int = 20_000) -> str:
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def failure_report(self, num_chars: int = 12_000) -> str:
        """The log's tail, then its error lines (Triton's ``E`` lines, model-load failures) from the whole
        log: they come last so that a truncated CI excerpt still shows why a model did not load."""
        log = self.log_path.read_text(errors="replace")
        errors = [line for line in log.splitlines()
                  if re.match(r"^E\d{4} ", line) or "Failed to initialize" in line or "Traceback" in line]
        return f"{log[-num_chars:]}\n--- error lines of the tritonserver log ---\n" + "\n".join(errors)[-8_000:]

    def metrics(self) -> dict[str, float]:
        """The ``kilnlm_*`` samples on the metrics endpoint: {"name{labels}": value}."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^(kilnlm_\S+)\s+(\S+)$", line)
            if match:
                samples[match.group(1)] = float(match.group(2))
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """One sample; ``labels`` besides ``model`` select among labelled series (0.0 when absent)."""
        for key, value in self.metrics().items():
            metric_name, _, label_text = key.partition("{")
            if metric_name == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
                return value
        return 0.0


def _ready(http_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{http_url}/v2/health/ready", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


@pytest.fixture(scope="session")
def triton_server(smollm2_engine_fp32_dir, launcher, tmp_path_factory):
    """Start tritonserver with the model repository pointed at the SmolLM2 fp32 engine; stop it (SIGTERM,
    then SIGKILL after SERVER_STOP_TIMEOUT_S) at the end of the session."""
    work_dir = tmp_path_factory.mktemp("triton")
    http_port, grpc_port, metrics_port = launcher.free_ports(3)
    config = launcher.ServerConfig(
        engine_dir=Path(smollm2_engine_fp32_dir), work_dir=work_dir, address="127.0.0.1",
        http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port)
    try:
        prepared = launcher.prepare_server(config)
    except launcher.LaunchError as exc:
        pytest.skip(f"tritonserver cannot be started here: {exc}")
    log_path = work_dir / "tritonserver.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(launcher.server_command(config, prepared),
                                   env=launcher.server_environment(prepared),
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = TritonServer(process, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}",
                          f"http://127.0.0.1:{metrics_port}/metrics", log_path)
    try:
        deadline_s = time.monotonic() + SERVER_START_TIMEOUT_S
        while not _ready(server.http_url):
            if process.poll() is not None:
                pytest.fail(f"tritonserver exited with status {process.returncode} while starting; "
                            f"its log:\n{server.failure_report()}")
            if time.monotonic() > deadline_s:
                pytest.fail(f"tritonserver was not ready after {SERVER_START_TIMEOUT_S:.0f} s; "
                            f"its log:\n{server.failure_report()}")
            time.sleep(0.5)
        yield server
    finally:
        if process.poll() is None:
            process.terminate()
            try:
                process.wait(SERVER_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        launcher.kill_leftovers(process.pid)  # stubs of a server that could not unload in time


@pytest.fixture(scope="session")
def smollm2_executor(smollm2_engine_fp32_dir):
    """The runtime's own executor on the same engine, in this process: the reference for what the
    server must answer."""
    from kilnlm.runtime.executor import Executor, ExecutorConfig

    executor = Executor.from_engine_dir(smollm2_engine_fp32_dir, ExecutorConfig())
    yield executor
    executor.shutdown()
