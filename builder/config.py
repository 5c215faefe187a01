"""Build options: what the user gave (:class:`BuildOptions`) and the one resolved build configuration
(:class:`ResolvedBuildOptions`) that the build, the cache key and the manifest read.

::

    kilnlm build flags --argparse--> BuildOptions --resolve()--> ResolvedBuildOptions --+--> build_engine
    (defaults and help texts        (None = not      (validated once,             +--> compute_cache_key
     generated from the fields       given)           defaults applied, frozen)    +--> manifest.build
     and the format registry)                                                          (runtime BuildConfig)

Each default is written once: the limits, dtype, target and KV-cache dtype as :class:`BuildOptions` field
defaults; the quantization defaults (group size, zero points, calibration size) per format in
:mod:`kilnlm.builder.formats`; :data:`DEFAULT_CALIB_MAX_SEQ_LEN` here. Field names are the CLI's flags
(TensorRT-LLM's names): ``--calib-size`` is ``calib_size``, ``--calib-max-seq-len`` is ``calib_max_seq_len``.

The manifest's :class:`kilnlm.runtime.manifest.BuildConfig` is the part of the resolved options that the
runtime needs (:meth:`ResolvedBuildOptions.manifest_build_config`): format, dtypes, limits, target.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch

from kilnlm.builder.calibration import CalibrationConfig, read_calibration_text
from kilnlm.builder.errors import BuildError
from kilnlm.builder.formats import FORMATS, PER_TOKEN_SMOOTHQUANT_ALPHA, QuantFormat, format_names, get_format
from kilnlm.builder.kv_quant import KV_QUANT_MAX, resolve_kv_cache_dtype
from kilnlm.builder.targets import TARGETS, get_target
from kilnlm.runtime.manifest import BuildConfig
from kilnlm.runtime.signing import load_signing_key

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_CALIB_MAX_SEQ_LEN = 256  # tokens per calibration sample
MAX_AUTO_QUANTIZE_BITS = 16  # --auto-quantize-bits at which every linear stays in bfloat16
LIMIT_FIELDS = ("max_batch_size", "max_seq_len", "max_num_tokens", "tokens_per_block")


@dataclass(frozen=True)
class BuildOptions:
    """What ``kilnlm build`` takes, one field per flag (TensorRT-LLM's meanings for the limits). None =
    not given: :func:`resolve` applies the default where the format uses the option and refuses it where
    the format does not."""

    checkpoint: Path
    output: Path
    qformat: str = "fp32"  # a kilnlm.builder.formats.FORMATS name
    dtype: str = "auto"  # activation / KV-cache dtype: auto (the format's) | float32 | bfloat16
    target: str = "cpu"  # a kilnlm.builder.targets.TARGETS name
    max_batch_size: int = 32  # sequences per forward
    max_seq_len: int = 2048  # tokens of one sequence (prompt + generated)
    max_num_tokens: int = 2048  # packed tokens per forward
    tokens_per_block: int = 32  # tokens per paged-KV block
    tp_size: int = 1  # tensor-parallel ranks: one engine per rank (kilnlm.builder.network.tensor_parallel)
    kv_cache_dtype: str = "auto"  # paged KV pool: auto (= dtype) | fp8 | int8 (8 bits, calibrated per-layer scales)
    overwrite: bool = False
    smoke_test: bool = True
    group_size: int | None = None  # group-wise formats: input columns per scale
    zero_point: bool | None = None  # formats with zero points: asymmetric groups
    calib_data: Path | None = None  # calibrated formats: plain text / JSONL "text" (None: calibration.py's texts)
    calib_size: int | None = None  # calibrated formats: samples
    calib_max_seq_len: int | None = None  # calibrated formats: tokens per sample
    quantize_lm_head: bool = False  # quantized formats: the LM head through the same format
    per_token: bool | None = None  # SmoothQuant: dynamic per-token activation scales, else one calibrated per tensor (None: the format's)
    use_fp8_rowwise: bool = False  # TensorRT-LLM's spelling of fp8_rowwise: --qformat fp8 --use-fp8-rowwise
    smoothquant_alpha: float | None = None  # SmoothQuant's alpha (None: int8_sq searched, 0.5 with per_token; fp8's own)
    auto_quantize_bits: float | None = None  # FP8 formats: mean bits per decoder linear weight (None: the format's)
    export_checkpoint: Path | None = None  # ModelOpt formats: also write ModelOpt's unified HF checkpoint here
    sign_key: Path | None = None  # an Ed25519 private key: sign the engine's manifest (kilnlm.runtime.signing)
    compile: Any = None  # the target's compile options (None: the target's defaults)


def option_default(name: str) -> Any:
    """The default of :class:`BuildOptions` field ``name`` (for the CLI's defaults and help texts)."""
    return next(f.default for f in fields(BuildOptions) if f.name == name)


@dataclass(frozen=True)
class ResolvedBuildOptions:
    """One build, every option resolved and validated (made by :func:`resolve`, never by hand).

    ``dtype``: the activation / KV-cache dtype name (float32 | bfloat16); ``kv_cache_dtype``: the pool's
    (= dtype, or fp8 | int8). ``group_size``: group-wise formats only; None = the format's preferred size
    where it divides every linear of the model, else the largest of 64 / 32 / 16 that does (decided when the
    checkpoint is read, :func:`kilnlm.builder.quantize_int.default_group_size`). ``zero_point``: the
    format's default where it offers zero points, else None. ``calib_data``: None = the default texts.
    ``smoothquant_alpha``: None = searched (per-tensor SmoothQuant only); a format that smooths before its FP8
    calibration resolves it to its ``smoothing_alpha``. ``auto_quantize_bits``: the
    mixed-precision search's budget where the format offers it, else None; ``weight_bits`` means no search
    (:attr:`searches_precision`). ``use_fp8_rowwise``: whether the
    format is an FP8 rowwise one (``qformat`` already names it: both spellings resolve alike). ``compile``:
    the target's options."""

    checkpoint: Path
    output: Path
    qformat: str
    dtype: str
    target: str
    max_batch_size: int
    max_seq_len: int
    max_num_tokens: int
    tokens_per_block: int
    tp_size: int
    kv_cache_dtype: str
    overwrite: bool
    smoke_test: bool
    group_size: int | None
    zero_point: bool | None
    calib_data: Path | None
    calib_size: int
    calib_max_seq_len: int
    quantize_lm_head: bool
    per_token: bool
    use_fp8_rowwise: bool
    smoothquant_alpha: float | None
    auto_quantize_bits: float | None
    export_checkpoint: Path | None
    sign_key: Path | None
    compile: Any
    # (the --target asked for, why this machine cannot build it) when `target` is its stand-in
    # (Target.stand_in: the tensorrt target's ONNX export without TensorRT or a GPU); None otherwise
    deferred: tuple[str, str] | None = None

    @property
    def format(self) -> QuantFormat:
        return FORMATS[self.qformat]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def calibration(self) -> CalibrationConfig:
        """What calibrated quantization (of the weights or of the KV cache) reads."""
        return CalibrationConfig(num_samples=self.calib_size, seq_len=self.calib_max_seq_len, data_path=self.calib_data)

    @property
    def quantizes_kv_cache(self) -> bool:
        return self.kv_cache_dtype in KV_QUANT_MAX

    @property
    def searches_precision(self) -> bool:
        """Whether the build runs the mixed-precision search (:mod:`kilnlm.builder.auto_quantize`)."""
        return self.format.searches_precision(self.auto_quantize_bits)

    def plugins_used(self, float_linears: bool = False) -> list[str]:
        """The plugin ops the engine calls: paged attention, ``gemm`` for the float linears and a 16-bit LM
        head (every engine but a quantized one with ``--quantize-lm-head`` whose ``--auto-quantize-bits``
        search kept no linear in 16 bits: ``float_linears`` False), the format's linear op."""
        linear = [self.format.linear_plugin] if self.format.linear_plugin else []
        collectives = ["all_reduce", "all_gather"] if self.tp_size > 1 else []
        return ["paged_attention"] + ([] if self.quantize_lm_head and not float_linears else ["gemm"]) + linear + collectives

    def manifest_build_config(self) -> BuildConfig:
        """The manifest's build section."""
        return BuildConfig(qformat=self.qformat, dtype=self.dtype, kv_cache_dtype=self.kv_cache_dtype,
                           max_batch_size=self.max_batch_size, max_num_tokens=self.max_num_tokens,
                           max_seq_len=self.max_seq_len, tokens_per_block=self.tokens_per_block, target=self.target,
                           tp_size=self.tp_size)


def resolve_dtype(fmt: QuantFormat, dtype: str) -> str:
    """The activation dtype name for ``fmt`` and ``--dtype``. Raises :class:`BuildError` for contradictory
    choices (fp32 weights with bfloat16 activations and the reverse)."""
    if dtype == "auto":
        return fmt.activation_dtype
    if dtype not in DTYPES:
        raise BuildError(f"--dtype {dtype!r} is not supported: choose auto, {', '.join(DTYPES)}")
    if fmt.fixed_dtype and dtype != fmt.activation_dtype:
        other = next(name for name, f in FORMATS.items() if f.fixed_dtype and f.activation_dtype == dtype)
        raise BuildError(f"--qformat {fmt.name} runs {fmt.activation_dtype} activations, not {dtype}: "
                         f"drop --dtype or pick --qformat {other}")
    return dtype


def check_quant_options(options: BuildOptions, fmt: QuantFormat) -> None:
    """Refuse quantization options that ``fmt`` would ignore, with what would work instead.

    Options a format does not use are refused rather than silently ignored: a pipeline passing
    ``--calib-data`` to int4_wo most likely meant int4_awq, and an ignored option hides that."""
    q = fmt.name
    calib_given = [flag for flag, value in (("--calib-data", options.calib_data), ("--calib-size", options.calib_size),
                                            ("--calib-max-seq-len", options.calib_max_seq_len)) if value is not None]
    bits = options.auto_quantize_bits
    if bits is not None and fmt.auto_quantize_bits is None:
        raise BuildError(f"--auto-quantize-bits applies to --qformat "
                         f"{' / '.join(format_names(lambda f: f.auto_quantize_bits is not None))}, not {q}: drop it")
    if bits is not None and not fmt.weight_bits <= bits <= MAX_AUTO_QUANTIZE_BITS:
        raise BuildError(f"--auto-quantize-bits {bits}: it must be within [{fmt.weight_bits}, {MAX_AUTO_QUANTIZE_BITS}] "
                         f"for --qformat {q} ({fmt.weight_bits}: every linear in {q}, no search)")
    searches = fmt.searches_precision(resolve_auto_quantize_bits(options, fmt))
    if calib_given and not fmt.calibrated and not searches and options.kv_cache_dtype == "auto":
        raise BuildError(f"{', '.join(calib_given)} given but --qformat {q} does not calibrate: drop them, or pick a "
                         f"calibrated format ({', '.join(format_names(lambda f: f.calibrated))}), a mixed-precision "
                         f"--auto-quantize-bits or an 8-bit --kv-cache-dtype ({', '.join(KV_QUANT_MAX)})")
    for flag, value in (("--calib-size", options.calib_size), ("--calib-max-seq-len", options.calib_max_seq_len)):
        if value is not None and value < 1:
            raise BuildError(f"{flag} is {value}: it must be at least 1")
    if options.calib_data is not None:  # read now: a bad file fails before the long steps, not after them
        read_calibration_text(Path(options.calib_data))
    group_wise = ", ".join(format_names(lambda f: f.group_wise))
    if options.group_size is not None and not fmt.group_wise:
        raise BuildError(f"--group-size applies to the int4 formats ({group_wise}), not --qformat {q}: drop it")
    if options.quantize_lm_head and not fmt.lm_head_quantizable:
        raise BuildError(f"--quantize-lm-head works with {', '.join(format_names(lambda f: f.lm_head_quantizable))}, "
                         f"not --qformat {q}: drop it or pick one of those")
    if options.zero_point is not None and fmt.zero_point is None:
        raise BuildError(f"--zero-point / --no-zero-point apply to the int4 formats "
                         f"({', '.join(format_names(lambda f: f.zero_point is not None))}), not --qformat {q}: drop it")
    if options.per_token is not None and not fmt.smoothquant:
        raise BuildError(f"--per-token applies to --qformat {' / '.join(format_names(lambda f: f.smoothquant))}, "
                         f"not {q}: drop it")
    if options.smoothquant_alpha is not None and not fmt.smooths:
        raise BuildError(f"--smoothquant-alpha applies to --qformat {' / '.join(format_names(lambda f: f.smooths))}, "
                         f"not {q}: drop it")
    if options.smoothquant_alpha is not None and not 0.0 <= options.smoothquant_alpha <= 1.0:
        raise BuildError(f"--smoothquant-alpha {options.smoothquant_alpha}: it must be within [0, 1] "
                         f"({PER_TOKEN_SMOOTHQUANT_ALPHA} is SmoothQuant's usual choice with --per-token)")
    if options.export_checkpoint is not None and not fmt.exports_checkpoint:
        raise BuildError(f"--export-checkpoint writes ModelOpt's unified checkpoint for "
                         f"{', '.join(format_names(lambda f: f.exports_checkpoint))}, not --qformat {q}: drop it or "
                         "pick one of those")


def resolve_auto_quantize_bits(options: BuildOptions, fmt: QuantFormat) -> float | None:
    """``--auto-quantize-bits``, else the format's default (None where the format offers no search)."""
    return options.auto_quantize_bits if options.auto_quantize_bits is not None else fmt.auto_quantize_bits


def resolve_format(options: BuildOptions) -> QuantFormat:
    """The format ``--qformat`` names, or with ``--use-fp8-rowwise`` (TensorRT-LLM's spelling) the FP8 rowwise
    format of that qformat (``--qformat fp8 --use-fp8-rowwise`` is ``--qformat fp8_rowwise``). Raises
    :class:`BuildError` for an unknown qformat or one without a rowwise variant."""
    fmt = get_format(options.qformat)
    if not options.use_fp8_rowwise or fmt.fp8_rowwise_of is not None:
        return fmt
    rowwise = format_names(lambda f: f.fp8_rowwise_of == fmt.name)
    if not rowwise:
        bases = " / ".join(f.fp8_rowwise_of for f in FORMATS.values() if f.fp8_rowwise_of)
        raise BuildError(f"--use-fp8-rowwise applies to --qformat {bases}, not {fmt.name}: drop it, or pick --qformat "
                         f"{' / '.join(format_names(lambda f: f.fp8_rowwise_of is not None))}")
    return FORMATS[rowwise[0]]


def resolve(options: BuildOptions) -> ResolvedBuildOptions:
    """Validate ``options`` and apply every default: the one place a build option gets its final value.
    Reads ``--calib-data`` (a bad file fails here, before the long steps) but not the checkpoint. Raises
    :class:`BuildError` naming the option to change."""
    fmt = resolve_format(options)
    dtype = resolve_dtype(fmt, options.dtype)
    kv_cache_dtype = resolve_kv_cache_dtype(options.kv_cache_dtype, dtype)
    check_quant_options(options, fmt)
    for name in (*LIMIT_FIELDS, "tp_size"):
        if getattr(options, name) < 1:
            raise BuildError(f"--{name.replace('_', '-')} is {getattr(options, name)}: it must be at least 1")
    target = get_target(options.target)
    deferred = None
    stand_in = target.stand_in()
    if stand_in is not None:
        deferred = (target.name, stand_in[1])
        target = get_target(stand_in[0])
    if options.tp_size > 1 and not target.tensor_parallel:
        raise BuildError(f"--tp-size {options.tp_size}: --target {target.name} builds one-rank engines only; build "
                         f"tensor-parallel engines for --target {' / '.join(t.name for t in TARGETS.values() if t.tensor_parallel)}")
    if options.sign_key is not None:
        load_signing_key(options.sign_key)  # an unusable key fails here, before the long steps
    per_token = fmt.smoothquant and (options.per_token if options.per_token is not None else fmt.per_token)
    alpha = options.smoothquant_alpha
    if per_token and alpha is None:
        alpha = PER_TOKEN_SMOOTHQUANT_ALPHA
    if alpha is None:
        alpha = fmt.smoothing_alpha
    return ResolvedBuildOptions(
        checkpoint=Path(options.checkpoint), output=Path(options.output), qformat=fmt.name, dtype=dtype,
        target=target.name, max_batch_size=options.max_batch_size, max_seq_len=options.max_seq_len,
        max_num_tokens=options.max_num_tokens, tokens_per_block=options.tokens_per_block, tp_size=options.tp_size,
        kv_cache_dtype=kv_cache_dtype,
        overwrite=options.overwrite, smoke_test=options.smoke_test, group_size=options.group_size,
        zero_point=options.zero_point if options.zero_point is not None else fmt.zero_point,
        calib_data=None if options.calib_data is None else Path(options.calib_data),
        calib_size=options.calib_size if options.calib_size is not None else fmt.calib_size,
        calib_max_seq_len=(options.calib_max_seq_len if options.calib_max_seq_len is not None
                           else DEFAULT_CALIB_MAX_SEQ_LEN),
        quantize_lm_head=options.quantize_lm_head, per_token=per_token,
        use_fp8_rowwise=fmt.fp8_rowwise_of is not None, smoothquant_alpha=alpha,
        auto_quantize_bits=resolve_auto_quantize_bits(options, fmt),
        export_checkpoint=None if options.export_checkpoint is None else Path(options.export_checkpoint),
        sign_key=None if options.sign_key is None else Path(options.sign_key),
        compile=options.compile if options.compile is not None else target.default_compile_options(),
        deferred=deferred,
    )


__all__ = ["BuildOptions", "DEFAULT_CALIB_MAX_SEQ_LEN", "DTYPES", "ResolvedBuildOptions", "check_quant_options", "resolve_auto_quantize_bits",
           "option_default", "resolve", "resolve_dtype", "resolve_format"]
