"""load_cpu_kernels: idempotent, thread-safe, fast in a new process once built, rebuilt when sources change."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kilnlm.plugins import cpu


def test_idempotent_and_thread_safe(cpu_kernels):
    results = []
    threads = [threading.Thread(target=lambda: results.append(cpu.load_cpu_kernels())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [cpu_kernels] * 4
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kilnlm::paged_attention", "CPU")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("kilnlm::fp8_linear", "CPU")


def test_second_process_loads_the_cached_build_fast(cpu_kernels):
    script = ("import sys, time; from kilnlm.plugins import load_cpu_kernels; t = time.perf_counter(); "
              "path = load_cpu_kernels(); print(path); print(time.perf_counter() - t); "
              "print('torch.utils.cpp_extension' in sys.modules)")
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    wall_s = time.perf_counter() - start
    assert result.returncode == 0, result.stderr
    path, load_s, imported_cpp_extension = result.stdout.split()
    assert path == cpu_kernels
    # cpp_extension (and setuptools with it) only where the library must be built (time of every cold start)
    assert imported_cpp_extension == "False"
    # No compiler or ninja run: hashing the sources and a dlopen (milliseconds; generous for a busy CI).
    assert float(load_s) < 1.0, f"loading the cached kernels took {load_s} s"
    assert wall_s < 30


def test_build_root_is_torch_extension_cache(tmp_path, monkeypatch):
    from torch.utils.cpp_extension import get_default_build_root

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    assert cpu._build_root() == Path(get_default_build_root()) / f"{py}_cpu"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu._build_root() == tmp_path


def test_build_key_follows_the_sources(tmp_path, monkeypatch):
    sources = cpu._sources()
    assert {p.name for p in sources} >= {"paged_attention.cpp", "fp8_linear.cpp"}
    key = cpu._build_key(sources)
    copy = tmp_path / "csrc"
    shutil.copytree(cpu.CSRC_DIR, copy)
    monkeypatch.setattr(cpu, "CSRC_DIR", copy)
    assert cpu._build_key(cpu._sources()) == key
    (copy / "fp8_linear.cpp").write_text((copy / "fp8_linear.cpp").read_text() + "\n// edited\n")
    assert cpu._build_key(cpu._sources()) != key


def test_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-kilnlm")
    with pytest.raises(cpu.KernelBuildError, match="C\\+\\+ compiler 'no-such-compiler-kilnlm' was not found.*install g\\+\\+"):
        cpu._compile("kilnlm_test_never_built", cpu._sources(), tmp_path / "build")
