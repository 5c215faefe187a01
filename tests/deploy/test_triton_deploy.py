"""End to end: the SmolLM2 fp8 engine published to an S3 cache (moto server), deployed with `kilnlm deploy`
as a pointer, served by a real tritonserver whose model fetches the engine from S3 when it loads, and
asked a question through the ensemble and tensorrt_llm_bls; then a second version is deployed and rolled back while the server
polls the repository."""

from __future__ import annotations

import json
import shutil
import time
import urllib.error
import urllib.request

import pytest

from kilnlm.cli.main import main as kilnlm_main
from kilnlm.runtime.engine import verify_engine
from kilnlm.runtime.distribution.cache import EngineCache
from kilnlm.runtime.distribution.engine_source import ENGINE_CACHE_DIR_ENV

from factories import CAPITAL_QUESTION

pytestmark = [pytest.mark.triton, pytest.mark.e2e]

VERSION_SWITCH_TIMEOUT_S = 180.0


def _generate(server, model: str) -> str:
    """Triton's HTTP generate endpoint on a text model of the set (ensemble or tensorrt_llm_bls)."""
    body = json.dumps({"text_input": CAPITAL_QUESTION, "max_tokens": 24, "apply_chat_template": True,
                       "exclude_input_in_output": True}).encode()
    request = urllib.request.Request(f"{server.http_url}/v2/models/{model}/generate", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())["text_output"]


def _version_ready(server, model: str, version: int) -> bool:
    try:
        with urllib.request.urlopen(f"{server.http_url}/v2/models/{model}/versions/{version}/ready",
                                    timeout=5) as reply:
            return reply.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _wait_for_versions(server, model: str, ready: int, gone: int) -> None:
    deadline_s = time.monotonic() + VERSION_SWITCH_TIMEOUT_S
    while not (_version_ready(server, model, ready) and not _version_ready(server, model, gone)):
        assert time.monotonic() < deadline_s, \
            f"version {ready} of {model} not served alone after {VERSION_SWITCH_TIMEOUT_S:.0f} s:\n{server.failure_report()}"
        time.sleep(0.5)


def test_triton_serves_an_engine_deployed_from_s3_and_rolls_back(s3_server, smollm2_engine_fp8_dir,
                                                                 start_deployed_server, tmp_path, capsys):
    cache_url = s3_server.make_bucket() + "/engines"
    entry = EngineCache(cache_url).publish(smollm2_engine_fp8_dir, name="smollm2", version="1")
    repo = tmp_path / "repo"
    assert kilnlm_main(["deploy", f"{cache_url}/smollm2:1", "--model-repository", str(repo)]) == 0
    assert "pointer to" in capsys.readouterr().out
    served_cache = tmp_path / "served"  # empty: the model must pull the engine from S3 when it loads

    server = start_deployed_server(repo, {ENGINE_CACHE_DIR_ENV: str(served_cache)}, repository_poll_s=1)

    assert (served_cache / entry.key / "manifest.json").is_file(), server.failure_report()
    assert verify_engine(served_cache / entry.key).files == verify_engine(smollm2_engine_fp8_dir).files
    assert f"fetching {cache_url}/smollm2:1" in server.log_tail(200_000)
    assert not [p for p in repo.rglob("__pycache__") if p.is_dir()]  # (polling: a changed model)
    answer = _generate(server, "ensemble")
    assert "Paris" in answer, answer
    assert _generate(server, "tensorrt_llm_bls") == answer  # greedy: the BLS model answers the same

    # Version 2 (the same engine: its verified local copy is reused, no download) replaces version 1...
    assert kilnlm_main(["deploy", f"{cache_url}/smollm2:1", "--model-repository", str(repo)]) == 0
    _wait_for_versions(server, "tensorrt_llm", ready=2, gone=1)
    assert _generate(server, "ensemble") == answer
    # ...and removing it rolls back to version 1.
    shutil.rmtree(repo / "tensorrt_llm" / "2")
    _wait_for_versions(server, "tensorrt_llm", ready=1, gone=2)
    assert _generate(server, "ensemble") == answer
    log = server.log_tail(200_000)
    assert log.count(f"fetching {cache_url}/smollm2:1") == 1
    assert log.count('"loading: tensorrt_llm:1"') == 2 and log.count('"loading: tensorrt_llm:2"') == 1, log
