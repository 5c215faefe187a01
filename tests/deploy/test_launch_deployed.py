"""scripts/launch_triton.py serving a repository written by `kilnlm deploy` as it is (no --engine), with a
stand-in tritonserver so these run in milliseconds."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_PATH = REPO_ROOT / "scripts" / "launch_triton.py"


def _fake_install(root: Path, body: str) -> Path:
    """A system-style Triton install whose 'tritonserver' is the shell script ``body``."""
    binary = root / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    binary.chmod(0o755)
    (root / "backends" / "python").mkdir(parents=True)
    (root / "backends" / "python" / "libtriton_python.so").write_bytes(b"")
    (root / "backends" / "python" / "triton_python_backend_stub").write_bytes(b"")
    return binary


def _deployed_repository(root: Path) -> Path:
    (root / "tensorrt_llm" / "1").mkdir(parents=True)
    (root / "tensorrt_llm" / "config.pbtxt").write_text('name: "tensorrt_llm"\nbackend: "python"\n')
    return root


def test_a_deployed_repository_is_served_in_place_and_polled(launcher, tmp_path):
    repository = _deployed_repository(tmp_path / "repo")
    binary = _fake_install(tmp_path / "triton", "exit 0\n")
    config = launcher.ServerConfig(model_repository=repository, work_dir=tmp_path / "work", tritonserver=binary,
                                   repository_poll_s=5)
    prepared = launcher.prepare_server(config)
    assert prepared.model_repository == repository.resolve()
    assert not (tmp_path / "work" / "model_repository").exists()  # nothing copied
    command = launcher.server_command(config, prepared)
    assert f"--model-repository={repository.resolve()}" in command
    assert "--model-control-mode=poll" in command and "--repository-poll-secs=5" in command
    no_poll = launcher.server_command(launcher.ServerConfig(model_repository=repository), prepared)
    assert not any(arg.startswith("--model-control-mode") for arg in no_poll)


def test_without_engine_the_repository_must_be_a_deployed_one(launcher, tmp_path):
    with pytest.raises(launcher.LaunchError, match="kilnlm deploy"):
        launcher.check_deployed_repository(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(launcher.LaunchError, match="holds no model"):
        launcher.check_deployed_repository(tmp_path / "empty")
    with pytest.raises(launcher.LaunchError, match="--engine"):
        launcher.check_deployed_repository(launcher.default_model_repository())


def test_command_line_serves_a_deployed_repository(tmp_path):
    repository = _deployed_repository(tmp_path / "repo")
    binary = _fake_install(tmp_path / "triton", 'echo "args: $*"\n')
    result = subprocess.run([sys.executable, str(LAUNCHER_PATH), "--model-repository", str(repository),
                             "--tritonserver", str(binary), "--poll-repository-s", "2"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"--model-repository={repository.resolve()}" in result.stdout
    assert "--repository-poll-secs=2" in result.stdout
    result = subprocess.run([sys.executable, str(LAUNCHER_PATH), "--tritonserver", str(binary)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "--engine" in result.stderr
