"""The build-target registry: each target declares its name, engine file and toolchain, and the manifest
records them; ``cpu`` (AOTInductor) is served, ``onnx`` is not (tests/builder/test_onnx_export.py)."""

from __future__ import annotations

import inspect

import pytest

from kilnlm.builder.errors import BuildError
from kilnlm.builder.targets import TARGETS, Target
from kilnlm.runtime.manifest import read_manifest


def test_every_target_implements_the_protocol():
    assert "cpu" in TARGETS
    members = [name for name, _ in inspect.getmembers(Target) if not name.startswith("_")]
    for name, target in TARGETS.items():
        assert target.name == name and target.engine_file and target.description
        assert all(hasattr(target, member) for member in members), name
        if target.stand_in() is not None:  # cannot compile here (tensorrt without TensorRT / a GPU): says so
            with pytest.raises(BuildError, match="needs"):
                target.toolchain_versions()
            continue
        assert set(target.toolchain_versions()) >= {"kilnlm", "target"} and target.toolchain_versions()["target"] == name


def test_the_manifest_records_the_target_and_its_files(tiny_engine_dir):
    manifest = read_manifest(tiny_engine_dir)
    target = TARGETS[manifest.build.target]
    assert manifest.build.target == "cpu" and manifest.engine_file == target.engine_file
    assert manifest.engine_file in manifest.files
    assert manifest.toolchain == target.toolchain_versions()


def test_every_served_target_has_a_runtime_backend_of_the_same_name():
    """An engine of every target the builder offers for serving can be loaded: the runtime's backend registry
    has it; a target that is not served (onnx) has none."""
    from kilnlm.runtime.backends import ENGINE_BACKENDS

    served = {name for name, target in TARGETS.items() if target.served}
    assert served == set(ENGINE_BACKENDS), f"served targets {sorted(served)}, runtime backends {sorted(ENGINE_BACKENDS)}"
