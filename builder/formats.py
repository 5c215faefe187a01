"""The quantization formats ``kilnlm build --qformat`` offers: one :class:`QuantFormat` entry per format.

Everything the builder, the CLI and the benchmark need to know about a format is declared here and read
from here (TensorRT-LLM's ``QuantAlgo`` + ``QuantConfig`` and vLLM's quantization registry are the
models); nothing else compares a format's name. A new format is one entry below plus its plugin kernel.

===========  ===========  ===========  ==================  ==============================  ==========
qformat      activations  weights      linear op           ModelOpt recipe                 calibrated
===========  ===========  ===========  ==================  ==============================  ==========
fp32         float32      float32      gemm                --                              no
bf16         bfloat16     bfloat16     gemm                --                              no
fp8          bfloat16     E4M3, 1 B    fp8_linear          FP8_DEFAULT_CFG                 yes
fp8_rowwise  bfloat16     E4M3, 1 B    fp8_rowwise_linear  FP8_PER_CHANNEL_PER_TOKEN_CFG   search
int4_awq     bfloat16     int4, 0.5 B  int4_linear         INT4_AWQ_CFG (awq_lite)         yes
int4_wo      bfloat16     int4, 0.5 B  int4_linear         INT4_BLOCKWISE_WEIGHT_ONLY_CFG  no
int8_wo      bfloat16     int8, 1 B    int8_linear         INT8_WEIGHT_ONLY_CFG            no
int8_sq      bfloat16     int8, 1 B    int8_sq_linear      INT8_SMOOTHQUANT_CFG            yes
===========  ===========  ===========  ==================  ==============================  ==========

By default fp8_rowwise keeps the decoder linears most sensitive on the calibration text in bfloat16
(``auto_quantize_bits``, :mod:`kilnlm.builder.auto_quantize`: the search is all the calibration text it
reads); fp8 offers the same search. int8_sq quantizes activations per token unless ``--no-per-token``.

The build turns a checkpoint into the network by the entry's :class:`Quantization` method: the float
weights as they are, FP8 amax calibration or FP8 rowwise quantization of the weights alone
(:mod:`kilnlm.builder.quantize`), or a ModelOpt recipe whose unified checkpoint is read back
(:mod:`kilnlm.builder.quantize_int`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from torch import nn

from kilnlm.builder.errors import BuildError
from kilnlm.builder.network.layers import Fp8Linear, Fp8RowwiseLinear, Int4Linear, Int8Linear, Int8SqLinear, Linear

# SmoothQuant alphas a per-tensor SmoothQuant build tries when --smoothquant-alpha is not given.
SMOOTHQUANT_ALPHA_GRID = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
# SmoothQuant --per-token without --smoothquant-alpha: TensorRT-LLM's recipe for per-token activations.
PER_TOKEN_SMOOTHQUANT_ALPHA = 0.5
# --auto-quantize-bits default of fp8_rowwise: at most 1/16 of the decoder's linear weights stay 16-bit, the
# ones ModelOpt's auto_quantize scores most sensitive on the calibration text (+6% weight bytes at most).
# Fixed before it was measured on any held-out text (docs/quantization.md has what it buys). Per-tensor fp8
# offers the search but does not run it by default (8 bits); its smoothing (FP8_SMOOTHING_ALPHA) is what keeps it
# within its bound.
FP8_AUTO_QUANTIZE_BITS = 8.5
# fp8's SmoothQuant migration strength (builder/smoothing.py): of 0.1, 0.2, 0.3, 0.4, 0.5 and 0.7, the one whose
# ModelOpt FP8 simulation of SmolLM2 lost the least next-token loss on validation windows of the default
# calibration text (0.029 nats per token over fp32 against 0.035-0.041 for the others and 0.032 unsmoothed).
# Smoothing moves the massive activations' range into the weights, so that one static activation scale no
# longer flushes a text's ordinary activations towards E4M3's subnormals (docs/quantization.md).
FP8_SMOOTHING_ALPHA = 0.3


class Quantization(enum.Enum):
    """How the build gets a format's network from the float checkpoint."""

    NONE = "none"  # the float weights, cast to the activation dtype
    FP8_CALIBRATION = "fp8_calibration"  # ModelOpt FP8 amax calibration -> per-tensor scales (quantize.py)
    FP8_ROWWISE = "fp8_rowwise"  # per-channel FP8 weights from each row's amax, no calibration (quantize.py)
    MODELOPT_EXPORT = "modelopt_export"  # a ModelOpt recipe, its unified HF checkpoint read back (quantize_int.py)


class ScaleGranularity(enum.Enum):
    """What one weight scale covers."""

    NONE = "none"
    TENSOR = "tensor"  # one per linear (one per fused part)
    CHANNEL = "channel"  # one per output channel
    GROUP = "group"  # one per output channel and group of group_size input columns


@dataclass(frozen=True)
class QuantFormat:
    """One ``--qformat``.

    ``activation_dtype``: what ``--dtype auto`` resolves to; with ``fixed_dtype`` no other ``--dtype`` is
    accepted. ``weight_dtype`` / ``weight_bits``: how a linear's weight is stored in the engine (int4: two
    per byte); ``scale_granularity`` / ``scale_bytes``: its scales (float16 int4 group scales, float32
    otherwise). ``linear_plugin``: the kilnlm op its linears call (None: ``kilnlm::gemm``);
    ``linear_module``: the network module of a quantized linear. ``modelopt_config``: the name of the
    ModelOpt recipe in ``modelopt.torch.quantization`` and ``modelopt_quant_algo`` the ``quant_algo`` its
    unified checkpoint records. ``calibrated``: the quantization reads calibration text;
    ``quantizes_activations``: W8A8 (a quantized LM head gets an input quantizer too);
    ``lm_head_quantizable``: ``--quantize-lm-head`` is accepted. ``group_size``: the preferred
    ``--group-size`` of a group-wise format (None: not group-wise, the option is refused);
    ``zero_point``: the ``--zero-point`` default of a format that offers zero points (None: refused);
    ``calib_size``: the ``--calib-size`` default (``calib_size_reason``: why, where it is not the usual
    one); ``smoothquant``: SmoothQuant's options
    (``--per-token``, ``--smoothquant-alpha``) apply and its smoothing folds into the norms; ``per_token``:
    the ``--per-token / --no-per-token`` default of a SmoothQuant format.
    ``smoothing_alpha``: the migration strength of the SmoothQuant smoothing a format with static per-tensor
    activation scales folds into the float weights before it calibrates (:mod:`kilnlm.builder.smoothing`;
    ``--smoothquant-alpha`` overrides it; None: no such smoothing).
    ``fp8_rowwise_of``: TensorRT-LLM's other spelling of this format, ``--qformat <fp8_rowwise_of>
    --use-fp8-rowwise`` (resolved to this entry, :func:`kilnlm.builder.config.resolve`).
    ``auto_quantize_bits``: the ``--auto-quantize-bits`` default of a format that offers the mixed-precision
    search (:mod:`kilnlm.builder.auto_quantize`; None: not offered, the option is refused); a value above
    ``weight_bits`` reads calibration text even where the format itself does not."""

    name: str
    summary: str  # the CLI's one-line description, e.g. "W4A16 group-wise, AWQ-calibrated"
    activation_dtype: str  # "float32" | "bfloat16"
    weight_dtype: str  # "float32" | "bfloat16" | "float8_e4m3fn" | "int4" | "int8"
    weight_bits: int
    linear_module: type[nn.Module]
    quantization: Quantization = Quantization.NONE
    fixed_dtype: bool = False
    scale_granularity: ScaleGranularity = ScaleGranularity.NONE
    scale_bytes: int = 0
    linear_plugin: str | None = None
    modelopt_config: str | None = None
    modelopt_quant_algo: str | None = None
    calibrated: bool = False
    quantizes_activations: bool = False
    lm_head_quantizable: bool = False
    group_size: int | None = None
    zero_point: bool | None = None
    calib_size: int = 24
    calib_size_reason: str = ""  # why calib_size differs from the usual default (for the CLI's help)
    smoothquant: bool = False
    per_token: bool = False
    smoothing_alpha: float | None = None
    fp8_rowwise_of: str | None = None
    auto_quantize_bits: float | None = None

    @property
    def bytes_per_weight(self) -> float:
        """Bytes one weight takes in the engine, scales not counted (int4: 0.5)."""
        return self.weight_bits / 8

    def searches_precision(self, auto_quantize_bits: float | None) -> bool:
        """Whether a build at ``auto_quantize_bits`` (None: not offered) runs the mixed-precision search: a
        budget above the format's own weight bits."""
        return auto_quantize_bits is not None and auto_quantize_bits > self.weight_bits

    @property
    def group_wise(self) -> bool:
        return self.group_size is not None

    @property
    def smooths(self) -> bool:
        """Whether SmoothQuant smooths this format's activations (``--smoothquant-alpha`` applies)."""
        return self.smoothquant or self.smoothing_alpha is not None

    @property
    def exports_checkpoint(self) -> bool:
        """Whether ``--export-checkpoint`` (ModelOpt's unified HF checkpoint) is available."""
        return self.quantization is Quantization.MODELOPT_EXPORT

    def scale_bytes_per_linear(self, out_features: int, in_features: int, group_size: int | None = None,
                               zero_point: bool = False) -> int:
        """Bytes of one ``[out_features, in_features]`` linear's weight scales (and int8 zero points,
        one per group, with ``zero_point``) in the engine. ``group_size``: group-wise formats only."""
        if self.scale_granularity is ScaleGranularity.GROUP:
            return (self.scale_bytes + (1 if zero_point else 0)) * out_features * (in_features // group_size)
        if self.scale_granularity is ScaleGranularity.CHANNEL:
            return self.scale_bytes * out_features
        return self.scale_bytes if self.scale_granularity is ScaleGranularity.TENSOR else 0


_INT4 = dict(activation_dtype="bfloat16", weight_dtype="int4", weight_bits=4, linear_module=Int4Linear,
             quantization=Quantization.MODELOPT_EXPORT, scale_granularity=ScaleGranularity.GROUP, scale_bytes=2,
             linear_plugin="int4_linear", modelopt_quant_algo="W4A16_AWQ", lm_head_quantizable=True, group_size=128)
_INT8 = dict(activation_dtype="bfloat16", weight_dtype="int8", weight_bits=8, quantization=Quantization.MODELOPT_EXPORT,
             scale_granularity=ScaleGranularity.CHANNEL, scale_bytes=4, lm_head_quantizable=True)

# --qformat name -> its declaration, in the order the CLI lists them (TensorRT-LLM's names).
FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("fp32", "", "float32", "float32", 32, Linear, fixed_dtype=True),
    QuantFormat("bf16", "", "bfloat16", "bfloat16", 16, Linear, fixed_dtype=True),
    QuantFormat("fp8", "E4M3 per-tensor, calibrated", "bfloat16", "float8_e4m3fn", 8, Fp8Linear,
                quantization=Quantization.FP8_CALIBRATION, scale_granularity=ScaleGranularity.TENSOR, scale_bytes=4,
                linear_plugin="fp8_linear", modelopt_config="FP8_DEFAULT_CFG", calibrated=True,
                quantizes_activations=True, lm_head_quantizable=True, auto_quantize_bits=8,
                smoothing_alpha=FP8_SMOOTHING_ALPHA),
    # TensorRT-LLM's --use_fp8_rowwise (quant_algo FP8_PER_CHANNEL_PER_TOKEN): activation scales computed per
    # token at run time, so no static scale for SmolLM2's massive activations to break.
    QuantFormat("fp8_rowwise", "E4M3 per-channel weights, per-token dynamic activations", "bfloat16", "float8_e4m3fn",
                8, Fp8RowwiseLinear, quantization=Quantization.FP8_ROWWISE, scale_granularity=ScaleGranularity.CHANNEL,
                scale_bytes=4, linear_plugin="fp8_rowwise_linear", modelopt_config="FP8_PER_CHANNEL_PER_TOKEN_CFG",
                quantizes_activations=True, lm_head_quantizable=True, fp8_rowwise_of="fp8",
                auto_quantize_bits=FP8_AUTO_QUANTIZE_BITS),
    # int4_awq's search runs each sample through every linear once per candidate alpha (11 with ModelOpt's
    # alpha_step 0.1): 16 samples keep a SmolLM2 build to minutes on 2 cores. SmolLM2's perplexity moves by
    # +-1.5 points with the sample count (docs/quantization.md: 8 +13.9%, 16 +10.9%, 24 +12.9%).
    QuantFormat("int4_awq", "W4A16 group-wise, AWQ-calibrated", **_INT4, modelopt_config="INT4_AWQ_CFG",
                calibrated=True, zero_point=True, calib_size=16,
                calib_size_reason="whose AWQ search runs every sample once per candidate scaling"),
    QuantFormat("int4_wo", "weight-only round-to-nearest, per group", **_INT4,
                modelopt_config="INT4_BLOCKWISE_WEIGHT_ONLY_CFG", zero_point=False),
    QuantFormat("int8_wo", "weight-only round-to-nearest, per channel", **_INT8, linear_module=Int8Linear,
                linear_plugin="int8_linear", modelopt_config="INT8_WEIGHT_ONLY_CFG", modelopt_quant_algo="W8A16"),
    # Per-token activation scales by default (TensorRT-LLM's --per_token, its SmoothQuant recipe for Llama
    # models): on SmolLM2's calibration validation windows they lose 0.016 nats per token over fp32, one
    # calibrated scale per tensor (ModelOpt's INT8_SMOOTHQUANT_CFG, --no-per-token) 0.054.
    QuantFormat("int8_sq", "W8A8 SmoothQuant, calibrated", **_INT8, linear_module=Int8SqLinear,
                linear_plugin="int8_sq_linear", modelopt_config="INT8_SMOOTHQUANT_CFG",
                modelopt_quant_algo="W8A8_SQ_PER_CHANNEL", calibrated=True, quantizes_activations=True,
                smoothquant=True, per_token=True),
)}


def get_format(qformat: str) -> QuantFormat:
    """The declaration of ``qformat``. Raises :class:`BuildError` naming the formats there are."""
    if qformat not in FORMATS:
        raise BuildError(f"--qformat {qformat!r} is not supported: choose one of {', '.join(FORMATS)}")
    return FORMATS[qformat]


def format_names(predicate=lambda fmt: True) -> tuple[str, ...]:
    """The names of the formats for which ``predicate(QuantFormat)`` holds, in registry order."""
    return tuple(name for name, fmt in FORMATS.items() if predicate(fmt))


__all__ = ["FORMATS", "FP8_AUTO_QUANTIZE_BITS", "PER_TOKEN_SMOOTHQUANT_ALPHA", "Quantization", "QuantFormat", "SMOOTHQUANT_ALPHA_GRID",
           "ScaleGranularity", "format_names", "get_format"]
