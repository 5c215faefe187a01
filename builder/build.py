"""``kilnlm build``: checkpoint -> (calibration, quantization) -> fused network -> target compile -> engine dir.

The options are resolved once (:func:`kilnlm.builder.config.resolve`); everything below reads the frozen
:class:`~kilnlm.builder.config.ResolvedBuildOptions`. The engine is built in a temporary directory next to
``--output`` and renamed into place only when it is complete and smoke-tested, so a failed build never
leaves a half-written engine behind::

    <output>.tmp-<pid>/  model.pt2, tokenizer/, manifest.json (last)  --os.replace-->  <output>/

(``model.pt2`` for ``--target cpu``, or ``rank0.pt2`` ... ``rank{N-1}.pt2`` with ``--tp-size N``; ``model.onnx``
and ``model.onnx.data`` for ``--target onnx``; ``rank0.engine`` for ``--target tensorrt``, or, on a machine
without TensorRT or a GPU, the onnx export with a warning naming the command that finishes it.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time

from kilnlm.builder.cache_key import CacheKey, compute_cache_key
from kilnlm.builder.checkpoint import Checkpoint, load_checkpoint
from kilnlm.builder.config import BuildOptions, ResolvedBuildOptions, resolve
from kilnlm.builder.errors import BuildError
from kilnlm.builder.formats import Quantization
from kilnlm.builder.network.llama import LlamaNetwork, model_config_from_hf
from kilnlm.builder.network.tensor_parallel import Mapping, check_tensor_parallel, shard_network
from kilnlm.builder.targets import get_target
from kilnlm.plugins import PLUGIN_VERSIONS
from kilnlm.runtime.manifest import (BuildConfig, GenerationDefaults, Manifest, ModelConfig, move_into_place, rank_model_config,
                                     write_manifest)
from kilnlm.runtime.signing import load_signing_key, sign_engine

log = logging.getLogger(__name__)


def _check_limits(opts: ResolvedBuildOptions, model: ModelConfig, hf_config) -> None:
    """Refuse limits the model cannot honour (the limits' own ranges are checked by :func:`resolve`)."""
    if opts.max_seq_len > model.max_position_embeddings:
        raise BuildError(f"--max-seq-len {opts.max_seq_len:,} exceeds the model's max_position_embeddings "
                         f"{model.max_position_embeddings:,}: lower --max-seq-len")
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and getattr(hf_config, "use_sliding_window", True) and opts.max_seq_len > window:
        raise BuildError(f"--max-seq-len {opts.max_seq_len:,} exceeds the model's sliding_window {window:,} and kilnlm's "
                         f"attention has no sliding window: lower --max-seq-len to {window:,}")


def _check_output(opts: ResolvedBuildOptions) -> None:
    out = opts.output
    if out.exists() and not out.is_dir():
        raise BuildError(f"--output {out} is a file: pass a directory path")
    if out.is_dir() and any(out.iterdir()) and not opts.overwrite:
        raise BuildError(f"--output {out} exists and is not empty: pass --overwrite or choose another directory")


def _generation_defaults(ck: Checkpoint) -> GenerationDefaults:
    def first(*values):
        return next((v for v in values if v is not None), None)

    gc, cfg = ck.generation_config, ck.config
    eos = first(getattr(gc, "eos_token_id", None), getattr(cfg, "eos_token_id", None), ck.tokenizer.eos_token_id)
    eos_ids = [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None]
    bos = first(getattr(gc, "bos_token_id", None), getattr(cfg, "bos_token_id", None), ck.tokenizer.bos_token_id)
    pad = first(getattr(gc, "pad_token_id", None), getattr(cfg, "pad_token_id", None), ck.tokenizer.pad_token_id)
    if not eos_ids:
        raise BuildError(f"{ck.source} defines no EOS token (generation_config / config / tokenizer): add eos_token_id")
    return GenerationDefaults(eos_token_ids=eos_ids, bos_token_id=bos, pad_token_id=pad)


def build_engine(options: BuildOptions | ResolvedBuildOptions, cache_key: CacheKey | None = None) -> Manifest:
    """Build an engine directory at ``options.output`` and return its manifest, which records the build's
    cache key (``cache_key``: computed here unless the caller already did). ``options`` are resolved here
    unless they already are. Raises :class:`BuildError` for bad input; never leaves a partial
    ``options.output`` behind."""
    opts = options if isinstance(options, ResolvedBuildOptions) else resolve(options)
    _check_output(opts)
    t_start = time.perf_counter()
    cache_key = cache_key or compute_cache_key(opts)
    ck = load_checkpoint(opts.checkpoint)
    model_cfg = model_config_from_hf(ck.config)
    _check_limits(opts, model_cfg, ck.config)
    check_tensor_parallel(model_cfg, opts.tp_size)
    log.info("loaded %s (%s, %d layers) in %.1f s", opts.checkpoint, model_cfg.architecture, model_cfg.num_layers,
             time.perf_counter() - t_start)

    ck = smooth_checkpoint_for(opts, ck)  # before the network: the KV-cache calibration reads the same weights
    network = build_network(opts, ck, model_cfg)
    build_cfg = dataclasses.replace(opts.manifest_build_config(), exclude_modules=list(network.float_linears))
    if opts.quantizes_kv_cache:
        quantize_kv_cache(opts, ck, network)

    target = get_target(opts.target)
    tmp = opts.output.parent / f".{opts.output.name}.tmp-{os.getpid()}"
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        engine_files = compile_ranks(target, network, model_cfg, build_cfg, opts, tmp)
        del network
        ck.tokenizer.save_pretrained(tmp / "tokenizer")
        manifest = Manifest(model=model_cfg, build=build_cfg, generation=_generation_defaults(ck),
                            plugins={name: PLUGIN_VERSIONS[name] for name in opts.plugins_used(bool(build_cfg.exclude_modules))},
                            toolchain=target.toolchain_versions(), source_checkpoint_digest=ck.digest,
                            engine_file=engine_files[0], engine_files=engine_files if opts.tp_size > 1 else [],
                            cache_key=cache_key.key, cache_key_inputs=cache_key.inputs)
        write_manifest(tmp, manifest)
        if opts.sign_key is not None:
            log.info("signed the manifest with key %s", sign_engine(tmp, load_signing_key(opts.sign_key)))
        if opts.smoke_test:
            target.smoke_test(tmp, model_cfg, build_cfg)
        move_into_place(tmp, opts.output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("built %s in %.1f s", opts.output, time.perf_counter() - t_start)
    if opts.deferred is not None:
        requested, why = opts.deferred
        from kilnlm.builder.targets.tensorrt_target import finish_command

        log.warning("no %s engine built here (%s): wrote the %s export to %s; finish on a machine that can with: %s",
                    requested, why, opts.target, opts.output, finish_command(opts.output))
    return manifest


def compile_ranks(target, network: LlamaNetwork, model_cfg: ModelConfig, build_cfg: BuildConfig,
                  opts: ResolvedBuildOptions, out_dir) -> list[str]:
    """Compile ``network`` into ``out_dir`` with ``target``: as it is (the target's engine file) for tp_size 1,
    else each rank's shard (:func:`~kilnlm.builder.network.tensor_parallel.shard_network`) into
    ``rank{r}.pt2``, TensorRT-LLM's rank naming. Returns the engine files in rank order."""
    if opts.tp_size == 1:
        target.compile(network, model_cfg, build_cfg, opts.torch_dtype, out_dir, opts.compile)
        return [target.engine_file]
    suffix = os.path.splitext(target.engine_file)[1]
    rank_cfg = rank_model_config(model_cfg, opts.tp_size)
    files = []
    for rank in range(opts.tp_size):
        files.append(f"rank{rank}{suffix}")
        log.info("compiling tensor-parallel rank %d of %d", rank, opts.tp_size)
        shard = shard_network(network, Mapping(opts.tp_size, rank))
        target.compile(shard, rank_cfg, build_cfg, opts.torch_dtype, out_dir, opts.compile, engine_file=files[-1])
    return files


def smooth_checkpoint_for(opts: ResolvedBuildOptions, ck: Checkpoint) -> Checkpoint:
    """``ck`` with the format's SmoothQuant smoothing folded into its weights (:mod:`kilnlm.builder.smoothing`,
    measured on the calibration text), or ``ck`` itself for a format without it or a checkpoint smoothed
    already. Everything after it -- the mixed-precision search, the FP8 calibration, the network, the
    KV-cache calibration -- reads the smoothed weights."""
    if opts.format.smoothing_alpha is None or ck.smoothing_alpha is not None:
        return ck
    from kilnlm.builder.calibration import calibration_batches
    from kilnlm.builder.smoothing import activation_amax, smooth_checkpoint

    t0 = time.perf_counter()
    smoothed = smooth_checkpoint(ck, activation_amax(ck, calibration_batches(ck.tokenizer, opts.calibration)),
                                 opts.smoothquant_alpha)
    log.info("SmoothQuant smoothing (alpha %g) folded into the weights in %.1f s", opts.smoothquant_alpha,
             time.perf_counter() - t0)
    return smoothed


def _float_network(opts: ResolvedBuildOptions, ck: Checkpoint, model_cfg: ModelConfig) -> LlamaNetwork:
    return LlamaNetwork(model_cfg, ck.state_dict, opts.torch_dtype)


def _float_linears(opts: ResolvedBuildOptions, ck: Checkpoint) -> tuple[str, ...]:
    """The decoder linears ``--auto-quantize-bits`` keeps in the activation dtype (none without the search)."""
    if not opts.searches_precision:
        return ()
    from kilnlm.builder.auto_quantize import search_float_linears

    return search_float_linears(ck, opts.format, opts.calibration, opts.auto_quantize_bits)


def _fp8_network(opts: ResolvedBuildOptions, ck: Checkpoint, model_cfg: ModelConfig) -> LlamaNetwork:
    from kilnlm.builder.quantize import calibrate_fp8

    float_linears = _float_linears(opts, ck)
    fp8_amax = calibrate_fp8(ck, opts.format, opts.calibration, opts.quantize_lm_head)
    return LlamaNetwork(model_cfg, ck.state_dict, opts.torch_dtype, fp8_amax, float_linears=float_linears)


def _fp8_rowwise_network(opts: ResolvedBuildOptions, ck: Checkpoint, model_cfg: ModelConfig) -> LlamaNetwork:
    from kilnlm.builder.quantize import quantize_fp8_rowwise

    float_linears = _float_linears(opts, ck)
    state, quant = quantize_fp8_rowwise(ck, opts.format, opts.quantize_lm_head, float_linears)
    return LlamaNetwork(model_cfg, state, opts.torch_dtype, quant=quant, float_linears=float_linears)


def _modelopt_network(opts: ResolvedBuildOptions, ck: Checkpoint, model_cfg: ModelConfig) -> LlamaNetwork:
    from kilnlm.builder.quantize_int import quantize_int

    state, quant = quantize_int(ck, opts)
    return LlamaNetwork(model_cfg, state, opts.torch_dtype, quant=quant)


# A format's quantization method -> how its network is made (ModelOpt and transformers are imported only there).
_NETWORK_BUILDERS = {Quantization.NONE: _float_network, Quantization.FP8_CALIBRATION: _fp8_network,
                     Quantization.FP8_ROWWISE: _fp8_rowwise_network, Quantization.MODELOPT_EXPORT: _modelopt_network}


def build_network(opts: ResolvedBuildOptions, ck: Checkpoint, model_cfg: ModelConfig) -> LlamaNetwork:
    """The eager network for ``opts.format``: smoothing (:func:`smooth_checkpoint_for`, unless ``ck`` is
    smoothed already) and quantization (ModelOpt, when the format has one) included, activations in
    ``opts.dtype``. Raises :class:`BuildError` for invalid quantization options or
    calibration data."""
    t0 = time.perf_counter()
    ck = smooth_checkpoint_for(opts, ck)
    network = _NETWORK_BUILDERS[opts.format.quantization](opts, ck, model_cfg)
    if opts.format.quantization is not Quantization.NONE:
        log.info("%s quantization took %.1f s", opts.qformat, time.perf_counter() - t0)
    return network


def quantize_kv_cache(opts: ResolvedBuildOptions, ck: Checkpoint, network: LlamaNetwork) -> None:
    """``--kv-cache-dtype fp8 | int8``: calibrate K (after RoPE) and V per layer on the calibration text
    (ModelOpt, see :mod:`kilnlm.builder.kv_quant`) and bake the scales into ``network``'s attention layers.
    Raises :class:`BuildError` for unusable calibration data or an unsupported architecture."""
    from kilnlm.builder.calibration import calibration_batches
    from kilnlm.builder.kv_quant import attach_kv_scales, calibrate_kv_cache, kv_scales

    t0 = time.perf_counter()
    batches = calibration_batches(ck.tokenizer, opts.calibration)
    amax = calibrate_kv_cache(ck, batches, show_progress=log.isEnabledFor(logging.INFO))
    attach_kv_scales(network, kv_scales(amax, opts.kv_cache_dtype))
    log.info("%s KV-cache calibration (ModelOpt) took %.1f s", opts.kv_cache_dtype, time.perf_counter() - t0)
