"""Start a real Triton Inference Server that serves a kilnlm engine (``scripts/launch_triton.py`` is the
command line; fixtures and demos call the same functions: :func:`prepare_server`, then
:func:`server_command` and :func:`server_environment`).

What it does, in order:

1. finds ``tritonserver``: ``--tritonserver``, else one on ``PATH`` (an NGC container), else the binary
   the ``nvidia-pytriton`` wheel ships under ``pytriton/tritonserver/bin``;
2. finds a Python backend that can start: the wheel keeps ``libtriton_python.so`` and the per-Python
   stubs (``python_backend_stubs/<3.x>/triton_python_backend_stub``) apart, and Triton marks a model
   UNAVAILABLE ("stub is not found") unless the stub lies next to the library, so a backend directory of
   symlinks is assembled in the work directory (site-packages is never written);
3. with ``--engine``: copies the model repository (default: kilnlm's template, found by
   :func:`kilnlm.runtime.distribution.deploy.locate_template`) into the work directory and points the
   ``engine_dir`` parameter of ``tensorrt_llm`` at the engine and the ``tokenizer_dir`` of ``preprocessing`` /
   ``postprocessing`` at its tokenizer; without it: serves ``--model-repository``
   as it is (a repository written by ``kilnlm deploy``, whose version directories name their engines; with
   ``--poll-repository-s`` new versions and rollbacks are picked up while the server runs);
4. runs tritonserver in the foreground with ``PYTHONPATH`` taken from this interpreter's ``sys.path``
   (so the stub sees the venv and kilnlm) and ``LD_PRELOAD`` naming TCMalloc or jemalloc when one is
   installed (``--malloc``; the engine's decode steps run ~2% faster than on glibc's malloc), forwards
   SIGINT/SIGTERM to it and exits 0 when a signal stopped it, or with tritonserver's own status
   otherwise. Missing pieces exit 2 with a message.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from kilnlm.runtime.distribution.deploy import locate_template
from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.memory import MALLOC_CHOICES, preload_malloc

STUB_NAME = "triton_python_backend_stub"
# The parameters that point a model at the engine (tensorrt_llm) and at its tokenizer (pre/postprocessing).
ENGINE_DIR_PARAMETER = "engine_dir"
TOKENIZER_DIR_PARAMETER = "tokenizer_dir"


class LaunchError(RuntimeError):
    """Something the server needs is missing; the message says what to install or pass."""


def default_model_repository() -> Path:
    """kilnlm's model repository template (the installed package data, or a source checkout's
    ``model_repository/``; ``$KILNLM_MODEL_REPOSITORY_TEMPLATE`` overrides).

    Raises:
        LaunchError: no template is found (the message says how to get one).
    """
    try:
        return locate_template()
    except KilnError as exc:
        raise LaunchError(str(exc)) from None


@dataclasses.dataclass
class ServerConfig:
    """Everything needed to start one tritonserver.

    Attributes:
        engine_dir: the built kilnlm engine directory to serve; None serves ``model_repository`` in
            place (a repository written by `kilnlm deploy`).
        model_repository: with ``engine_dir``, the source model repository (copied, never modified);
            without, the repository served. Default: kilnlm's template (:func:`default_model_repository`).
        work_dir: where the repository copy and the backend directory are assembled; a fresh
            temporary directory when None.
        address: the interface the HTTP, gRPC and metrics endpoints listen on ("0.0.0.0": all).
        http_port / grpc_port / metrics_port: TCP ports (tritonserver takes no 0 = "any free port":
            pick free ones first, see :func:`free_ports`).
        tritonserver: the binary to run; found automatically when None.
        log_verbose: tritonserver's ``--log-verbose`` level (0 = info only).
        repository_poll_s: when set, tritonserver polls the repository every this many seconds and
            loads new versions / unloads removed ones (``--model-control-mode=poll``); None = load once.
        extra_args: further tritonserver arguments, appended last.
        decoupled_mode: with ``engine_dir``, TensorRT-LLM's ``decoupled_mode``: True serves ``tensorrt_llm``
            and ``tensorrt_llm_bls`` decoupled (streaming, several sequences; Triton then refuses HTTP
            ``/infer`` on them and on ``ensemble``), False one response per request (``/infer`` works,
            streaming is refused).
        world_size: TensorRT-LLM's launcher's ``--world_size``: the ranks the engine runs on, which must be
            the engine's ``--tp-size`` (kilnlm's runtime starts them itself); None takes the engine's.
    """

    engine_dir: Path | None = None
    model_repository: Path = dataclasses.field(default_factory=default_model_repository)
    work_dir: Path | None = None
    address: str = "0.0.0.0"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    tritonserver: Path | None = None
    log_verbose: int = 0
    repository_poll_s: int | None = None
    extra_args: tuple[str, ...] = ()
    decoupled_mode: bool = True
    world_size: int | None = None


@dataclasses.dataclass(frozen=True)
class PreparedServer:
    """The result of :func:`prepare_server`: paths the command line refers to."""

    tritonserver: Path
    model_repository: Path
    backend_directory: Path
    library_dirs: tuple[Path, ...]
    stub_path_dirs: tuple[Path, ...] = ()  # go first on PATH: the stub's own interpreter (see stub_interpreter_dir)


def _pytriton_root() -> Path | None:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return root if root.is_dir() else None


def find_tritonserver(explicit: Path | None = None) -> Path:
    """Return the tritonserver binary: ``explicit``, else ``tritonserver`` on PATH, else pytriton's.

    Raises:
        LaunchError: when none exists.
    """
    if explicit is not None:
        path = Path(explicit)
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise LaunchError(f"--tritonserver {path} is not an executable file")
        return path.resolve()
    on_path = shutil.which("tritonserver")
    if on_path:
        return Path(on_path).resolve()
    root = _pytriton_root()
    if root is not None and (root / "bin" / "tritonserver").is_file():
        return (root / "bin" / "tritonserver").resolve()
    raise LaunchError(
        "no tritonserver found: install the serving extra (pip install 'kilnlm[serve]', which brings "
        "nvidia-pytriton and its tritonserver binary), run inside an NGC Triton container, or pass "
        "--tritonserver PATH")


def _library_dirs(tritonserver: Path) -> tuple[Path, ...]:
    """Shared-library folders the pytriton build needs on LD_LIBRARY_PATH (the python backend library
    finds them through an $ORIGIN-relative RPATH, which breaks once it is linked from elsewhere)."""
    candidates = [tritonserver.parent.parent / "lib",
                  tritonserver.parent.parent.parent.parent / "nvidia_pytriton.libs"]
    return tuple(p for p in candidates if p.is_dir())


def assemble_backend_directory(tritonserver: Path, dest: Path) -> Path:
    """Return a backend directory whose ``python/`` holds libtriton_python.so *and* the stub.

    A system install (NGC container: ``/opt/tritonserver/backends/python`` already holds its stub) is
    used as is. For pytriton's layout, ``dest/backends/python`` is filled with symlinks to the library,
    ``triton_python_backend_utils.py`` and the stub for the running Python version.

    Raises:
        LaunchError: no python backend, or no stub for this Python version.
    """
    backends = tritonserver.parent.parent / "backends"
    python_backend = backends / "python"
    if not (python_backend / "libtriton_python.so").is_file():
        raise LaunchError(f"tritonserver at {tritonserver} has no python backend "
                          f"({python_backend}/libtriton_python.so is missing)")
    if (python_backend / STUB_NAME).is_file():
        return backends
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = tritonserver.parent.parent / "python_backend_stubs" / version / STUB_NAME
    if not stub.is_file():
        raise LaunchError(f"no python backend stub for Python {version} (looked for {stub}): run the "
                          "launcher with a Python version that nvidia-pytriton ships a stub for")
    out = Path(dest) / "backends" / "python"
    out.mkdir(parents=True, exist_ok=True)
    for src in [stub, *sorted(python_backend.iterdir())]:
        link = out / src.name
        if src.name == "__pycache__" or link.exists() or link.is_symlink():
            continue
        link.symlink_to(src)
    return out.parent


def stub_interpreter_dir(stub: Path, dest: Path) -> Path | None:
    """A folder holding ``python3``, a link to the interpreter whose libpython ``stub`` embeds (found with
    ``ldd``: ``<prefix>/lib/.../libpython3.X.so`` -> ``<prefix>/bin/python3.X``); None when it cannot tell.

    Why: the stub starts an isolated interpreter with an empty argv[0], so CPython looks ``python3`` up on
    PATH to find its prefix. With a virtual environment first on PATH whose base is another build of
    Python (pyenv, conda), the stub would take that build's standard library, and its C extension modules
    fail to load in the stub's libpython (``ssl``: "undefined symbol"). This folder goes first on the
    server's PATH so the stub finds its own standard library."""
    try:
        out = subprocess.run(["ldd", str(stub)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"libpython(\d+\.\d+)\S*\s+=>\s+(\S+)", out)
    if match is None:
        return None
    version, library = match.group(1), Path(match.group(2)).resolve()
    interpreter = next((p / "bin" / f"python{version}" for p in library.parents
                        if (p / "bin" / f"python{version}").is_file()), None)
    if interpreter is None:
        return None
    folder = Path(dest) / "stub_python"
    folder.mkdir(parents=True, exist_ok=True)
    link = folder / "python3"
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(interpreter.resolve())
    return folder


def _parameter_re(key: str) -> re.Pattern:
    return re.compile(r'(key:\s*"' + key + r'"\s*value:\s*\{\s*string_value:\s*)"[^"]*"', re.S)


_DECOUPLED_RE = re.compile(r"(model_transaction_policy\s*\{\s*decoupled:\s*)(true|false)")


def prepare_repository(source: Path, dest: Path, engine_dir: Path, decoupled_mode: bool = True) -> Path:
    """Copy the model repository ``source`` to ``dest`` with every model's ``engine_dir`` parameter set to
    the absolute ``engine_dir``, every ``tokenizer_dir`` parameter to its ``tokenizer/`` and every model's
    ``model_transaction_policy`` decoupled flag to ``decoupled_mode`` (TensorRT-LLM's name). Returns ``dest``.

    Raises:
        LaunchError: the engine or the repository is missing, or no model has an engine_dir parameter.
    """
    source, engine_dir = Path(source), Path(engine_dir).resolve()
    if not (engine_dir.is_dir()):
        raise LaunchError(f"engine directory {engine_dir} does not exist: build one with "
                          "`kilnlm build` and pass it with --engine")
    if not source.is_dir():
        raise LaunchError(f"model repository {source} does not exist: pass --model-repository")
    if Path(dest).exists():
        shutil.rmtree(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    num_patched = 0
    values = {ENGINE_DIR_PARAMETER: engine_dir, TOKENIZER_DIR_PARAMETER: engine_dir / "tokenizer"}
    for config in sorted(Path(dest).glob("*/config.pbtxt")):
        text = config.read_text()
        for key, value in values.items():
            text, count = _parameter_re(key).subn(lambda m: f'{m.group(1)}"{value}"', text)
            num_patched += count if key == ENGINE_DIR_PARAMETER else 0
        text = _DECOUPLED_RE.sub(lambda m: m.group(1) + ("true" if decoupled_mode else "false"), text)
        config.write_text(text)
    if num_patched == 0:  # (models without the parameters, e.g. the ensemble, are copied as they are)
        raise LaunchError(f"no model in {source} has an '{ENGINE_DIR_PARAMETER}' parameter to point at "
                          "the engine: is this kilnlm's model_repository?")
    return Path(dest)


def check_deployed_repository(repository: Path) -> Path:
    """Return ``repository`` (absolute) when it can be served as it is: it exists, holds at least one
    model directory with a config.pbtxt, and is not kilnlm's template.

    Raises:
        LaunchError: the repository is missing or empty, or it is kilnlm's template (whose engine_dir
            points nowhere): pass --engine, or deploy an engine with `kilnlm deploy`.
    """
    repository = Path(repository).resolve()
    if not repository.is_dir():
        raise LaunchError(f"model repository {repository} does not exist: write one with `kilnlm deploy "
                          f"ENGINE --model-repository {repository}`, or pass --engine")
    configs = sorted(repository.glob("*/config.pbtxt"))
    if not configs:
        raise LaunchError(f"{repository} holds no model (no */config.pbtxt): write one with `kilnlm deploy`")
    try:
        template = locate_template().resolve()
    except KilnError:
        template = None  # no template installed: this cannot be it
    if repository == template:
        raise LaunchError(f"{repository} is kilnlm's template: pass --engine ENGINE_DIR to serve an engine with "
                          "it, or serve a repository written by `kilnlm deploy` with --model-repository")
    return repository


def check_world_size(engine_dir: Path, world_size: int) -> None:
    """Refuse a ``--world-size`` other than the engine's tensor-parallel size (:class:`LaunchError`)."""
    from kilnlm.runtime.manifest import read_manifest

    try:
        tp_size = read_manifest(engine_dir).build.tp_size
    except KilnError as exc:
        raise LaunchError(str(exc)) from None
    if world_size != tp_size:
        raise LaunchError(f"--world-size {world_size} but {engine_dir} was built with --tp-size {tp_size}: kilnlm starts "
                          f"the engine's {tp_size} rank(s) itself; drop --world-size or pass {tp_size}")


def prepare_server(config: ServerConfig) -> PreparedServer:
    """Find the binary and assemble the backend directory (and, with ``config.engine_dir``, the repository
    copy) under ``config.work_dir`` (made a fresh temporary directory, and stored back in ``config``,
    when None). Raises :class:`LaunchError` when ``config.world_size`` is not the engine's tp_size."""
    if config.world_size is not None and config.engine_dir is not None:
        check_world_size(config.engine_dir, config.world_size)
    tritonserver = find_tritonserver(config.tritonserver)
    if config.work_dir is None:
        config.work_dir = Path(tempfile.mkdtemp(prefix="kilnlm-triton-"))
    work_dir = Path(config.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    backend_directory = assemble_backend_directory(tritonserver, work_dir)
    if config.engine_dir is None:
        repository = check_deployed_repository(config.model_repository)
    else:
        repository = prepare_repository(config.model_repository, work_dir / "model_repository",
                                        config.engine_dir, config.decoupled_mode)
    stub = backend_directory / "python" / STUB_NAME
    stub_dir = stub_interpreter_dir(stub, work_dir) if stub.is_file() else None
    return PreparedServer(tritonserver, repository, backend_directory, _library_dirs(tritonserver),
                          () if stub_dir is None else (stub_dir,))


def server_command(config: ServerConfig, prepared: PreparedServer) -> list[str]:
    """The tritonserver argv for ``config`` (ports, repository, backend directory, log level)."""
    return [
        str(prepared.tritonserver),
        f"--model-repository={prepared.model_repository}",
        f"--backend-directory={prepared.backend_directory}",
        f"--http-address={config.address}",
        f"--http-port={config.http_port}",
        f"--grpc-address={config.address}",
        f"--grpc-port={config.grpc_port}",
        f"--metrics-address={config.address}",
        f"--metrics-port={config.metrics_port}",
        "--allow-metrics=true",
        "--allow-gpu-metrics=false",
        "--allow-cpu-metrics=true",
        f"--log-verbose={config.log_verbose}",
        *([] if config.repository_poll_s is None else
          ["--model-control-mode=poll", f"--repository-poll-secs={config.repository_poll_s}"]),
        *config.extra_args,
    ]


def server_environment(prepared: PreparedServer, base: dict[str, str] | None = None,
                       malloc: str = "auto") -> dict[str, str]:
    """The environment for tritonserver: ``base`` (default os.environ) plus PYTHONPATH from this
    interpreter's sys.path, so the backend stub imports the same packages (venv, kilnlm), the stub's
    interpreter folder first on PATH (:func:`stub_interpreter_dir`), LD_LIBRARY_PATH with the pytriton
    library folders, and LD_PRELOAD with the ``malloc`` allocator (``kilnlm.runtime.memory.preload_malloc``:
    "auto" takes TCMalloc or jemalloc when installed, as Triton's documentation suggests for its server; the
    backend stubs, where the engines run, inherit it). Raises ``KilnError`` for a named allocator that is
    not installed."""
    env, _ = preload_malloc(os.environ if base is None else base, malloc)
    python_path = [p for p in sys.path if p and Path(p).exists()]
    if env.get("PYTHONPATH"):
        python_path.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(python_path))
    if prepared.stub_path_dirs:
        env["PATH"] = os.pathsep.join([*map(str, prepared.stub_path_dirs), *filter(None, [env.get("PATH")])])
    lib_path = [str(p) for p in prepared.library_dirs]
    if env.get("LD_LIBRARY_PATH"):
        lib_path.append(env["LD_LIBRARY_PATH"])
    if lib_path:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(lib_path)
    return env


def free_ports(num_ports: int, host: str = "127.0.0.1") -> list[int]:
    """``num_ports`` distinct TCP ports that were free on ``host`` a moment ago."""
    import socket

    sockets, ports = [], []
    try:
        for _ in range(num_ports):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
            ports.append(sock.getsockname()[1])
    finally:
        for sock in sockets:
            sock.close()
    return ports


def kill_leftovers(process_group: int) -> None:
    """SIGKILL what is left of a stopped tritonserver's process group: python-backend stubs outlive a
    server that gave up unloading (its exit timeout) and would keep their engine in memory."""
    try:
        os.killpg(process_group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left


def run_foreground(command: list[str], env: dict[str, str]) -> int:
    """Run tritonserver in its own process group, forwarding SIGINT/SIGTERM to it (once: a terminal's
    Ctrl-C reaches only this launcher's group). Returns 0 when a forwarded signal stopped it, else its
    exit status. Its leftover stubs are killed when it has exited."""
    proc = subprocess.Popen(command, env=env, start_new_session=True)
    stopped_by_signal = False

    def forward(signum, _frame):
        nonlocal stopped_by_signal
        stopped_by_signal = True
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = proc.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if proc.poll() is None:  # this launcher is going down on an exception: take the server along
            proc.kill()
            proc.wait()
        kill_leftovers(proc.pid)
    return 0 if stopped_by_signal else status


def make_parser() -> argparse.ArgumentParser:
    """The command line of ``scripts/launch_triton.py``."""
    parser = argparse.ArgumentParser(description="Serve a kilnlm engine with Triton Inference Server.")
    parser.add_argument("--engine", type=Path, default=None,
                        help="built kilnlm engine directory, served with a copy of --model-repository "
                             "(default: none: serve --model-repository as it is, e.g. one written by "
                             "`kilnlm deploy`)")
    parser.add_argument("--address", default="0.0.0.0",
                        help="interface to listen on (default 0.0.0.0: all; 127.0.0.1: this host only)")
    parser.add_argument("--http-port", type=int, default=8000, help="HTTP/REST port (default 8000)")
    parser.add_argument("--grpc-port", type=int, default=8001, help="gRPC port (default 8001)")
    parser.add_argument("--metrics-port", type=int, default=8002,
                        help="Prometheus metrics port (default 8002)")
    parser.add_argument("--model-repository", type=Path, default=None,
                        help="with --engine: the repository copied and pointed at the engine; without: the "
                             "repository served as it is (default: kilnlm's model_repository template)")
    parser.add_argument("--decoupled-mode", choices=("true", "false"), default="true",
                        help="with --engine, TensorRT-LLM's decoupled_mode: true serves tensorrt_llm and "
                             "tensorrt_llm_bls decoupled (streaming, num_return_sequences; Triton refuses HTTP "
                             "/infer on them and the ensemble), false one response per request (/infer works, "
                             "streaming is refused) (default: true)")
    parser.add_argument("--poll-repository-s", type=int, default=None,
                        help="poll the repository every this many seconds, loading new versions and "
                             "unloading removed ones (default: none, load once at start)")
    parser.add_argument("--tritonserver", type=Path, default=None,
                        help="tritonserver binary (default: on PATH, else nvidia-pytriton's)")
    parser.add_argument("--log-verbose", type=int, default=0, help="tritonserver log verbosity (0)")
    parser.add_argument("--work-dir", type=Path, default=None,
                        help="where to assemble the repository copy (default: a temporary directory, "
                             "removed on exit)")
    parser.add_argument("--world-size", "--world_size", type=int, default=None,
                        help="TensorRT-LLM's launcher's ranks: must equal the engine's --tp-size, whose ranks the model "
                             "starts as processes of its own (default: the engine's)")
    parser.add_argument("--malloc", choices=MALLOC_CHOICES, default="auto",
                        help="C allocator of tritonserver and its backend stubs, through LD_PRELOAD (default auto: "
                             "TCMalloc, else jemalloc, when installed; system: glibc's)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = make_parser().parse_args(argv)
    remove_work_dir = args.work_dir is None
    try:
        config = ServerConfig(
            engine_dir=args.engine, work_dir=args.work_dir, address=args.address,
            http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port,
            tritonserver=args.tritonserver, log_verbose=args.log_verbose,
            repository_poll_s=args.poll_repository_s, decoupled_mode=args.decoupled_mode == "true",
            world_size=args.world_size,
            **({} if args.model_repository is None else {"model_repository": args.model_repository}))
        prepared = prepare_server(config)
    except LaunchError as exc:
        print(f"launch_triton: error: {exc}", file=sys.stderr)
        return 2
    try:
        try:
            env = server_environment(prepared, malloc=args.malloc)
        except KilnError as exc:
            print(f"launch_triton: error: {exc}", file=sys.stderr)
            return 2
        command = server_command(config, prepared)
        print(f"launch_triton: LD_PRELOAD={env.get('LD_PRELOAD', '')} " + " ".join(command), file=sys.stderr, flush=True)
        return run_foreground(command, env)
    finally:
        if remove_work_dir and config.work_dir is not None:
            shutil.rmtree(config.work_dir, ignore_errors=True)
