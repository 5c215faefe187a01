"""A served model survives its server being killed: tritonserver serving a `kilnlm deploy` pointer to a cached
engine, and `kilnlm serve` serving a cache reference, are each SIGKILLed (tritonserver's whole process group,
stubs included) while they stream a response, then started again. Nothing partial is left behind, the
served-engine copy is re-verified and reused, not fetched again (tritonserver's pinned pointer needs no
cache at all), and the model answers again (issue 26, item 3)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import urllib.request

import pytest
from servers import running_kilnlm_serve

from kilnlm.runtime.distribution.cache import EngineCache
from kilnlm.runtime.distribution.deploy import DeployConfig, deploy
from kilnlm.runtime.distribution.engine_source import ENGINE_CACHE_DIR_ENV
from kilnlm.runtime.engine import verify_engine
from kilnlm.runtime.serving.launcher import kill_leftovers

pytestmark = [pytest.mark.e2e]

LONG = {"input_ids": [1, 2, 3], "input_lengths": 3, "request_output_len": 200, "end_id": 49151, "streaming": True}


def generate(server, body: dict) -> dict:
    request = urllib.request.Request(f"{server.http_url}/v2/models/tensorrt_llm/generate", method="POST",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())


@pytest.mark.triton
def test_sigkill_mid_stream_then_restart_serves_from_the_verified_copy(tiny_engine_dir, tmp_path,
                                                                       start_deployed_server):
    cache_dir, served_dir, repo = tmp_path / "cache", tmp_path / "served", tmp_path / "repo"
    key = EngineCache(str(cache_dir)).publish(tiny_engine_dir, name="tiny", version="1").key
    deploy(DeployConfig(ref=f"{cache_dir}/tiny:1", model_repository=repo))
    env = {ENGINE_CACHE_DIR_ENV: str(served_dir)}

    first = start_deployed_server(repo, env)
    assert "kilnlm: fetching" in first.log_tail()
    streamed = threading.Event()

    def stream():
        request = urllib.request.Request(f"{first.http_url}/v2/models/tensorrt_llm/generate_stream", method="POST",
                                         data=json.dumps(LONG).encode(), headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=120) as reply:
                while reply.readline():
                    streamed.set()
        except OSError:
            pass  # the server died under it

    client = threading.Thread(target=stream, daemon=True)
    client.start()
    assert streamed.wait(60), "no streamed response before the kill"
    kill_leftovers(first.process.pid)  # SIGKILL to the server's process group: server and backend stubs
    assert first.process.wait(30) != 0
    client.join(30)
    assert not client.is_alive()

    assert sorted(p.name for p in served_dir.iterdir()) == [key]  # no temporary or half-fetched copy
    verify_engine(served_dir / key)
    assert sorted(p.name for p in (repo / "tensorrt_llm" / "1").iterdir() if p.name != "__pycache__") == \
        ["engine.json", "model.py"]

    shutil.rmtree(cache_dir)  # the pinned, verified copy needs no store
    second = start_deployed_server(repo, env)
    log = second.log_tail()
    assert "kilnlm: using the verified local copy" in log and "kilnlm: fetching" not in log, log[-3000:]
    reply = generate(second, {"input_ids": [1, 2, 3], "input_lengths": 3, "request_output_len": 4})
    assert 3 < len(reply["output_ids"]) <= 7


def test_kilnlm_serve_sigkill_mid_stream_then_restart(tiny_engine_dir, tmp_path):
    cache_dir, served_dir = tmp_path / "cache", tmp_path / "served"
    key = EngineCache(str(cache_dir)).publish(tiny_engine_dir, name="tiny", version="1").key
    args = ["--engine", f"{cache_dir}/tiny:1", "--engine-cache-dir", str(served_dir), "--served-model-name", "tiny"]
    body = json.dumps({"model": "tiny", "prompt": "The kiln", "max_tokens": 200, "ignore_eos": True,
                       "stream": True}).encode()
    with running_kilnlm_serve(args, tmp_path / "first") as first:
        request = urllib.request.Request(f"{first.url}/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert reply.readline().startswith(b"data: ")  # mid-stream
            os.kill(first.process.pid, signal.SIGKILL)
            assert first.process.wait(30) == -signal.SIGKILL
    assert sorted(p.name for p in served_dir.iterdir()) == [key]
    verify_engine(served_dir / key)

    with running_kilnlm_serve(args, tmp_path / "second") as second:
        log = second.log_path.read_text()
        assert "kilnlm: using the verified local copy" in log and "kilnlm: fetching" not in log, log[-3000:]
        request = urllib.request.Request(f"{second.url}/v1/completions", method="POST", headers={
            "Content-Type": "application/json"}, data=json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 3}).encode())
        with urllib.request.urlopen(request, timeout=120) as reply:
            assert json.loads(reply.read())["usage"]["completion_tokens"] >= 1
