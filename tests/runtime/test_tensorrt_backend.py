"""The ``tensorrt`` engine backend: every refusal of a plan this machine cannot run (its TensorRT version and
compute capability against the machine's), made before any plan is deserialized, and the import rule
(importing the runtime imports no TensorRT, CUDA binding or builder). CPU-only, except the last test: it
loads and runs a real plan (``KILNLM_TENSORRT_ENGINE``) and needs TensorRT and an NVIDIA GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kilnlm.runtime.backends.tensorrt as trt_backend
from factories import build_config, make_engine_inputs, make_manifest
from kilnlm.runtime.backends import engine_backend
from kilnlm.runtime.backends.tensorrt import TensorRTBackend, plan_compatibility_problem, plan_io_problem
from kilnlm.runtime.engine import Engine, verify_engine
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.manifest import MANIFEST_NAME, write_manifest

TOOLCHAIN = {"tensorrt": "10.13.0.35", "cuda_compute_capability": "9.0", "gpu": "NVIDIA H100 80GB HBM3",
             "kilnlm": "0.1.0", "torch": "2.13.0", "onnx": "1.19.0"}


def write_engine(engine_dir: Path, toolchain: dict[str, str] = TOOLCHAIN, **build) -> None:
    """An engine directory of target tensorrt whose plan is a few bytes (nothing here deserializes it)."""
    engine_dir.mkdir()
    (engine_dir / "rank0.engine").write_bytes(b"not a plan")
    build_cfg = build_config(target="tensorrt", dtype="bfloat16", kv_cache_dtype="bfloat16", **build)
    write_manifest(engine_dir, make_manifest(build_cfg, toolchain=dict(toolchain), engine_file="rank0.engine"))


# ------------------------------------------------------------------------------ plan_compatibility_problem

def test_a_matching_machine_runs_the_plan():
    assert plan_compatibility_problem(TOOLCHAIN, "10.13.0.35", "9.0", "NVIDIA H200") is None


def test_no_tensorrt_names_the_plans_version_capability_and_the_install():
    problem = plan_compatibility_problem(TOOLCHAIN, None, None, None, "import tensorrt: ModuleNotFoundError: no")
    assert "built by TensorRT 10.13.0.35 for compute capability 9.0 (NVIDIA H100 80GB HBM3)" in problem
    assert "this machine has no TensorRT (import tensorrt: ModuleNotFoundError: no)" in problem
    assert "pip install 'kilnlm[tensorrt]'" in problem and "NVIDIA GPU of compute capability 9.0" in problem


def test_no_cuda_device_names_the_capability_the_plan_needs():
    problem = plan_compatibility_problem(TOOLCHAIN, "10.13.0.35", None, None)
    assert "compute capability 9.0 (built on NVIDIA H100 80GB HBM3)" in problem and "no CUDA device" in problem


@pytest.mark.parametrize("installed", ["10.13.0.34", "10.13.0", "11.0.0.1"])
def test_another_tensorrt_version_is_refused_naming_both(installed):
    """Whole version strings compare: a plan is not portable even across patch builds."""
    problem = plan_compatibility_problem(TOOLCHAIN, installed, "9.0", "NVIDIA H100 80GB HBM3")
    assert problem.startswith(f"plan built by TensorRT 10.13.0.35, this machine has TensorRT {installed}: "
                              "TensorRT plans are not portable across versions")
    assert "`kilnlm build --from-onnx DIR --target tensorrt`" in problem and "tensorrt==10.13.0.35" in problem


def test_another_compute_capability_is_refused_naming_both_gpus():
    problem = plan_compatibility_problem(TOOLCHAIN, "10.13.0.35", "8.9", "NVIDIA L4")
    assert "plan built for compute capability 9.0 (NVIDIA H100 80GB HBM3)" in problem
    assert "this GPU (NVIDIA L4) has compute capability 8.9" in problem and "--target tensorrt" in problem


def test_the_tensorrt_version_is_checked_before_the_capability():
    assert "TensorRT 10.12.0.36" in plan_compatibility_problem(TOOLCHAIN, "10.12.0.36", "8.0", "NVIDIA A100")


@pytest.mark.parametrize("key", ["tensorrt", "cuda_compute_capability"])
def test_a_toolchain_without_the_plans_build_is_refused(key):
    toolchain = {k: v for k, v in TOOLCHAIN.items() if k != key}
    problem = plan_compatibility_problem(toolchain, "10.13.0.35", "9.0", "x")
    assert "build.target is 'tensorrt' but the toolchain records no TensorRT version or compute capability" in problem


# ------------------------------------------------------------------------------------- plan_io_problem

def abi_io_modes(num_layers: int) -> dict[str, str]:
    from kilnlm.runtime.abi import INPUT_NAMES

    modes = {name: "input" for name in INPUT_NAMES} | {"logits": "output"}
    for layer in range(num_layers):
        modes |= {f"past_key_value_{layer}": "input", f"present_key_value_{layer}": "output"}
    return modes


def test_a_plan_with_the_abis_tensors_passes():
    assert plan_io_problem(abi_io_modes(2), 2) is None


def test_a_plan_lacking_abi_tensors_is_refused_listing_them():
    modes = abi_io_modes(2)
    del modes["present_key_value_1"], modes["slot_mapping"]
    modes["logits"] = "input"  # in the wrong role
    problem = plan_io_problem(modes, 2)
    assert "lacks the engine ABI's input slot_mapping, output logits, output present_key_value_1" in problem
    assert "not built by this kilnlm's tensorrt target" in problem
    assert "past_key_value_2" in plan_io_problem(abi_io_modes(2), 3)  # a plan of fewer layers than the manifest


# ---------------------------------------------------------------------------------- verify on engine dirs

def test_the_manifest_target_tensorrt_selects_the_tensorrt_backend(tmp_path):
    write_engine(tmp_path / "engine")
    from kilnlm.runtime.manifest import read_manifest

    assert engine_backend(read_manifest(tmp_path / "engine"), tmp_path / MANIFEST_NAME) is TensorRTBackend


def test_verify_engine_refuses_the_plan_on_this_machine(tmp_path, monkeypatch):
    """On a machine without TensorRT (CI's) verify_engine says TensorRT is missing; with TensorRT, it names
    the missing GPU or (the manifest's version is one no machine has) the two TensorRT versions. Nothing is
    loaded in any case."""
    monkeypatch.setattr(TensorRTBackend, "load", lambda *a, **k: pytest.fail("a refused plan was loaded"))
    write_engine(tmp_path / "engine", {**TOOLCHAIN, "tensorrt": "0.0.0-never"})
    installed, _ = trt_backend.installed_tensorrt()
    if installed is None:
        expected = r"built by TensorRT 0\.0\.0-never for compute capability 9\.0 .*this machine has no TensorRT"
    elif not torch.cuda.is_available():
        expected = "needs an NVIDIA GPU of compute capability 9.0 .* no CUDA device"
    else:
        expected = f"plan built by TensorRT 0.0.0-never, this machine has TensorRT {installed}"
    for load in (verify_engine, Engine.load):
        with pytest.raises(EngineError, match=expected):
            load(tmp_path / "engine")


def test_a_tensorrt_without_its_libraries_is_refused_as_missing(tmp_path, monkeypatch):
    """A ``tensorrt`` package whose import fails loading its shared libraries (OSError) counts as none."""
    fake = tmp_path / "site" / "tensorrt"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise OSError('libnvinfer.so.10: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.delitem(sys.modules, "tensorrt", raising=False)
    write_engine(tmp_path / "engine")
    with pytest.raises(EngineError, match=r"no TensorRT \(import tensorrt: OSError: libnvinfer\.so\.10: cannot open"):
        verify_engine(tmp_path / "engine")


def pretend_machine(monkeypatch, installed_trt: str | None, capability: str | None, name: str | None = "NVIDIA H200"):
    monkeypatch.setattr(trt_backend, "installed_tensorrt", lambda: (installed_trt, "" if installed_trt else "not here"))
    monkeypatch.setattr(trt_backend, "current_device", lambda: (capability, name if capability else None))


@pytest.mark.parametrize("installed, capability, expected", [
    ("10.13.0.35", None, "no CUDA device"),
    ("10.11.0.33", "9.0", "plan built by TensorRT 10.13.0.35, this machine has TensorRT 10.11.0.33"),
    ("10.13.0.35", "10.0", r"this GPU \(NVIDIA H200\) has compute capability 10.0"),
])
def test_verify_refuses_what_the_machine_lacks(tmp_path, monkeypatch, installed, capability, expected):
    pretend_machine(monkeypatch, installed, capability)
    write_engine(tmp_path / "engine")
    with pytest.raises(EngineError, match=rf"cannot serve {tmp_path / 'engine'}: .*{expected}"):
        verify_engine(tmp_path / "engine")


def test_verify_passes_a_plan_the_machine_runs_without_deserializing_it(tmp_path, monkeypatch):
    pretend_machine(monkeypatch, "10.13.0.35", "9.0")
    write_engine(tmp_path / "engine")
    assert verify_engine(tmp_path / "engine").build.target == "tensorrt"  # the plan is b"not a plan"


def test_verify_refuses_a_tensor_parallel_engine(tmp_path, monkeypatch):
    pretend_machine(monkeypatch, "10.13.0.35", "9.0")
    engine_dir = tmp_path / "engine"
    engine_dir.mkdir()
    for rank in range(2):
        (engine_dir / f"rank{rank}.engine").write_bytes(b"not a plan")
    write_manifest(engine_dir, make_manifest(build_config(target="tensorrt", tp_size=2), toolchain=dict(TOOLCHAIN),
                                             engine_file="rank0.engine", engine_files=["rank0.engine", "rank1.engine"]))
    with pytest.raises(EngineError, match="build.tp_size is 2 but tensor parallelism is not supported by this backend"):
        verify_engine(engine_dir)


def test_verify_refuses_a_missing_plan(tmp_path, monkeypatch):
    pretend_machine(monkeypatch, "10.13.0.35", "9.0")
    manifest = make_manifest(build_config(target="tensorrt"), toolchain=dict(TOOLCHAIN), engine_file="rank0.engine")
    with pytest.raises(EngineError, match=r"the TensorRT plan .*rank0\.engine is missing"):
        TensorRTBackend.verify(tmp_path, manifest)


# --------------------------------------------------------------------------------------------- imports

def test_importing_the_runtime_imports_no_tensorrt_cuda_or_builder():
    probe = ("import sys, kilnlm.runtime, kilnlm.runtime.backends, kilnlm.runtime.executor\n"
             "print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in ('tensorrt', 'cuda', 'triton', 'onnx')"
             " or m.startswith('kilnlm.builder'))))")
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True)
    assert out.stdout.strip() == ""


# ---------------------------------------------------------------------------------------- a real plan

def gpu_skip_reason() -> str | None:
    installed, why = trt_backend.installed_tensorrt()
    if installed is None:
        return f"needs TensorRT ({why})"
    if not torch.cuda.is_available():
        return "needs an NVIDIA GPU (torch.cuda.is_available() is False)"
    if not os.environ.get("KILNLM_TENSORRT_ENGINE"):
        return "needs KILNLM_TENSORRT_ENGINE: a `kilnlm build --target tensorrt` engine directory"
    return None


@pytest.mark.skipif(gpu_skip_reason() is not None, reason=gpu_skip_reason() or "")
def test_a_plan_loads_and_a_decode_step_continues_its_context():
    """The plan of ``$KILNLM_TENSORRT_ENGINE`` loads; logits of a prompt's last token computed in one context
    step equal those of a context step over all but it followed by a decode step (the pool written by the
    first step, in place through the aliased past/present bindings, is what the second reads)."""
    engine = Engine.load(os.environ["KILNLM_TENSORRT_ENGINE"])
    assert isinstance(engine.backend, TensorRTBackend)
    build, vocab = engine.manifest.build, engine.manifest.model.vocab_size
    prompt = [(7 * i + 3) % vocab for i in range(min(11, build.max_num_tokens))]
    pack = lambda seqs: make_engine_inputs(seqs, build.tokens_per_block, build.max_blocks_per_seq)  # noqa: E731
    kv_cache = engine.allocate_kv_cache(build.max_blocks_per_seq)
    assert kv_cache.is_cuda and kv_cache.dtype == engine.kv_cache_dtype
    whole = engine.forward(pack([(prompt, 0)]), kv_cache)
    assert whole.shape == (1, vocab) and whole.dtype == torch.float32 and whole.device.type == "cpu"
    assert torch.isfinite(whole).all()
    kv_cache.zero_()
    engine.forward(pack([(prompt[:-1], 0)]), kv_cache)
    decoded = engine.forward(pack([(prompt[-1:], len(prompt) - 1)]), kv_cache)
    tolerance = 1e-3 if build.dtype == "float32" else 5e-2
    torch.testing.assert_close(decoded, whole, atol=tolerance * whole.abs().max().item(), rtol=0)
