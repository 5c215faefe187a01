"""Build (once, cached) and load the C++ CPU kernels of the kilnlm ops.

The sources ship as package data in ``csrc/`` and register with ``TORCH_LIBRARY_IMPL(kilnlm, CPU, m)``
against the schemas declared in :mod:`kilnlm.plugins.schema`. The library is a Python extension module,
imported once per process: besides the kernels it holds ``AotiPackage``, the engine loader whose forward
runs with the GIL released (csrc/aoti_package.cpp; :func:`load_aoti_package`), and the ops' C shims that
compiled engines call (csrc/c_shim.h), made global symbols of the process when it loads. The sources are
compiled with ``-O3 -fopenmp`` (threads through at::parallel_for), never ``-march=native``: one build runs
on any x86-64 machine and picks its vector paths (AVX2, AVX-512, AVX512-BF16) at run time by CPU feature
detection.

Caching: the shared library lives in torch's extension cache (``$TORCH_EXTENSIONS_DIR`` or
``~/.cache/torch_extensions/<py>_cpu``) under a name keyed by a hash of the sources, the flags and the
torch version, so editing a source rebuilds and a second process finds the built library and loads it
directly (milliseconds, no compiler or ninja run).
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

import kilnlm.plugins.schema  # noqa: F401  (declares the op schemas the kernels register against)

CSRC_DIR = Path(__file__).resolve().parent / "csrc"
# -fopenmp: at::parallel_for is inlined into the kernels and only runs threads when compiled with OpenMP;
# the library then links libgomp.so.1, which resolves to the one torch already loaded.
_CFLAGS = ("-O3", "-fopenmp")
_LDFLAGS = ("-fopenmp",)
_LOCK = threading.Lock()
_LOADED: list = []  # (path, module) of the loaded library, once loaded (one per process)


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded; the message says what to install or fix."""


def _sources() -> list[Path]:
    files = sorted(p for p in CSRC_DIR.iterdir() if p.suffix in (".cpp", ".h"))
    if not any(p.suffix == ".cpp" for p in files):
        raise KernelBuildError(f"no C++ kernel sources found in {CSRC_DIR}: the kilnlm installation is incomplete "
                               "(reinstall kilnlm; csrc/*.cpp is package data)")
    return files


def _build_key(sources: list[Path]) -> str:
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(_CFLAGS + _LDFLAGS).encode())
    digest.update(torch.__version__.encode())
    return digest.hexdigest()[:16]


def _build_root() -> Path:
    """torch's extension cache: ``$TORCH_EXTENSIONS_DIR``, else ``torch.utils.cpp_extension``'s default build
    root plus ``py<major><minor>_cpu``. The default is read from the directory it names
    (``torch._appdirs.user_cache_dir``) rather than through ``cpp_extension``, whose import (setuptools and
    the build tooling: 0.04-0.07 s after the executor's own imports on the model-207 Xeon) would otherwise be
    a part of every cold start that finds the library built; tests/plugins/test_cpu_loader.py checks that
    the two agree."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        from torch._appdirs import user_cache_dir

        py = f"py{sys.version_info.major}{sys.version_info.minor}"
        root = os.path.join(os.path.realpath(user_cache_dir(appname="torch_extensions")), f"{py}_cpu")
    return Path(root)


def _compile(name: str, sources: list[Path], build_dir: Path):
    """Builds (or waits for another process's build of) the library in ``build_dir`` and imports it.
    Returns ``(path, module)``. Raises :class:`KernelBuildError`."""
    from torch.utils import cpp_extension

    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"kilnlm's CPU kernels must be compiled once, but the C++ compiler {compiler!r} was not "
                               "found: install g++ (e.g. `apt-get install g++`) or set CXX to a compiler")
    if shutil.which("ninja") is None and not _ninja_module_available():
        raise KernelBuildError("kilnlm's CPU kernels are built with ninja, which was not found: `pip install ninja`")
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        module = cpp_extension.load(
            name=name,
            sources=[str(p) for p in sources if p.suffix == ".cpp"],
            extra_cflags=list(_CFLAGS),
            extra_ldflags=list(_LDFLAGS),
            extra_include_paths=[str(CSRC_DIR)],
            build_directory=str(build_dir),
            is_python_module=True,
            verbose=False,
        )
    except (RuntimeError, OSError) as exc:
        raise KernelBuildError(f"building kilnlm's CPU kernels in {build_dir} failed; compiler output:\n{exc}") from exc
    return build_dir / f"{name}.so", module


def _ninja_module_available() -> bool:
    try:
        import ninja  # noqa: F401
    except ImportError:
        return False
    return True


def _build_in_progress(build_dir: Path, stale_after_s: float = 600.0) -> bool:
    try:
        return time.time() - (build_dir / "lock").stat().st_mtime < stale_after_s
    except FileNotFoundError:
        return False


def load_cpu_kernels() -> str:
    """Build (first time only) and load the C++ CPU kernels of the ``kilnlm`` ops (``paged_attention``, ``gemm``,
    ``fp8_linear``, ``int4_linear``, ``int8_linear``, ``int8_sq_linear``); idempotent and thread-safe.
    Returns the shared library's path.

    After this call ``torch.ops.kilnlm.*`` dispatch to the C++ kernels for CPU tensors (in eager mode, and
    from AOTInductor packages compiled before the C shims, which call ops through the dispatcher), and the
    ops' C shims are global symbols for the engines that call them directly. Call it before loading a
    compiled engine that uses the ops.

    Raises:
        KernelBuildError: no C++ compiler / ninja, a compile error, or a library that does not load.
    """
    return _load()[0]


def load_aoti_package(package_path: str):
    """The AOTInductor package at ``package_path`` (a .pt2 file), loaded by torch's own loader
    (``torch::inductor::AOTIModelPackageLoader``) behind kilnlm's ``AotiPackage``: ``run(inputs)`` takes and
    returns flat lists of tensors and releases the GIL for the whole forward; ``constants_span()`` gives the
    ``[begin, end)`` addresses of its CPU weights (``[0, 0]`` when it has none). Loads the kernels first.

    Raises:
        KernelBuildError: the kernels library cannot be built or loaded.
        RuntimeError: the package fails to load (torch's loader's message).
    """
    return _load()[1].AotiPackage(str(package_path))


def _load():
    with _LOCK:
        if _LOADED:
            return _LOADED[0]
        sources = _sources()
        name = f"kilnlm_cpu_kernels_{_build_key(sources)}"
        build_dir = _build_root() / name
        library = build_dir / f"{name}.so"
        # A build in progress in another process holds build_dir/lock: go through torch's loader, which
        # waits for it, instead of opening a half-written library (a lock older than any build is stale).
        if not library.exists() or _build_in_progress(build_dir):
            library, module = _compile(name, sources, build_dir)
        else:
            try:
                module = _import_extension(name, library)
            except ImportError as exc:
                raise KernelBuildError(f"loading {library} failed ({exc}); delete {build_dir} to rebuild it") from exc
        # Compiled engines call the ops' C shims (csrc/c_shim.h), which the engine's .so resolves from the
        # process's global symbols when torch's loader opens it: an extension module is opened with
        # RTLD_LOCAL, so promote it (RTLD_NOLOAD: the library already loaded, not a second copy).
        ctypes.CDLL(str(library), mode=os.RTLD_GLOBAL | os.RTLD_NOLOAD)
        _LOADED.append((str(library), module))
        return _LOADED[0]


def _import_extension(name: str, library: Path):
    """Imports the built extension module at ``library`` (a dlopen plus the module's init). Raises ImportError."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
