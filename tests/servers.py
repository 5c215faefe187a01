"""Real servers the tests start on loopback, each one way for every test area that needs it:

- :func:`running_tritonserver`: a tritonserver started exactly as ``scripts/launch_triton.py`` starts it
  (:mod:`kilnlm.runtime.serving.launcher`), on free ports, waited for on ``/v2/health/ready``, stopped
  (SIGTERM, then SIGKILL, then its leftover stubs) when the block ends; its log is kept in ``work_dir`` and
  shown when it fails to start;
- :func:`running_openai_server`: kilnlm's OpenAI-compatible server of an executor on uvicorn, in a thread;
- :func:`running_s3_server`: moto's S3 server with the standard AWS environment variables pointing at it,
  so s3fs -- and any subprocess (the ``kilnlm`` CLI, tritonserver) -- talks to it.

Imported as ``servers`` (tests/conftest.py puts tests/ on ``sys.path``, as for ``factories``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

SERVER_START_TIMEOUT_S = 300.0
SERVER_STOP_TIMEOUT_S = 60.0
OPENAI_START_TIMEOUT_S = 60.0


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
        """kilnlm's samples (``kilnlm_*``, ``nv_trt_llm_*``, ``nv_llm_*``) on the metrics endpoint:
        {"name{labels}": value}."""
        with urllib.request.urlopen(self.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
        samples = {}
        for line in text.splitlines():
            match = re.match(r"^((?:kilnlm|nv_trt_llm|nv_llm)_\S+)\s+(\S+)$", line)
            if match:
                samples[match.group(1)] = float(match.group(2))
        return samples

    def metric(self, name: str, **labels: str) -> float:
        """One sample; ``labels`` besides ``model`` select among labelled series (0.0 when absent)."""
        return sample(self.metrics(), name, **labels)

    def llm_load(self, model: str = "tensorrt_llm") -> dict[str, float]:
        """The executor's state as the metrics report it: KV blocks ``free`` and ``total``, requests ``active``
        and ``queued`` (TensorRT-LLM's metric families, on the model that hosts the executor)."""
        m = self.metrics()
        return {"free": sample(m, "nv_trt_llm_kv_cache_block_metrics", model=model, kv_cache_block_type="free"),
                "total": sample(m, "nv_trt_llm_kv_cache_block_metrics", model=model, kv_cache_block_type="max"),
                "active": sample(m, "nv_trt_llm_request_metrics", model=model, request_type="active"),
                "queued": sample(m, "nv_trt_llm_request_metrics", model=model, request_type="waiting")}

    def is_idle(self, model: str = "tensorrt_llm") -> bool:
        """No request active or queued, and every KV block free (:meth:`llm_load`)."""
        load = self.llm_load(model)
        return load["free"] == load["total"] > 0 and load["active"] == load["queued"] == 0


def sample(samples: dict[str, float], name: str, **labels: str) -> float:
    """The value of ``name`` in ``samples`` (:meth:`TritonServer.metrics`) whose labels include ``labels``
    (0.0 when absent)."""
    for key, value in samples.items():
        metric_name, _, label_text = key.partition("{")
        if metric_name == name and all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            return value
    return 0.0


def is_ready(http_url: str, path: str = "/v2/health/ready") -> bool:
    """Whether the server at ``http_url`` answers ``path`` (Triton's readiness by default) with 200."""
    try:
        with urllib.request.urlopen(f"{http_url}{path}", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def stop_process(process: subprocess.Popen, timeout_s: float = SERVER_STOP_TIMEOUT_S) -> None:
    """SIGTERM ``process`` unless it already exited, then SIGKILL it if it is still running after ``timeout_s``."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def running_tritonserver(work_dir: Path, *, engine_dir: Path | None = None, model_repository: Path | None = None,
                         repository_poll_s: int | None = None, extra_env: dict[str, str] | None = None,
                         edit_repository: Callable[[Path, Path], None] | None = None,
                         start_timeout_s: float = SERVER_START_TIMEOUT_S,
                         decoupled_mode: bool = True) -> Iterator[TritonServer]:
    """A tritonserver serving ``engine_dir`` (the launcher's ``--engine``) or ``model_repository`` as it
    is (``decoupled_mode``: the launcher's). ``edit_repository(template, prepared_repository)`` may rewrite
    the assembled repository before the server starts. Skips the test where tritonserver cannot be started here; fails it, with the server's
    log, where the server exits or is not ready within ``start_timeout_s``."""
    from kilnlm.runtime.serving import launcher

    http_port, grpc_port, metrics_port = launcher.free_ports(3)
    options = {} if model_repository is None else {"model_repository": model_repository}
    config = launcher.ServerConfig(engine_dir=engine_dir, work_dir=work_dir, address="127.0.0.1",
                                   http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                                   repository_poll_s=repository_poll_s, decoupled_mode=decoupled_mode, **options)
    try:
        prepared = launcher.prepare_server(config)
    except launcher.LaunchError as exc:
        pytest.skip(f"tritonserver cannot be started here: {exc}")
    if edit_repository is not None:
        edit_repository(config.model_repository, prepared.model_repository)
    log_path = work_dir / "tritonserver.log"
    with open(log_path, "wb") as log:
        process = subprocess.Popen(launcher.server_command(config, prepared),
                                   env={**launcher.server_environment(prepared), **(extra_env or {})},
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    server = TritonServer(process, f"http://127.0.0.1:{http_port}", f"127.0.0.1:{grpc_port}",
                          f"http://127.0.0.1:{metrics_port}/metrics", log_path)
    try:
        deadline_s = time.monotonic() + start_timeout_s
        while not is_ready(server.http_url):
            if process.poll() is not None:
                pytest.fail(f"tritonserver exited with status {process.returncode} while starting; "
                            f"its log:\n{server.failure_report()}")
            if time.monotonic() > deadline_s:
                pytest.fail(f"tritonserver was not ready after {start_timeout_s:.0f} s; "
                            f"its log:\n{server.failure_report()}")
            time.sleep(0.5)
        yield server
    finally:
        stop_process(process)
        launcher.kill_leftovers(process.pid)  # stubs of a server that could not unload in time


@dataclasses.dataclass
class S3Server:
    """A running moto S3 server. ``endpoint_url``: ``http://127.0.0.1:<port>``."""

    endpoint_url: str

    def client(self):
        """A boto3 S3 client for the server (to inspect or tamper with objects in tests)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint_url)

    def make_bucket(self, name: str | None = None) -> str:
        """Create a fresh bucket (a unique name unless ``name``) and return ``s3://<bucket>``."""
        name = name or f"kilnlm-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return f"s3://{name}"


@contextlib.contextmanager
def running_openai_server(executor, settings) -> Iterator[str]:
    """An :class:`~kilnlm.runtime.serving.openai_server.OpenAIServer` of ``executor`` on uvicorn on a free
    loopback port, in a thread of this process; yields its base URL."""
    import uvicorn

    from kilnlm.runtime.serving.openai_server import OpenAIServer

    server = uvicorn.Server(uvicorn.Config(OpenAIServer(executor, settings).app, host="127.0.0.1", port=0,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + OPENAI_START_TIMEOUT_S
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@dataclasses.dataclass
class KilnlmServe:
    """A running ``kilnlm serve`` process and its base URL (``http://127.0.0.1:<port>``)."""

    process: subprocess.Popen
    url: str
    log_path: Path


@contextlib.contextmanager
def running_kilnlm_serve(args: list[str], work_dir: Path, env: dict[str, str] | None = None,
                         start_timeout_s: float = OPENAI_START_TIMEOUT_S,
                         launch: list[str] = ()) -> Iterator[KilnlmServe]:
    """``kilnlm serve ARGS --port <free>`` as a subprocess of this interpreter's venv (``env`` added to the
    environment; ``launch``, e.g. :func:`torchrun`'s, put before the command), waited for on ``/health``; its
    log is ``work_dir/serve.log`` and is shown when it fails to start. Stopped with :func:`stop_process` when
    the block ends."""
    import os

    work_dir.mkdir(parents=True, exist_ok=True)
    log_path = work_dir / "serve.log"
    port = free_port()
    command = [*launch, venv_executable("kilnlm"), "serve", *args, "--port", str(port)]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    served = KilnlmServe(process, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + start_timeout_s
        while not is_ready(served.url, "/health"):
            assert process.poll() is None, f"kilnlm serve exited while starting:\n{log_path.read_text()[-5000:]}"
            assert time.monotonic() < deadline, f"kilnlm serve not up after {start_timeout_s} s:\n{log_path.read_text()[-5000:]}"
            time.sleep(0.2)
        yield served
    finally:
        stop_process(process)


def venv_executable(name: str) -> str:
    """The path of ``name`` among this interpreter's venv scripts (``kilnlm``, ``torchrun``)."""
    import sys

    return str(Path(sys.executable).with_name(name))


def torchrun(nnodes: int, node_rank: int, master_port: int, nproc_per_node: int = 1) -> list[str]:
    """torchrun's command line for one host (``node_rank``) of ``nnodes`` meeting at 127.0.0.1:``master_port``
    (static rendezvous, so host 0 holds rank 0), followed by the executable to run (``--no-python``)."""
    return [venv_executable("torchrun"), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node),
            "--node-rank", str(node_rank), "--master-addr", "127.0.0.1", "--master-port", str(master_port),
            "--no-python"]


def all_blocks_free(executor) -> bool:
    stats = executor.stats()
    return stats.num_active_requests == 0 and stats.num_queued == 0 and stats.num_free_blocks == stats.num_total_blocks


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_s3_server() -> Iterator[S3Server]:
    """moto's S3 server on a free loopback port, with ``AWS_ENDPOINT_URL``, dummy credentials and a region
    in the environment (and the variables that would override them removed) while the block runs. Skips
    where s3fs or moto's server is not installed."""
    pytest.importorskip("s3fs", reason="s3:// caches need s3fs (pip install 'kilnlm[s3]')")
    server_mod = pytest.importorskip("moto.server", reason="the S3 test server needs moto[server]")
    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
            mp.delenv(name, raising=False)
        try:
            yield S3Server(endpoint_url=env["AWS_ENDPOINT_URL"])
        finally:
            server.stop()
