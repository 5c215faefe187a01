"""`kilnlm deploy` of cache references (a real S3-protocol server, moto, and a local cache directory), and
the served model's load-time resolution of them: fetched once into the local engine cache, verified,
reused on restart without the store, fetched again when the local copy is damaged."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kilnlm.cli.main import main as kilnlm_main
from kilnlm.runtime.distribution.deploy import DeployConfig, DeployError, deploy
from kilnlm.runtime.engine import verify_engine
from kilnlm.runtime.distribution.cache import EngineCache
from kilnlm.runtime.distribution.engine_source import ENGINE_CACHE_DIR_ENV, EnginePointer, resolve_served_engine
from kilnlm.runtime.errors import EngineError


def tree(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


@pytest.fixture
def s3_cache(s3_server, tiny_engine_dir):
    """A fresh S3 cache (its own bucket) holding the tiny engine as ``tiny:1``: (cache URL, entry)."""
    cache_url = s3_server.make_bucket() + "/engine-cache"
    entry = EngineCache(cache_url).publish(tiny_engine_dir, name="tiny", version="1")
    return cache_url, entry


def test_deploy_from_s3_pins_a_pointer_and_the_model_fetches_it_once(s3_cache, tiny_engine_dir, tmp_path,
                                                                      monkeypatch):
    cache_url, entry = s3_cache
    repo = tmp_path / "repo"
    result = deploy(DeployConfig(ref=f"{cache_url}/tiny:1", model_repository=repo))
    assert (result.version, result.mode, result.cache_key) == (1, "pointer", entry.key)
    version_dir = repo / "tensorrt_llm" / "1"
    assert sorted(p.name for p in version_dir.iterdir()) == ["__pycache__", "engine.json", "model.py"]
    assert (version_dir / "__pycache__").is_file()  # Python writes no bytecode into the repository
    assert EnginePointer.read(version_dir / "engine.json") == EnginePointer(f"{cache_url}/tiny:1", entry.key)

    environ = {ENGINE_CACHE_DIR_ENV: str(tmp_path / "served")}
    served = resolve_served_engine(repo / "tensorrt_llm", 1, {"engine_dir": ""}, environ=environ)
    assert served.downloaded and served.engine_dir == tmp_path / "served" / entry.key
    assert verify_engine(served.engine_dir).files == verify_engine(tiny_engine_dir).files

    # A restart reuses the verified copy without the store: point the S3 endpoint at a closed port.
    with monkeypatch.context() as m:
        m.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        again = resolve_served_engine(repo / "tensorrt_llm", 1, {"engine_dir": ""}, environ=environ)
    assert not again.downloaded and again.engine_dir == served.engine_dir

    # A damaged local copy is fetched again (and verified), not loaded.
    package = served.engine_dir / "model.pt2"
    data = bytearray(package.read_bytes())
    data[100] ^= 0xFF
    package.write_bytes(bytes(data))
    repaired = resolve_served_engine(repo / "tensorrt_llm", 1, {"engine_dir": ""}, environ=environ)
    assert repaired.downloaded
    verify_engine(repaired.engine_dir)

    # Without a deploy: the engine_ref parameter names the cache reference (tiny = tiny:latest).
    by_param = resolve_served_engine(tmp_path / "other" / "tensorrt_llm", 1,
                                     {"engine_dir": "engine", "engine_ref": f"{cache_url}/tiny",
                                      "engine_cache_dir": str(tmp_path / "param_cache")})
    assert by_param.downloaded and by_param.engine_dir == tmp_path / "param_cache" / entry.key


def test_bare_name_with_cache_option_copy_mode_and_a_local_cache(s3_cache, tiny_engine_dir, tmp_path, capsys):
    cache_url, entry = s3_cache
    repo = tmp_path / "repo"
    assert kilnlm_main(["deploy", "tiny:1", "--cache", cache_url, "--copy", "--model-repository", str(repo),
                        "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["mode"] == "copy" and result["cache_key"] == entry.key
    assert verify_engine(repo / "tensorrt_llm" / "1" / "engine").files == verify_engine(tiny_engine_dir).files

    local_cache = tmp_path / "local_cache"
    local_entry = EngineCache(str(local_cache)).publish(tiny_engine_dir, name="tiny")
    second = deploy(DeployConfig(ref=f"{local_cache}/tiny:latest", model_repository=repo))
    assert (second.version, second.mode, second.cache_key) == (2, "pointer", local_entry.key)
    served = resolve_served_engine(repo / "tensorrt_llm", 2, {"engine_dir": ""},
                                   environ={ENGINE_CACHE_DIR_ENV: str(tmp_path / "served")})
    assert served.engine_dir == tmp_path / "served" / local_entry.key


def test_tampered_or_missing_cache_entry_is_refused_before_anything_is_written(s3_server, s3_cache, tmp_path):
    cache_url, entry = s3_cache
    repo = tmp_path / "repo"
    deploy(DeployConfig(ref=f"{cache_url}/tiny:1", model_repository=repo))
    before = tree(repo)
    with pytest.raises(DeployError, match="not in cache"):
        deploy(DeployConfig(ref=f"{cache_url}/tiny:9", model_repository=repo))

    bucket, prefix = cache_url.removeprefix("s3://").split("/", 1)
    blob = f"{prefix}/engines/{entry.key}/blobs/{entry.manifest.files['model.pt2']['sha256']}"
    client = s3_server.client()
    data = bytearray(client.get_object(Bucket=bucket, Key=blob)["Body"].read())
    data[len(data) // 2] ^= 0x01
    client.put_object(Bucket=bucket, Key=blob, Body=bytes(data))
    with pytest.raises(DeployError, match="SHA-256") as info:
        deploy(DeployConfig(ref=f"{cache_url}/tiny:1", model_repository=repo))
    assert "model.pt2" in str(info.value) or entry.manifest.files["model.pt2"]["sha256"] in str(info.value)
    assert tree(repo) == before

    # The version deployed before the tampering: its model refuses to load the tampered object too.
    with pytest.raises(EngineError, match="cannot fetch engine"):
        resolve_served_engine(repo / "tensorrt_llm", 1, {"engine_dir": ""},
                              environ={ENGINE_CACHE_DIR_ENV: str(tmp_path / "served")})
    assert not (tmp_path / "served" / entry.key).exists()
    shutil.rmtree(repo)
