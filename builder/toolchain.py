"""The toolchain an engine depends on, cheaply enough for a cache lookup.

A target's ``toolchain_versions`` (e.g. :func:`kilnlm.builder.targets.cpu.toolchain_versions`) asks inductor (importing ``torch._inductor`` costs ~4 s
on a busy 2-core machine, and its CPU-ISA probe compiles and runs test programs for another ~2-4 s). A
cache hit must cost a small fraction of a build, so the answers are memoized in
``$XDG_CACHE_HOME/kilnlm/toolchain.json`` (default ``~/.cache``), each under a digest of everything
that decides it and can be read without inductor: torch and kilnlm versions, the C++ compiler inductor
would run (``$CXX`` or ``g++``: resolved path, size, mtime), ``ATEN_CPU_CAPABILITY`` and the CPU's
feature flags. Anything that changes one of those re-runs the probe.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from pathlib import Path
from typing import Any


def memo_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kilnlm" / "toolchain.json"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compiler_identity() -> str:
    """The C++ compiler inductor runs on Linux (``$CXX``, else ``g++``): its resolved path, size, mtime."""
    cxx = os.environ.get("CXX") or "g++"
    found = shutil.which(cxx)
    if found is None:
        return f"{cxx}: not found"
    real = os.path.realpath(found)
    st = os.stat(real)
    return f"{cxx}: {real} {st.st_size} {st.st_mtime_ns}"


def _probe_id(kind: str) -> str:
    import torch

    try:
        kilnlm_version = importlib.metadata.version("kilnlm")
    except importlib.metadata.PackageNotFoundError:
        kilnlm_version = "0+unknown"
    parts = [kind, torch.__version__, kilnlm_version, _compiler_identity(), os.environ.get("ATEN_CPU_CAPABILITY", ""),
             _cpu_flags()]
    return f"{kind}:" + hashlib.sha256("\0".join(parts).encode()).hexdigest()


def _read_memo(path: Path) -> dict:
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


def memoized(kind: str, compute) -> Any:
    """``compute()``'s JSON-able answer, from the memo file when its probe id is recorded there."""
    path, probe = memo_path(), _probe_id(kind)
    known = _read_memo(path)
    if probe in known:
        return known[probe]
    value = compute()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps({**_read_memo(path), probe: value}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home directory only costs the next process the probe again
    return value


def inductor_cpu_isa() -> str:
    """The CPU vector ISA inductor generates code for on this machine: ``str(pick_vec_isa())``, e.g.
    ``"avx512 avx512_vnni"`` (memoized, see the module docstring)."""

    def probe() -> str:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        return str(pick_vec_isa())

    return memoized("cpu_isa", probe)


def kilnlm_source_digest() -> str:
    """Digest of the sources that decide what an engine contains: kilnlm.builder, kilnlm.plugins (Python
    and C++) and the artifact format (runtime/abi.py, runtime/manifest.py). Catches builder changes that
    ship without a version bump."""
    import kilnlm.builder
    import kilnlm.plugins
    import kilnlm.runtime.abi

    builder_dir = Path(kilnlm.builder.__path__[0])
    plugins_dir = Path(kilnlm.plugins.__path__[0])
    runtime_dir = Path(kilnlm.runtime.abi.__file__).parent
    files = {f"builder/{p.relative_to(builder_dir).as_posix()}": p for p in builder_dir.rglob("*.py")}
    files.update({f"plugins/{p.relative_to(plugins_dir).as_posix()}": p for p in plugins_dir.rglob("*")
                  if p.is_file() and p.suffix in (".py", ".cpp", ".h", ".cu", ".cuh")})
    files.update({f"runtime/{name}": runtime_dir / name for name in ("abi.py", "manifest.py")})
    digest = hashlib.sha256()
    for rel, path in sorted(files.items()):
        if "__pycache__" not in rel:
            with open(path, "rb") as f:
                digest.update(f"{rel}\0{hashlib.sha256(f.read()).hexdigest()}\n".encode())
    return "sha256:" + digest.hexdigest()
