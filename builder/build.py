"""``kilnlm build``: checkpoint -> (FP8 calibration) -> fused network -> AOTInductor package -> engine dir.

The engine is built in a temporary directory next to ``--output`` and renamed into place only when it
is complete and smoke-tested, so a failed build never leaves a half-written engine behind::

    <output>.tmp-<pid>/  model.pt2, tokenizer/, manifest.json (last)  --os.replace-->  <output>/
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kilnlm.builder.cache_key import CacheKey, compute_cache_key
from kilnlm.builder.checkpoint import Checkpoint, load_checkpoint
from kilnlm.builder.compile import CompileOptions, compile_engine
from kilnlm.builder.errors import BuildError
from kilnlm.builder.kv_quant import KV_QUANT_MAX, resolve_kv_cache_dtype
from kilnlm.builder.network.llama import LlamaNetwork, model_config_from_hf
from kilnlm.builder.toolchain import inductor_cpu_isa
from kilnlm.runtime.manifest import BuildConfig, GenerationDefaults, Manifest, ModelConfig, move_into_place, write_manifest

log = logging.getLogger(__name__)

QFORMATS = ("fp32", "bf16", "fp8", "int4_awq", "int4_wo", "int8_wo", "int8_sq")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# qformat -> activation / KV-cache dtype when --dtype auto (W4A16 / W8A16 / W8A8 run bfloat16 activations).
AUTO_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp8": "bfloat16", "int4_awq": "bfloat16", "int4_wo": "bfloat16",
              "int8_wo": "bfloat16", "int8_sq": "bfloat16"}
# qformat -> the GEMM plugin its linears call (besides paged_attention).
LINEAR_PLUGINS = {"fp8": "fp8_linear", "int4_awq": "int4_linear", "int4_wo": "int4_linear", "int8_wo": "int8_linear",
                  "int8_sq": "int8_sq_linear"}
DEFAULT_GROUP_SIZE = 128
DEFAULT_CALIB_NUM_SAMPLES = 24
# int4_awq's search runs each sample through every linear once per candidate alpha (11 with ModelOpt's
# alpha_step 0.1): 16 samples keep a SmolLM2 build to minutes on 2 cores. SmolLM2's perplexity moves by
# +-1.5 points with the sample count (docs/quantization.md: 8 +13.9%, 16 +10.9%, 24 +12.9%).
AWQ_DEFAULT_CALIB_NUM_SAMPLES = 16
DEFAULT_CALIB_SEQ_LEN = 256


@dataclass
class BuildOptions:
    """What ``kilnlm build`` takes (TensorRT-LLM's meanings for the limits)."""

    checkpoint: Path
    output: Path
    qformat: str = "fp32"
    dtype: str = "auto"  # activation / KV-cache dtype: auto | float32 | bfloat16
    max_batch_size: int = 32  # sequences per forward
    max_seq_len: int = 2048  # tokens of one sequence (prompt + generated)
    max_num_tokens: int = 2048  # packed tokens per forward
    tokens_per_block: int = 32  # tokens per paged-KV block
    kv_cache_dtype: str = "auto"  # paged KV pool: auto (= dtype) | fp8 | int8 (8 bits, calibrated per-layer scales)
    overwrite: bool = False
    smoke_test: bool = True
    # Quantization (None = not given: the default applies where the format uses it, see check_quant_options).
    group_size: int | None = None  # int4 formats: input columns per scale (default 128, else the largest of 64/32/16 that divides)
    calib_data: Path | None = None  # calibrated formats: plain text / JSONL "text" (default: calibration.py's texts)
    calib_num_samples: int | None = None  # calibrated formats: samples (default 24)
    calib_seq_len: int | None = None  # calibrated formats: tokens per sample (default 256)
    quantize_lm_head: bool = False  # quantized formats: the LM head through the same format
    per_token: bool = False  # int8_sq: dynamic per-token activation scales instead of the calibrated per-tensor one
    smoothquant_alpha: float | None = None  # int8_sq: SmoothQuant's alpha (None: searched; 0.5 with per_token)
    zero_point: bool | None = None  # int4 formats: asymmetric groups (None: the format's default, on for int4_awq)
    export_checkpoint: Path | None = None  # integer formats: also write ModelOpt's unified HF checkpoint here
    compile: CompileOptions = field(default_factory=CompileOptions)


def resolve_dtype(qformat: str, dtype: str) -> str:
    """The activation dtype name for ``qformat`` and ``--dtype``. Raises :class:`BuildError` for
    contradictory choices (fp32 weights with bfloat16 activations and the reverse)."""
    if qformat not in QFORMATS:
        raise BuildError(f"--qformat {qformat!r} is not supported: choose one of {', '.join(QFORMATS)}")
    if dtype == "auto":
        return AUTO_DTYPE[qformat]
    if dtype not in DTYPES:
        raise BuildError(f"--dtype {dtype!r} is not supported: choose auto, {', '.join(DTYPES)}")
    if qformat in ("fp32", "bf16") and dtype != AUTO_DTYPE[qformat]:
        raise BuildError(f"--qformat {qformat} runs {AUTO_DTYPE[qformat]} activations, not {dtype}: "
                         f"drop --dtype or pick --qformat {'fp32' if dtype == 'float32' else 'bf16'}")
    return dtype


def check_quant_options(opts: BuildOptions) -> None:
    """Refuse quantization options that ``opts.qformat`` would ignore, with what would work instead.

    Options a format does not use are refused rather than silently ignored: a pipeline passing
    ``--calib-data`` to int4_wo most likely meant int4_awq, and an ignored option hides that."""
    from kilnlm.builder.quantize_int import CALIBRATED_QFORMATS, INT4_QFORMATS, INT_QFORMATS, LM_HEAD_QFORMATS

    q = opts.qformat
    calib_given = [flag for flag, value in (("--calib-data", opts.calib_data), ("--calib-size", opts.calib_num_samples),
                                            ("--calib-max-seq-len", opts.calib_seq_len)) if value is not None]
    if calib_given and q not in CALIBRATED_QFORMATS and opts.kv_cache_dtype == "auto":
        raise BuildError(f"{', '.join(calib_given)} given but --qformat {q} does not calibrate: drop them, or pick a "
                         f"calibrated format ({', '.join(CALIBRATED_QFORMATS)}) or an 8-bit --kv-cache-dtype (fp8, int8)")
    for flag, value in (("--calib-size", opts.calib_num_samples), ("--calib-max-seq-len", opts.calib_seq_len)):
        if value is not None and value < 1:
            raise BuildError(f"{flag} is {value}: it must be at least 1")
    if opts.calib_data is not None:  # read now: a bad file fails before the long steps, not after them
        from kilnlm.builder.calibration import read_calibration_text

        read_calibration_text(Path(opts.calib_data))
    if opts.group_size is not None and q not in INT4_QFORMATS:
        raise BuildError(f"--group-size applies to the int4 formats ({', '.join(INT4_QFORMATS)}), not --qformat {q}: drop it")
    if opts.quantize_lm_head and q not in LM_HEAD_QFORMATS:
        raise BuildError(f"--quantize-lm-head works with {', '.join(LM_HEAD_QFORMATS)}, not "
                         f"--qformat {q}: drop it or pick one of those")
    if opts.zero_point is not None and q not in INT4_QFORMATS:
        raise BuildError(f"--zero-point / --no-zero-point apply to the int4 formats ({', '.join(INT4_QFORMATS)}), not "
                         f"--qformat {q}: drop it")
    if (opts.per_token or opts.smoothquant_alpha is not None) and q != "int8_sq":
        raise BuildError(f"--per-token / --smoothquant-alpha apply to --qformat int8_sq, not {q}: drop them")
    if opts.smoothquant_alpha is not None and not 0.0 <= opts.smoothquant_alpha <= 1.0:
        raise BuildError(f"--smoothquant-alpha {opts.smoothquant_alpha}: it must be within [0, 1] (0.5 is SmoothQuant's "
                         "usual choice with --per-token)")
    if opts.export_checkpoint is not None and q not in INT_QFORMATS:
        raise BuildError(f"--export-checkpoint writes ModelOpt's unified checkpoint for {', '.join(INT_QFORMATS)}, not "
                         f"--qformat {q}: drop it or pick one of those")


def default_calib_num_samples(qformat: str) -> int:
    """Calibration samples when ``--calib-size`` is not given (24; 16 for int4_awq)."""
    return AWQ_DEFAULT_CALIB_NUM_SAMPLES if qformat == "int4_awq" else DEFAULT_CALIB_NUM_SAMPLES


def _calibration_config(opts: BuildOptions):
    from kilnlm.builder.calibration import CalibrationConfig

    return CalibrationConfig(
        num_samples=opts.calib_num_samples if opts.calib_num_samples is not None else default_calib_num_samples(opts.qformat),
        seq_len=opts.calib_seq_len if opts.calib_seq_len is not None else DEFAULT_CALIB_SEQ_LEN,
        data_path=None if opts.calib_data is None else Path(opts.calib_data))


def _check_limits(opts: BuildOptions, model: ModelConfig, hf_config) -> None:
    for name in ("max_batch_size", "max_seq_len", "max_num_tokens", "tokens_per_block"):
        if getattr(opts, name) < 1:
            raise BuildError(f"--{name.replace('_', '-')} is {getattr(opts, name)}: it must be at least 1")
    if opts.max_seq_len > model.max_position_embeddings:
        raise BuildError(f"--max-seq-len {opts.max_seq_len:,} exceeds the model's max_position_embeddings "
                         f"{model.max_position_embeddings:,}: lower --max-seq-len")
    window = getattr(hf_config, "sliding_window", None)
    if window is not None and getattr(hf_config, "use_sliding_window", True) and opts.max_seq_len > window:
        raise BuildError(f"--max-seq-len {opts.max_seq_len:,} exceeds the model's sliding_window {window:,} and kilnlm's "
                         f"attention has no sliding window: lower --max-seq-len to {window:,}")


def _check_output(opts: BuildOptions) -> None:
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


def toolchain_versions() -> dict[str, str]:
    """kilnlm, torch, C++ compiler and the CPU vector ISA inductor generates code for."""
    from torch._inductor import cpp_builder

    try:
        kilnlm_version = importlib.metadata.version("kilnlm")
    except importlib.metadata.PackageNotFoundError:
        kilnlm_version = "0+unknown"
    info = cpp_builder.get_compiler_version_info(cpp_builder.get_cpp_compiler())
    compiler = next((part.strip() for part in info.split("_") if " version " in part), info[-80:]).strip()
    return {"kilnlm": kilnlm_version, "torch": torch.__version__, "compiler": compiler,
            "cpu_isa": inductor_cpu_isa(), "target": "cpu"}


def build_engine(opts: BuildOptions, cache_key: CacheKey | None = None) -> Manifest:
    """Build an engine directory at ``opts.output`` and return its manifest, which records the build's
    cache key (``cache_key``: computed here unless the caller already did). Raises :class:`BuildError`
    for bad input; never leaves a partial ``opts.output`` behind."""
    opts.checkpoint, opts.output = Path(opts.checkpoint), Path(opts.output)
    dtype_name = resolve_dtype(opts.qformat, opts.dtype)
    dtype = DTYPES[dtype_name]
    kv_cache_dtype = resolve_kv_cache_dtype(opts.kv_cache_dtype, dtype_name)
    check_quant_options(opts)
    _check_output(opts)
    t_start = time.perf_counter()
    cache_key = cache_key or compute_cache_key(opts)
    ck = load_checkpoint(opts.checkpoint)
    model_cfg = model_config_from_hf(ck.config)
    _check_limits(opts, model_cfg, ck.config)
    log.info("loaded %s (%s, %d layers) in %.1f s", opts.checkpoint, model_cfg.architecture, model_cfg.num_layers,
             time.perf_counter() - t_start)

    network = build_network(opts, ck, model_cfg, dtype)
    build_cfg = BuildConfig(qformat=opts.qformat, dtype=dtype_name, kv_cache_dtype=kv_cache_dtype,
                            max_batch_size=opts.max_batch_size, max_num_tokens=opts.max_num_tokens,
                            max_seq_len=opts.max_seq_len, tokens_per_block=opts.tokens_per_block, target="cpu")
    if kv_cache_dtype in KV_QUANT_MAX:
        quantize_kv_cache(opts, ck, network, kv_cache_dtype)

    from kilnlm.plugins import PLUGIN_VERSIONS

    # gemm: the float linears and the 16-bit LM head (every engine but an integer one with --quantize-lm-head).
    used = (["paged_attention"] + ([] if opts.quantize_lm_head else ["gemm"])
            + ([LINEAR_PLUGINS[opts.qformat]] if opts.qformat in LINEAR_PLUGINS else []))
    tmp = opts.output.parent / f".{opts.output.name}.tmp-{os.getpid()}"
    opts.output.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        compile_engine(network, model_cfg, build_cfg, dtype, tmp / "model.pt2", opts.compile)
        del network
        ck.tokenizer.save_pretrained(tmp / "tokenizer")
        manifest = Manifest(model=model_cfg, build=build_cfg, generation=_generation_defaults(ck),
                            plugins={name: PLUGIN_VERSIONS[name] for name in used},
                            toolchain=toolchain_versions(), source_checkpoint_digest=ck.digest,
                            cache_key=cache_key.key, cache_key_inputs=cache_key.inputs)
        write_manifest(tmp, manifest)
        if opts.smoke_test:
            _smoke_test(tmp)
        move_into_place(tmp, opts.output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("built %s in %.1f s", opts.output, time.perf_counter() - t_start)
    return manifest


def build_network(opts: BuildOptions, ck: Checkpoint, model_cfg: ModelConfig, dtype: torch.dtype) -> LlamaNetwork:
    """The eager network for ``opts.qformat``: quantization (ModelOpt, when the format has one) included.
    Raises :class:`BuildError` for invalid quantization options or calibration data."""
    from kilnlm.builder.quantize_int import INT_QFORMATS, IntQuantConfig, quantize_int

    if opts.qformat == "fp8":
        from kilnlm.builder.quantize import calibrate_fp8

        t0 = time.perf_counter()
        fp8_amax = calibrate_fp8(ck, _calibration_config(opts), opts.quantize_lm_head)
        log.info("FP8 calibration (ModelOpt) took %.1f s", time.perf_counter() - t0)
        return LlamaNetwork(model_cfg, ck.state_dict, dtype, fp8_amax)
    if opts.qformat in INT_QFORMATS:
        t0 = time.perf_counter()
        cfg = IntQuantConfig(opts.qformat, opts.group_size, opts.quantize_lm_head, _calibration_config(opts),
                             opts.export_checkpoint, opts.per_token, opts.smoothquant_alpha, opts.zero_point)
        state, quant = quantize_int(ck, cfg)
        log.info("%s quantization (ModelOpt) took %.1f s", opts.qformat, time.perf_counter() - t0)
        return LlamaNetwork(model_cfg, state, dtype, quant=quant)
    return LlamaNetwork(model_cfg, ck.state_dict, dtype)


def quantize_kv_cache(opts: BuildOptions, ck: Checkpoint, network: LlamaNetwork, kv_cache_dtype: str) -> None:
    """``--kv-cache-dtype fp8 | int8``: calibrate K (after RoPE) and V per layer on the calibration text
    (ModelOpt, see :mod:`kilnlm.builder.kv_quant`) and bake the scales into ``network``'s attention layers.
    Raises :class:`BuildError` for unusable calibration data or an unsupported architecture."""
    from kilnlm.builder.calibration import calibration_batches
    from kilnlm.builder.kv_quant import attach_kv_scales, calibrate_kv_cache, kv_scales

    t0 = time.perf_counter()
    batches = calibration_batches(ck.tokenizer, _calibration_config(opts))
    amax = calibrate_kv_cache(ck, batches, show_progress=log.isEnabledFor(logging.INFO))
    attach_kv_scales(network, kv_scales(amax, kv_cache_dtype))
    log.info("%s KV-cache calibration (ModelOpt) took %.1f s", kv_cache_dtype, time.perf_counter() - t0)


def _smoke_test(engine_dir: Path) -> None:
    """Load the engine as the runtime does and run one forward of one token."""
    from kilnlm.runtime.abi import EngineInputs
    from kilnlm.runtime.engine import Engine

    engine = Engine.load(engine_dir)
    max_blocks = engine.manifest.build.max_blocks_per_seq
    inputs = EngineInputs(
        input_ids=torch.tensor([1], dtype=torch.int64), positions=torch.tensor([0], dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seq_lens_kv=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.zeros(1, max_blocks, dtype=torch.int32), slot_mapping=torch.tensor([0], dtype=torch.int64),
        logits_indices=torch.tensor([0], dtype=torch.int64),
    )
    logits = engine.forward(inputs, engine.allocate_kv_cache(1))
    if logits.shape != (1, engine.manifest.model.vocab_size) or not torch.isfinite(logits).all():
        raise BuildError(f"smoke test of the built engine failed: logits {tuple(logits.shape)}, finite="
                         f"{bool(torch.isfinite(logits).all())}; report this as a kilnlm bug")
