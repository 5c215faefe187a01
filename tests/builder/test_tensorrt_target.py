"""``kilnlm build --target tensorrt``: the plan where TensorRT and a GPU are; elsewhere the ONNX export it is
built from, a warning naming the command that finishes it, and nothing half-built.

CI has neither TensorRT nor a GPU, so there the stand-in path runs for real and the plan build skips with
its reason; on a machine with both, the same tests take the plan path (none of them pretends either way).
"""

from __future__ import annotations

import logging

import onnx
import pytest
import torch
from conftest import TINY_ENGINE_LIMITS, build_test_engine

from factories import make_engine_inputs

from kilnlm.builder.cache_key import compute_cache_key
from kilnlm.builder.config import BuildOptions, resolve
from kilnlm.builder.errors import BuildError
from kilnlm.builder.targets.tensorrt_target import (MAX_KV_BLOCKS, build_plan_from_export, optimization_profile,
                                                    tensorrt_missing)
from kilnlm.cli.main import main
from kilnlm.runtime.abi import INPUT_NAMES
from kilnlm.runtime.engine import Engine
from kilnlm.runtime.manifest import read_manifest

MISSING = tensorrt_missing()  # None on a machine that builds plans


@pytest.fixture(scope="module")
def requested_tensorrt(tiny_llama_dir, tmp_path_factory):
    """``--target tensorrt`` of the tiny Llama (float32) here, and the warnings the build logged."""
    out = tmp_path_factory.mktemp("trt") / "tiny_tensorrt"
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("kilnlm.builder.build")
    logger.addHandler(handler)
    try:
        build_test_engine(tiny_llama_dir, out, qformat="fp32", dtype="float32", target="tensorrt", **TINY_ENGINE_LIMITS)
    finally:
        logger.removeHandler(handler)
    return out, [r.getMessage() for r in records if r.levelno >= logging.WARNING]


def test_without_tensorrt_the_build_stops_after_the_export(requested_tensorrt):
    """Here: the output is a complete onnx export (its manifest, model and weights, nothing else of a plan),
    one warning says why and gives the command that finishes it, and no temporary directory is left."""
    out, warnings = requested_tensorrt
    manifest = read_manifest(out)
    if MISSING is None:
        assert manifest.build.target == "tensorrt" and set(manifest.files) >= {"rank0.engine"}
        return
    assert manifest.build.target == "onnx" and manifest.engine_file == "model.onnx"
    assert {"model.onnx", "model.onnx.data"} <= set(manifest.files) and "rank0.engine" not in manifest.files
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert MISSING in warnings[0] and f"kilnlm build --from-onnx {out} --target tensorrt" in warnings[0]
    assert [p.name for p in out.parent.iterdir()] == [out.name]


def test_the_stand_in_export_shares_the_onnx_targets_cache_key(tiny_llama_dir, tmp_path):
    """A stand-in build is the onnx target's build (same files), so it has that build's key."""
    def key(target):
        return compute_cache_key(resolve(BuildOptions(checkpoint=tiny_llama_dir, output=tmp_path / target,
                                                      target=target, **TINY_ENGINE_LIMITS))).key

    if MISSING is None:
        assert key("tensorrt") != key("onnx")
    else:
        assert key("tensorrt") == key("onnx")
        assert resolve(BuildOptions(checkpoint=tiny_llama_dir, output=tmp_path / "x", target="tensorrt")).deferred == (
            "tensorrt", MISSING)


def test_the_profile_covers_every_graph_input_with_its_static_dims(requested_tensorrt):
    """The optimization profile names exactly the export's graph inputs; min <= opt <= max; every static
    dimension of the graph is the profile's at all three points; the limits come from the build."""
    out, _ = requested_tensorrt
    manifest = read_manifest(out)
    build, model = manifest.build, manifest.model
    profile = optimization_profile(build, model)
    if MISSING is not None:
        graph = onnx.load(str(out / "model.onnx"), load_external_data=False).graph
        assert set(profile) == {value.name for value in graph.input}
        for value in graph.input:
            dims = [d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim]
            for point in profile[value.name]:
                assert len(point) == len(dims) and all(d is None or d == p for d, p in zip(dims, point)), value.name
    for name, (lo, opt, hi) in profile.items():
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi)), name
    assert profile["input_ids"] == ((1,), (build.max_batch_size,), (build.max_num_tokens,))
    assert profile["cu_seqlens_q"][2] == (build.max_batch_size + 1,)
    assert profile["past_key_value_0"][2][1] == MAX_KV_BLOCKS
    assert set(INPUT_NAMES) <= set(profile)


def test_from_onnx_refuses_without_tensorrt_or_a_non_export(requested_tensorrt, tiny_engine_dir, tmp_path):
    """--from-onnx refuses a directory that is not an onnx export, and (here) a machine without TensorRT,
    saying what is missing, before any work and leaving no output."""
    out, _ = requested_tensorrt
    with pytest.raises(BuildError, match="not an onnx export"):
        build_plan_from_export(tiny_engine_dir, tmp_path / "plan")
    if MISSING is not None:
        with pytest.raises(BuildError, match="needs TensorRT and an NVIDIA GPU"):
            build_plan_from_export(out, tmp_path / "plan")
    assert not (tmp_path / "plan").exists() and list(tmp_path.iterdir()) == []


def test_cli_from_onnx_needs_the_tensorrt_target(requested_tensorrt, tmp_path, capsys):
    out, _ = requested_tensorrt
    status = main(["build", "--from-onnx", str(out), "--output", str(tmp_path / "plan")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status != 0 and len(err) == 1 and "add --target tensorrt" in err[0]
    status = main(["build", "--output", str(tmp_path / "plan")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status != 0 and len(err) == 1 and "--checkpoint is required" in err[0]
    assert not (tmp_path / "plan").exists()


@pytest.mark.skipif(MISSING is not None, reason=f"building a TensorRT plan needs TensorRT and a GPU: {MISSING}")
def test_the_plan_serves_the_cpu_engines_logits(requested_tensorrt, tiny_engine_dir):
    """On a machine with TensorRT and a GPU: the plan of the tiny Llama (float32), loaded by the runtime's
    tensorrt backend, gives the CPU engine's logits over two packed steps (context chunks, then generation
    tokens with a new context), within 2e-3 (TensorRT's float32 GEMMs may use TF32)."""
    out, _ = requested_tensorrt
    trt_engine = Engine.load(out, trusted_keys=None)
    cpu_engine = Engine.load(tiny_engine_dir, trusted_keys=None)
    build = cpu_engine.manifest.build
    tpb, max_blocks = build.tokens_per_block, build.max_blocks_per_seq
    steps = [make_engine_inputs([(list(range(100, 137)), 0), (list(range(300, 305)), 0)], tpb, max_blocks),
             make_engine_inputs([([7], 37), ([9], 5), (list(range(500, 540)), 0)], tpb, max_blocks)]
    kv_cpu, kv_gpu = cpu_engine.allocate_kv_cache(3 * max_blocks), trt_engine.allocate_kv_cache(3 * max_blocks)
    for inputs in steps:
        expected = cpu_engine.forward(inputs, kv_cpu)
        torch.testing.assert_close(trt_engine.forward(inputs, kv_gpu), expected, atol=2e-3, rtol=0)


@pytest.mark.skipif(MISSING is None, reason="TensorRT is installed here: the plugins register (the plan test uses them)")
def test_registering_the_plugins_without_tensorrt_says_so():
    """kilnlm.plugins.tensorrt_plugins imports without TensorRT; registering its plugins raises ImportError."""
    from kilnlm.plugins.tensorrt_plugins import register_tensorrt_plugins

    with pytest.raises(ImportError, match="tensorrt"):
        register_tensorrt_plugins(90)
