"""`kilnlm deploy` into a Triton model repository from a local engine directory: versions, the written
configs, rollback, refusals that leave the repository as it was, and where the served model finds its
engine (kilnlm.runtime.distribution.engine_source)."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from kilnlm.cli.main import main as kilnlm_main
from kilnlm.runtime.distribution.deploy import (DeployConfig, DeployError, deploy, existing_versions, locate_template,
                                   render_model_config)
from kilnlm.runtime.engine import verify_engine
from kilnlm.runtime.distribution.engine_source import ServedEngine, resolve_served_engine, version_speculative_config
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.manifest import read_manifest, write_manifest
from kilnlm.runtime.serving.parameters import executor_overrides


def tree(root: Path) -> list[str]:
    """Every path under ``root`` (relative, sorted): what a failed deploy must leave as it was."""
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) if root.exists() else []


def parameter(config_text: str, key: str) -> str | None:
    match = re.search(r'key:\s*"' + key + r'"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config_text)
    return match.group(1) if match else None


def test_two_deploys_are_versions_1_and_2_and_rollback_removes_the_newest(tiny_engine_dir, tmp_path):
    repo = tmp_path / "repo"
    template = locate_template()
    first = deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo))
    second = deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo))
    assert (first.version, second.version) == (1, 2)
    assert first.created_model and not second.created_model
    assert existing_versions(repo / "tensorrt_llm") == [1, 2]
    set_names = ["ensemble", "postprocessing", "preprocessing", "tensorrt_llm", "tensorrt_llm_bls"]
    assert sorted(p.name for p in repo.iterdir()) == set_names  # no staging left over
    assert sorted(p.name for p in first.companion_dirs) == sorted(set(set_names) - {"tensorrt_llm"})
    assert second.companion_dirs == ()

    config = (repo / "tensorrt_llm" / "config.pbtxt").read_text()
    assert re.search(r'^name:\s*"tensorrt_llm"', config, re.M)
    assert "decoupled: true" in config
    assert re.search(r"version_policy:\s*\{\s*latest:\s*\{\s*num_versions:\s*1\s*\}\s*\}", config)
    assert parameter(config, "engine_dir") == ""  # each version names its own engine
    for name in ("preprocessing", "postprocessing"):  # the engine's tokenizer, read from the model directory
        assert parameter((repo / name / "config.pbtxt").read_text(), "tokenizer_dir") == "tokenizer"
        assert (repo / name / "tokenizer" / "tokenizer.json").read_bytes() == \
            (tiny_engine_dir / "tokenizer" / "tokenizer.json").read_bytes()
    for name in ("ensemble", "tensorrt_llm_bls", "preprocessing"):
        assert (repo / name / "config.pbtxt").read_bytes() == (template / name / "config.pbtxt").read_bytes()
    assert (repo / "ensemble" / "1").is_dir()
    for version in (1, 2):
        version_dir = repo / "tensorrt_llm" / str(version)
        assert (version_dir / "model.py").read_bytes() == \
            (template / "tensorrt_llm" / "1" / "model.py").read_bytes()
        assert verify_engine(version_dir / "engine").files == verify_engine(tiny_engine_dir).files
        served = resolve_served_engine(repo / "tensorrt_llm", version, {"engine_dir": ""})
        assert served.engine_dir == version_dir / "engine" and not served.downloaded

    shutil.rmtree(repo / "tensorrt_llm" / "2")  # the rollback
    assert existing_versions(repo / "tensorrt_llm") == [1]
    again = deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo))
    assert again.version == 2


def test_a_new_version_is_staged_outside_the_model_directory(tiny_engine_dir, tmp_path, monkeypatch):
    """A polling Triton reloads a model whose directory changed. A version staged inside the model directory
    changed it twice (its rename, then the staging directory's removal), which could load it twice and let
    a rollback race the second load; staged beside the repository, the rename is the only change."""
    import kilnlm.runtime.distribution.deploy as deploy_module

    repo = tmp_path / "repo"
    deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo))
    written = []
    real_write_version = deploy_module._write_version
    monkeypatch.setattr(deploy_module, "_write_version",
                        lambda engine, copy, template, version_dir, *speculative: written.append(version_dir) or
                        real_write_version(engine, copy, template, version_dir, *speculative))
    deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo))
    (staged,) = written
    assert repo.resolve() not in staged.resolve().parents and staged.name == "2"
    assert sorted(p.name for p in (repo / "tensorrt_llm").iterdir()) == ["1", "2", "config.pbtxt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["repo"]  # the staging directory is gone too


def test_explicit_version_and_an_existing_version_is_refused(tiny_engine_dir, tmp_path):
    repo = tmp_path / "repo"
    result = deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo, version=7))
    assert result.version == 7 and result.model_dir == repo / "tensorrt_llm"
    assert deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo)).version == 8
    before = tree(repo)
    with pytest.raises(DeployError, match="exists: pass another --version"):
        deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo, version=7))
    assert tree(repo) == before


def test_tampered_or_incomplete_engine_is_refused_before_anything_is_written(tiny_engine_dir, tampered_engine,
                                                                           tmp_path):
    new_repo = tmp_path / "new_repo"
    with pytest.raises(DeployError, match=r"model\.pt2.*SHA-256"):
        deploy(DeployConfig(ref=str(tampered_engine), model_repository=new_repo))
    assert not new_repo.exists()

    repo = tmp_path / "repo"
    deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo))
    before = tree(repo)
    with pytest.raises(DeployError, match=r"model\.pt2.*SHA-256"):
        deploy(DeployConfig(ref=str(tampered_engine), model_repository=repo))
    incomplete = tmp_path / "incomplete"
    shutil.copytree(tiny_engine_dir, incomplete)
    (incomplete / "tokenizer" / "tokenizer.json").unlink()
    with pytest.raises(DeployError, match=r"tokenizer\.json is missing"):
        deploy(DeployConfig(ref=str(incomplete), model_repository=repo))
    assert tree(repo) == before
    assert tree(tmp_path).count("repo/tensorrt_llm/3") == 0


def test_cli_deploy_prints_the_version_and_fails_in_one_line(tiny_engine_dir, tmp_path, capsys):
    repo = tmp_path / "repo"
    assert kilnlm_main(["deploy", str(tiny_engine_dir), "--model-repository", str(repo), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["version"] == 1 and result["mode"] == "copy" and result["created_model"]
    assert result["cache_key"] == verify_engine(tiny_engine_dir).cache_key
    assert kilnlm_main(["deploy", str(tiny_engine_dir), "--model-repository", str(repo)]) == 0
    assert "deployed tensorrt_llm version 2" in capsys.readouterr().out
    assert kilnlm_main(["deploy", str(tmp_path / "no_such_engine"), "--model-repository", str(repo)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kilnlm deploy: error: refusing to deploy") and err.count("\n") == 1
    assert existing_versions(repo / "tensorrt_llm") == [1, 2]


def test_an_engine_with_another_tokenizer_is_refused(tiny_engine_dir, tmp_path):
    repo = tmp_path / "repo"
    deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo))
    before = tree(repo)
    other = tmp_path / "other_engine"
    shutil.copytree(tiny_engine_dir, other)
    tokenizer_json = other / "tokenizer" / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text().replace('"<|im_end|>"', '"<|im_stop|>"', 1))
    # (the manifest's hashes now disagree: verification refuses it first, or the tokenizer check does)
    with pytest.raises(DeployError):
        deploy(DeployConfig(ref=str(other), model_repository=repo))
    assert tree(repo) == before


def test_a_directory_that_is_not_a_kilnlm_model_is_not_overwritten(tiny_engine_dir, tmp_path):
    (tmp_path / "repo" / "tensorrt_llm").mkdir(parents=True)
    (tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "tensorrtllm"\n')
    with pytest.raises(DeployError, match="not a kilnlm model"):
        deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=tmp_path / "repo"))


def test_served_engine_resolution_order(tmp_path):
    model_dir = tmp_path / "repo" / "tensorrt_llm"
    (model_dir / "1").mkdir(parents=True)
    # the template's behaviour: engine_dir relative to the model directory, or absolute
    assert resolve_served_engine(model_dir, 1, {"engine_dir": "engine"}) == \
        ServedEngine(model_dir / "engine", f"parameter engine_dir {model_dir / 'engine'}")
    assert resolve_served_engine(model_dir, 1, {"engine_dir": "/abs/engine"}).engine_dir == Path("/abs/engine")
    with pytest.raises(EngineError, match="names no engine: deploy one"):
        resolve_served_engine(model_dir, 1, {"engine_dir": ""})
    (model_dir / "1" / "engine.json").write_text("{not json")
    with pytest.raises(EngineError, match="engine.json is not a kilnlm engine pointer"):
        resolve_served_engine(model_dir, 1, {"engine_dir": "engine"})
    (model_dir / "1" / "engine").mkdir()  # a version's engine copy comes first
    assert resolve_served_engine(model_dir, 1, {"engine_dir": "x"}).engine_dir == model_dir / "1" / "engine"


def draft_config(model: str | Path, tokens: int = 3) -> str:
    return json.dumps({"method": "draft", "model": str(model), "num_speculative_tokens": tokens})


def test_a_version_deployed_with_a_draft_engine_carries_it_and_serves_with_it(tiny_engine_dir, tmp_path, capsys):
    """--speculative-config: the draft engine (here the tiny engine drafting for itself) is verified and
    copied into the version as draft/, the version's speculative_config.json names it relatively, and the
    served model's executor configuration takes it over the model's parameter; a version deployed without
    one keeps the parameter's."""
    repo = tmp_path / "repo"
    model_dir = repo / "tensorrt_llm"
    result = deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo,
                                 speculative_config=draft_config(tiny_engine_dir)))
    version_dir = model_dir / "1"
    assert verify_engine(version_dir / "draft").files == verify_engine(tiny_engine_dir).files
    written = {"method": "draft", "model": "draft", "num_speculative_tokens": 3}
    assert json.loads((version_dir / "speculative_config.json").read_text()) == written
    assert json.loads(result.speculative_config) == written
    resolved = {**written, "model": str(version_dir / "draft")}
    assert json.loads(version_speculative_config(model_dir, 1)) == resolved
    ngram = '{"method": "ngram", "num_speculative_tokens": 2}'
    assert json.loads(executor_overrides({"speculative_config": ngram}, model_dir, "1")["speculative_config"]) == resolved

    assert kilnlm_main(["deploy", str(tiny_engine_dir), "--model-repository", str(repo), "--speculative-config",
                        ngram]) == 0
    assert 'version 2 speculates with {"method": "ngram", "num_speculative_tokens": 2}' in capsys.readouterr().out
    assert json.loads((model_dir / "2" / "speculative_config.json").read_text()) == json.loads(ngram)
    assert not (model_dir / "2" / "draft").exists()
    deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo))
    assert version_speculative_config(model_dir, 3) is None
    assert executor_overrides({"speculative_config": ngram}, model_dir, 3) == {"speculative_config": ngram}


def test_a_bad_speculative_config_or_draft_engine_is_refused_before_anything_is_written(
        tiny_engine_dir, tampered_engine, tmp_path):
    repo = tmp_path / "repo"
    with pytest.raises(DeployError, match="--speculative-config: speculative_config is not JSON"):
        deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo, speculative_config="{draft"))
    assert not repo.exists()
    deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo))
    before = tree(repo)
    with pytest.raises(DeployError, match="method is 'medusa'"):
        deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo,
                            speculative_config='{"method": "medusa", "num_speculative_tokens": 2}'))
    with pytest.raises(DeployError, match=r"draft model: refusing to deploy .*model\.pt2.*SHA-256"):
        deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo, speculative_config=draft_config(tampered_engine)))
    with pytest.raises(DeployError, match="draft model: refusing to deploy .*no_such_engine"):
        deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo,
                            speculative_config=draft_config(tmp_path / "no_such_engine")))
    other = tmp_path / "other_tokenizer"  # a valid engine (its manifest written again) of another tokenizer
    shutil.copytree(tiny_engine_dir, other)
    tokenizer_json = other / "tokenizer" / "tokenizer.json"
    tokenizer_json.write_text(tokenizer_json.read_text().replace('"<|im_end|>"', '"<|im_stop|>"', 1))
    write_manifest(other, read_manifest(other))
    with pytest.raises(DeployError, match="draft model .*other_tokenizer has another tokenizer than the engine"):
        deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo, speculative_config=draft_config(other)))
    assert tree(repo) == before

    (repo / "tensorrt_llm" / "1" / "speculative_config.json").write_text('{"method": "draft"}')
    with pytest.raises(EngineError, match=r"1/speculative_config\.json: .*needs num_speculative_tokens"):
        executor_overrides({}, repo / "tensorrt_llm", 1)


@pytest.mark.triton
def test_triton_serves_a_version_deployed_with_a_draft_engine(tiny_engine_dir, tmp_path, start_deployed_server):
    """The version loads its draft/ in a real tritonserver and speculates: the speculative-decoding metrics
    count verified drafts, and a greedy request's tokens equal its tokens without speculation
    (num_speculative_tokens 0)."""
    import urllib.request

    repo = tmp_path / "repo"
    deploy(DeployConfig(ref=str(tiny_engine_dir), model_repository=repo,
                        speculative_config=draft_config(tiny_engine_dir, tokens=4)))
    server = start_deployed_server(repo, {})

    def generate(**fields) -> list[int]:
        body = {"input_ids": [1, 2, 3], "input_lengths": 3, "request_output_len": 16, **fields}
        request = urllib.request.Request(f"{server.http_url}/v2/models/tensorrt_llm/generate", method="POST",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            return json.loads(reply.read())["output_ids"]

    speculative = generate()
    deadline_s = time.monotonic() + 10  # the gauges are refreshed every 0.1 s
    while (drafts := server.metric("kilnlm_speculative_decoding_metrics", spec_decoding_metric="total_draft_tokens")) == 0:
        assert time.monotonic() < deadline_s, f"no draft token verified; output {speculative}\n{server.log_tail()[-3000:]}"
        time.sleep(0.1)
    assert len(speculative) == 3 + 16 and drafts >= 4
    assert speculative == generate(num_speculative_tokens=0)
    assert "speculative_config" in server.log_tail() and str(repo / "tensorrt_llm" / "1" / "draft") in server.log_tail()


def test_template_is_found_and_rendered(tmp_path):
    template = locate_template()
    assert (template / "tensorrt_llm" / "1" / "model.py").is_file()
    text = render_model_config(template)
    assert re.search(r'^name:\s*"tensorrt_llm"', text, re.M) and parameter(text, "engine_dir") == ""
    with pytest.raises(DeployError, match="KILNLM_MODEL_REPOSITORY_TEMPLATE"):
        locate_template(tmp_path)


def test_pyproject_ships_the_template_as_package_data():
    """An installed kilnlm (not only this checkout) must find the template: every file of the template
    that deploy copies matches a package-data pattern of ``kilnlm.model_repository``."""
    import fnmatch
    import tomllib

    repo_root = Path(__file__).resolve().parents[2]
    setuptools = tomllib.loads((repo_root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "kilnlm.model_repository" in setuptools["packages"]
    assert setuptools["package-dir"]["kilnlm.model_repository"] == "model_repository"
    patterns = setuptools["package-data"]["kilnlm.model_repository"]
    rels = [f"{m}/config.pbtxt" for m in ("preprocessing", "tensorrt_llm", "postprocessing", "ensemble",
                                         "tensorrt_llm_bls")]
    rels += [f"{m}/1/model.py" for m in ("preprocessing", "tensorrt_llm", "postprocessing", "tensorrt_llm_bls")]
    for rel in [*rels, "ensemble/1/README.md"]:
        assert (repo_root / "model_repository" / rel).is_file()
        assert any(fnmatch.fnmatch(rel, pattern) for pattern in patterns), rel
