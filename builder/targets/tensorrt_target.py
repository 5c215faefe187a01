"""The ``tensorrt`` target: the ONNX export (:mod:`kilnlm.builder.targets.onnx_export`), lowered for TensorRT
(:mod:`kilnlm.builder.targets.tensorrt_lowering`), parsed by TensorRT's ONNX parser into a strongly typed
network whose attention nodes are kilnlm's AOT plugins (:mod:`kilnlm.plugins.tensorrt_plugins`) and
serialized as ``rank0.engine`` (TensorRT-LLM's name), which the runtime's ``tensorrt`` backend serves.

A plan can only be built where TensorRT and an NVIDIA GPU are (the plan is specific to both). Elsewhere
``--target tensorrt`` builds the ``onnx`` target instead (:meth:`TensorRTTarget.stand_in`: the same network,
calibration and quantization) and says how to finish on a GPU machine::

    kilnlm build --checkpoint CKPT --target tensorrt --output EXPORT      (no GPU here: EXPORT is an onnx export)
    kilnlm build --from-onnx EXPORT --target tensorrt --output ENGINE     (on the GPU machine: the plan)

Written against TensorRT's documented Python API (``trt.Builder``, ``trt.OnnxParser``, strongly typed
networks, optimization profiles, ``PreviewFeature.ALIASED_PLUGIN_IO_10_03``); no machine here has TensorRT,
so the plan build has not run (docs/targets.md says what was verified where).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from kilnlm.builder.errors import BuildError
from kilnlm.builder.targets.onnx_export import MODEL_FILE, export_onnx, past_key_value_name
from kilnlm.builder.targets.onnx_target import toolchain_versions as onnx_toolchain_versions
from kilnlm.plugins import PLUGIN_VERSIONS
from kilnlm.plugins.schema import TENSORRT_PLUGIN_VERSIONS
from kilnlm.runtime.abi import INPUT_NAMES
from kilnlm.runtime.backends.tensorrt import current_device, installed_tensorrt
from kilnlm.runtime.manifest import BuildConfig, Manifest, ModelConfig, move_into_place, read_manifest, write_manifest

log = logging.getLogger(__name__)

PLAN_FILE = "rank0.engine"
MAX_KV_BLOCKS = 2**31 - 1  # the pool's num_blocks upper bound in the profile (the runtime sizes the pool)


def tensorrt_missing() -> str | None:
    """Why no TensorRT plan can be built on this machine (TensorRT not importable or without
    ``tensorrt.plugin.aot_impl``, no CUDA GPU, no Triton), or None when one can."""
    version, why = installed_tensorrt()
    if version is None:
        return f"TensorRT is not installed ({why})"
    try:
        import tensorrt.plugin as trtp
    except ImportError as exc:
        return f"TensorRT {version} has no tensorrt.plugin ({exc}): install TensorRT 10.12 or newer"
    if not hasattr(trtp, "aot_impl"):
        return f"TensorRT {version}'s tensorrt.plugin has no aot_impl: install TensorRT 10.12 or newer"
    if current_device()[0] is None:
        return "no CUDA GPU is visible (torch.cuda.is_available() is False)"
    try:
        import triton  # noqa: F401  (compiles the plugins' kernels)
    except ImportError:
        return "Triton is not installed (pip install 'kilnlm[tensorrt]')"
    return None


def optimization_profile(build: BuildConfig, model: ModelConfig) -> dict[str, tuple[tuple, tuple, tuple]]:
    """The one optimization profile of the plan: graph input name -> (min, opt, max) shape, from the
    engine's limits: T and N in 1..max_num_tokens, B in 1..max_batch_size (opt: a full generation batch,
    T = N = B = max_batch_size), num_blocks in 1..:data:`MAX_KV_BLOCKS` (opt: every sequence at max_seq_len)."""
    t_max, b_max = build.max_num_tokens, build.max_batch_size
    b_opt = min(b_max, t_max)
    blocks = build.max_blocks_per_seq

    def ranged(lo, opt, hi, *rest):
        return (lo, *rest), (opt, *rest), (hi, *rest)

    profile = {"input_ids": ranged(1, b_opt, t_max), "positions": ranged(1, b_opt, t_max),
               "cu_seqlens_q": ranged(2, b_opt + 1, b_max + 1), "seq_lens_kv": ranged(1, b_opt, b_max),
               "block_tables": ranged(1, b_opt, b_max, blocks), "slot_mapping": ranged(1, b_opt, t_max),
               "logits_indices": ranged(1, b_opt, t_max)}
    assert set(profile) == set(INPUT_NAMES)
    pool = ranged(1, b_max * blocks, MAX_KV_BLOCKS, build.tokens_per_block, model.num_kv_heads, model.head_dim)
    for layer in range(model.num_layers):
        profile[past_key_value_name(layer)] = tuple((2, *shape) for shape in pool)
    return profile


def build_plan(onnx_path: Path, build: BuildConfig, model: ModelConfig, plan_path: Path) -> None:
    """Lower the export at ``onnx_path``, parse it with TensorRT into a strongly typed network, build it for
    this GPU with :func:`optimization_profile` and write the serialized plan to ``plan_path``. The lowered
    model (beside the plan) is removed afterwards. Raises :class:`BuildError` where TensorRT is missing or
    refuses the model (its first parser or builder error)."""
    from kilnlm.builder.targets.tensorrt_lowering import lower_onnx_file

    missing = tensorrt_missing()
    if missing:
        raise BuildError(f"cannot build a TensorRT plan here: {missing}")
    import tensorrt as trt

    from kilnlm.plugins.tensorrt_plugins import register_tensorrt_plugins

    major, minor = torch.cuda.get_device_capability()
    register_tensorrt_plugins(10 * major + minor)
    lowered = lower_onnx_file(onnx_path, plan_path.with_name("lowered.onnx"))
    try:
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        # TensorRT 10's flag; later releases may make strong typing the default and drop the name
        strongly_typed = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)
        network = builder.create_network(0 if strongly_typed is None else 1 << int(strongly_typed))
        parser = trt.OnnxParser(network, logger)
        if not parser.parse_from_file(str(lowered)):
            errors = [str(parser.get_error(i)) for i in range(parser.num_errors)]
            raise BuildError(f"TensorRT {trt.__version__}'s ONNX parser refused the model ({len(errors)} errors): "
                             f"{errors[0] if errors else 'no error recorded'}")
        config = builder.create_builder_config()
        aliased_io = getattr(trt.PreviewFeature, "ALIASED_PLUGIN_IO_10_03", None)  # a preview since 10.3
        if aliased_io is not None:
            config.set_preview_feature(aliased_io, True)
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in optimization_profile(build, model).items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
        log.info("building the TensorRT %s plan for %s (sm_%d%d)", trt.__version__, torch.cuda.get_device_name(),
                 major, minor)
        serialized = builder.build_serialized_network(network, config)
        if serialized is None:
            raise BuildError(f"TensorRT {trt.__version__} failed to build the plan (its log above says why)")
        plan_path.write_bytes(bytes(serialized))
    finally:
        for path in (lowered, lowered.with_name(lowered.name + ".data")):
            path.unlink(missing_ok=True)


class TensorRTTarget:
    """The ``tensorrt`` entry of :data:`kilnlm.builder.targets.TARGETS` (see
    :class:`~kilnlm.builder.targets.Target` and the module docstring)."""

    name = "tensorrt"
    description = ("a TensorRT plan (rank0.engine) with kilnlm's Triton-kernel plugins for this NVIDIA GPU; "
                   "without TensorRT and a GPU, the onnx export and the command that finishes it")
    engine_file = PLAN_FILE
    served = True
    tensor_parallel = False

    def default_compile_options(self) -> None:
        return None

    def stand_in(self) -> tuple[str, str] | None:
        """``("onnx", why)`` where no plan can be built here (:func:`tensorrt_missing`), else None."""
        missing = tensorrt_missing()
        return None if missing is None else ("onnx", missing)

    def toolchain_versions(self) -> dict[str, str]:
        """The export's toolchain plus what the plan is specific to: the TensorRT version, the GPU's compute
        capability and name, Triton's version and the TensorRT plugins' versions. Raises :class:`BuildError`
        without TensorRT or a GPU."""
        version, why = installed_tensorrt()
        capability, gpu = current_device()
        if version is None or capability is None:
            raise BuildError(f"the tensorrt target needs TensorRT and a GPU: {why or 'no CUDA GPU is visible'}")
        return {**onnx_toolchain_versions(), "target": self.name, "tensorrt": version,
                "cuda_compute_capability": capability, "gpu": gpu, "triton": importlib.metadata.version("triton"),
                "tensorrt_plugins": ",".join(f"{k}={v}" for k, v in sorted(TENSORRT_PLUGIN_VERSIONS.items()))}

    def compile(self, network: torch.nn.Module, model: ModelConfig, build: BuildConfig, dtype: torch.dtype,
                out_dir: Path, options: None, engine_file: str | None = None) -> list[Path]:
        """Export ``network`` to ONNX in ``out_dir``, build ``out_dir / rank0.engine`` from it, and remove the
        export (the engine directory holds the plan)."""
        onnx_files = export_onnx(network, model, build, dtype, out_dir, PLUGIN_VERSIONS)
        plan = out_dir / (engine_file or PLAN_FILE)
        try:
            build_plan(out_dir / MODEL_FILE, build, model, plan)
        finally:
            for path in onnx_files:
                path.unlink(missing_ok=True)
        return [plan]

    def smoke_test(self, engine_dir: Path, model: ModelConfig, build: BuildConfig) -> None:
        """One token through the plan with the runtime's ``tensorrt`` backend; finite ``[1, vocab]`` logits."""
        from kilnlm.builder.targets.smoke import check_logits, one_token_inputs
        from kilnlm.runtime.backends.tensorrt import TensorRTBackend

        manifest = read_manifest(engine_dir)
        TensorRTBackend.verify(Path(engine_dir), manifest)
        backend = TensorRTBackend.load(Path(engine_dir), manifest)
        kv_cache = backend.allocate_kv_cache(1)
        check_logits(backend.forward(one_token_inputs(build.max_blocks_per_seq), kv_cache), model.vocab_size,
                     "smoke test of the TensorRT plan")


def finish_command(export_dir: Path) -> str:
    """The command that builds the plan from the onnx export at ``export_dir`` on a GPU machine."""
    return f"kilnlm build --from-onnx {export_dir} --target tensorrt --output {export_dir}-trt"


def build_plan_from_export(export_dir: Path, output: Path, overwrite: bool = False, smoke_test: bool = True) -> Manifest:
    """``kilnlm build --from-onnx EXPORT --target tensorrt --output OUTPUT``: the TensorRT engine of an onnx
    export (``--target onnx``, or ``--target tensorrt`` built without a GPU): the plan, the export's
    tokenizer and a manifest with target ``tensorrt``, this machine's toolchain and a cache key derived from
    the export's and that toolchain. Built next to ``output`` and renamed into place when complete (and
    smoke-tested), as :func:`kilnlm.builder.build.build_engine` does. Raises :class:`BuildError` for a
    directory that is not an onnx export, an existing non-empty ``output`` without ``overwrite``, or a
    machine without TensorRT and a GPU (checked before any work)."""
    export_dir, output = Path(export_dir), Path(output)
    export = read_manifest(export_dir)
    if export.build.target != "onnx":
        raise BuildError(f"--from-onnx {export_dir}: its build.target is {export.build.target!r}, not an onnx export "
                         "(build one with --target onnx or --target tensorrt)")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise BuildError(f"--output {output} exists and is not empty: pass --overwrite or choose another directory")
    missing = tensorrt_missing()
    if missing:
        raise BuildError(f"--from-onnx builds the TensorRT plan, which needs TensorRT and an NVIDIA GPU here: {missing}")
    target = TensorRTTarget()
    tmp = output.parent / f".{output.name}.tmp-{os.getpid()}"
    output.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        build_plan(export_dir / export.engine_file, export.build, export.model, tmp / PLAN_FILE)
        shutil.copytree(export_dir / "tokenizer", tmp / "tokenizer")
        toolchain = target.toolchain_versions()
        inputs = {"onnx_export": export.cache_key, "toolchain": toolchain}
        key = hashlib.sha256(json.dumps(inputs, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
        manifest = dataclasses.replace(export, build=dataclasses.replace(export.build, target=target.name),
                                       toolchain=toolchain, engine_file=PLAN_FILE, engine_files=[], files={},
                                       cache_key=key, cache_key_inputs=inputs)
        manifest = write_manifest(tmp, manifest)
        if smoke_test:
            target.smoke_test(tmp, manifest.model, manifest.build)
        move_into_place(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


__all__ = ["MAX_KV_BLOCKS", "PLAN_FILE", "TensorRTTarget", "build_plan", "build_plan_from_export", "finish_command",
           "optimization_profile", "tensorrt_missing"]
