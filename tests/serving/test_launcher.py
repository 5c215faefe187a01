"""kilnlm.runtime.serving.launcher (and scripts/launch_triton.py, its command line) without a model:
finding the binary and the python backend stub, the repository copy pointed at an engine, the server
command and environment, and signal forwarding (with a stand-in tritonserver script, so these run in
milliseconds)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCHER_PATH = REPO_ROOT / "scripts" / "launch_triton.py"


def _fake_install(root: Path, body: str) -> Path:
    """A system-style Triton install (bin/tritonserver + backends/python with its stub) whose
    'tritonserver' is the shell script ``body``."""
    binary = root / "bin" / "tritonserver"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    binary.chmod(0o755)
    python_backend = root / "backends" / "python"
    python_backend.mkdir(parents=True)
    (python_backend / "libtriton_python.so").write_bytes(b"")
    (python_backend / "triton_python_backend_stub").write_bytes(b"")
    return binary


def test_prepare_repository_points_engine_dir_at_the_engine(launcher, tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    out = launcher.prepare_repository(launcher.default_model_repository(), tmp_path / "repo", engine)
    config = (out / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f'string_value: "{engine.resolve()}"' in config
    assert (out / "tensorrt_llm" / "1" / "model.py").is_file()
    for name in ("preprocessing", "postprocessing"):
        assert f'string_value: "{engine.resolve() / "tokenizer"}"' in (out / name / "config.pbtxt").read_text()
    assert (out / "ensemble" / "config.pbtxt").read_text() == \
        (launcher.default_model_repository() / "ensemble" / "config.pbtxt").read_text()
    assert (out / "ensemble" / "1").is_dir()
    # the source repository is left as it was
    template = launcher.default_model_repository()
    assert 'string_value: "engine"' in (template / "tensorrt_llm" / "config.pbtxt").read_text()


def test_prepare_repository_sets_decoupled_mode_of_the_llm_models(launcher, tmp_path):
    engine = tmp_path / "engine"
    engine.mkdir()
    template = launcher.default_model_repository()
    for mode in (True, False):
        out = launcher.prepare_repository(template, tmp_path / f"repo_{mode}", engine, decoupled_mode=mode)
        for name in ("tensorrt_llm", "tensorrt_llm_bls"):
            text = (out / name / "config.pbtxt").read_text()
            assert f"decoupled: {str(mode).lower()}" in text and f"decoupled: {str(not mode).lower()}" not in text
        # models without a transaction policy stay as they are
        assert (out / "preprocessing" / "config.pbtxt").read_text().count("decoupled") == \
            (template / "preprocessing" / "config.pbtxt").read_text().count("decoupled")


def test_missing_engine_or_repository_is_a_launch_error(launcher, tmp_path):
    with pytest.raises(launcher.LaunchError, match="kilnlm build"):
        launcher.prepare_repository(launcher.default_model_repository(), tmp_path / "r", tmp_path / "none")
    (tmp_path / "engine").mkdir()
    with pytest.raises(launcher.LaunchError, match="--model-repository"):
        launcher.prepare_repository(tmp_path / "no_repo", tmp_path / "r", tmp_path / "engine")


def test_pytriton_backend_directory_gets_the_stub_for_this_python(launcher, tmp_path):
    try:
        binary = launcher.find_tritonserver()
    except launcher.LaunchError as exc:
        pytest.skip(f"no tritonserver here: {exc}")
    backends = launcher.assemble_backend_directory(binary, tmp_path)
    python_backend = backends / "python"
    assert (python_backend / "libtriton_python.so").exists()
    stub = python_backend / "triton_python_backend_stub"
    assert stub.exists() and os.access(stub, os.X_OK)
    if backends != binary.parent.parent / "backends":  # assembled (pytriton layout), not a system install
        assert f"python_backend_stubs/{sys.version_info.major}.{sys.version_info.minor}/" in str(stub.resolve())


def test_server_command_and_environment(launcher, tmp_path):
    binary = _fake_install(tmp_path / "triton", "exit 0\n")
    engine = tmp_path / "engine"
    engine.mkdir()
    config = launcher.ServerConfig(engine_dir=engine, work_dir=tmp_path / "work", tritonserver=binary,
                                   address="127.0.0.1", http_port=1, grpc_port=2, metrics_port=3)
    prepared = launcher.prepare_server(config)
    assert prepared.backend_directory == tmp_path / "triton" / "backends"  # a system install, used as is
    command = launcher.server_command(config, prepared)
    assert command[0] == str(binary)
    for option in (f"--model-repository={tmp_path / 'work' / 'model_repository'}", "--http-port=1",
                   "--grpc-port=2", "--metrics-port=3", "--http-address=127.0.0.1"):
        assert option in command
    env = launcher.server_environment(prepared, base={"PYTHONPATH": "/extra"})
    python_path = env["PYTHONPATH"].split(os.pathsep)
    assert python_path[-1] == "/extra"
    assert all(p in python_path for p in sys.path if p and Path(p).exists())


def test_server_environment_preloads_the_chosen_allocator(launcher, tmp_path):
    config = launcher.ServerConfig(engine_dir=tmp_path, work_dir=tmp_path / "work",
                                   tritonserver=_fake_install(tmp_path / "triton", "exit 0\n"))
    prepared = launcher.prepare_server(config)
    base = {"LD_PRELOAD": "/x/libjemalloc.so.2:/opt/libother.so"}
    assert launcher.server_environment(prepared, base=base)["LD_PRELOAD"] == base["LD_PRELOAD"]  # auto keeps it
    assert launcher.server_environment(prepared, base=base, malloc="system")["LD_PRELOAD"] == "/opt/libother.so"
    from kilnlm.runtime.memory import preload_malloc

    _, library = preload_malloc({}, "auto")  # what this machine has installed, if anything
    env = launcher.server_environment(prepared, base={})
    assert env.get("LD_PRELOAD") == library


def test_missing_tritonserver_and_missing_engine_exit_2_with_a_message(tmp_path):
    result = subprocess.run([sys.executable, str(LAUNCHER_PATH), "--engine", str(tmp_path / "none")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "engine directory" in result.stderr
    (tmp_path / "engine").mkdir()
    result = subprocess.run([sys.executable, str(LAUNCHER_PATH), "--engine", str(tmp_path / "engine"),
                             "--tritonserver", str(tmp_path / "missing")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "not an executable file" in result.stderr


def test_sigterm_is_forwarded_and_the_launcher_exits_0(tmp_path):
    marker = tmp_path / "started"
    binary = _fake_install(tmp_path / "triton", f"""\
        trap 'echo stopped > {tmp_path / "stopped"}; exit 143' TERM
        touch {marker}
        while true; do sleep 0.1; done
        """)
    (tmp_path / "engine").mkdir()
    launcher_process = subprocess.Popen(
        [sys.executable, str(LAUNCHER_PATH), "--engine", str(tmp_path / "engine"), "--tritonserver",
         str(binary)], stderr=subprocess.PIPE, text=True)
    try:
        deadline_s = time.monotonic() + 60
        while not marker.exists():
            assert launcher_process.poll() is None, launcher_process.stderr.read()
            assert time.monotonic() < deadline_s, "the stand-in tritonserver never started"
            time.sleep(0.05)
        launcher_process.send_signal(signal.SIGTERM)
        assert launcher_process.wait(timeout=30) == 0
        assert (tmp_path / "stopped").read_text().strip() == "stopped"
    finally:
        if launcher_process.poll() is None:
            launcher_process.kill()
            launcher_process.wait()


def test_tritonserver_failure_status_is_passed_through(tmp_path):
    binary = _fake_install(tmp_path / "triton", "echo 'failed to load all models' >&2; exit 3\n")
    (tmp_path / "engine").mkdir()
    result = subprocess.run([sys.executable, str(LAUNCHER_PATH), "--engine", str(tmp_path / "engine"),
                             "--tritonserver", str(binary)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 3
    assert "failed to load all models" in result.stderr


def test_stub_finds_its_own_interpreter_first_on_path(launcher, tmp_path):
    """pytriton's stub embeds the system's libpython and finds its standard library by looking ``python3``
    up on PATH. The launcher puts a ``python3`` linked to that libpython's interpreter first on the
    server's PATH, ahead of a virtual environment of another Python build (whose ``_ssl`` module cannot
    load in the stub: what broke s3:// engines in CI, where the venv's bin comes first on PATH)."""
    import re

    try:
        tritonserver = launcher.find_tritonserver()
    except launcher.LaunchError as exc:
        pytest.skip(f"no tritonserver here: {exc}")
    backends = launcher.assemble_backend_directory(tritonserver, tmp_path)
    stub = backends / "python" / launcher.STUB_NAME
    ldd = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, timeout=30).stdout
    linked = re.search(r"libpython(\d+\.\d+)", ldd)
    if linked is None:
        pytest.skip("this tritonserver's stub does not link a shared libpython")
    folder = launcher.stub_interpreter_dir(stub, tmp_path)
    assert folder is not None and (folder / "python3").is_symlink()
    version = subprocess.run([str(folder / "python3"), "-I", "-c",
                              "import ssl, sys; print('%d.%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=60)
    assert version.returncode == 0, version.stderr
    assert version.stdout.strip() == linked.group(1)
    prepared = launcher.PreparedServer(tritonserver, tmp_path, backends, (), (folder,))
    env = launcher.server_environment(prepared, base={"PATH": f"{Path(sys.executable).parent}{os.pathsep}/usr/bin"})
    assert env["PATH"].split(os.pathsep)[:2] == [str(folder), str(Path(sys.executable).parent)]
