"""Shared layers of the compiled network, one op per module.

Every weight is a registered buffer (the network is inference-only and exported as constants). Tensors
live on CPU; the activation dtype ``dtype`` is float32 or bfloat16 (FP8 engines run bfloat16
activations with float8_e4m3fn weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kilnlm.builder.errors import BuildError

FP8_E4M3_MAX = 448.0


@dataclass(frozen=True)
class Fp8Amax:
    """Calibrated absolute maxima of one linear: its weight's and its input's (both per tensor)."""

    weight_amax: float
    input_amax: float


class RMSNorm(nn.Module):
    """``y = weight * x / sqrt(mean(x^2) + eps)``, computed in float32 and returned in x's dtype
    (Zhang & Sennrich, 2019; the Hugging Face Llama order of casts).

    x: ``[T, hidden]`` float32 / bfloat16."""

    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", weight.to(dtype).contiguous())
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Linear(nn.Module):
    """Float linear ``y = x @ weight.T + bias`` through ``torch.ops.kilnlm.gemm`` (accumulated in float32).

    x: ``[T, in_features]`` in ``dtype``; weight ``[out_features, in_features]``; returns ``[T, out]``."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", weight.to(dtype).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kilnlm.gemm(x, self.weight, self.bias)


class Fp8Linear(nn.Module):
    """FP8 linear through ``torch.ops.kilnlm.fp8_linear``: float8_e4m3fn weight with per-tensor weight
    scales and one static per-tensor ``input_scale`` (scale = amax / 448, ModelOpt's FP8 recipe).

    A fused linear (QKV, gate/up) keeps each part's own weight scale: ``weight_scale`` is then
    ``[out_features]`` float32, constant over each part's rows, so every part is quantized exactly as the
    unfused linear would be; a single linear has a 0-dim ``weight_scale``. The parts read the same input,
    so they share its scale (the max of their input amax, which calibration records equal).

    x: ``[T, in_features]`` bfloat16; returns ``[T, out_features]`` bfloat16.
    Raises :class:`BuildError` if an amax is zero, negative or not finite."""

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None, amax: list[Fp8Amax], dtype: torch.dtype):
        super().__init__()
        for a in amax:
            if a.weight_amax <= 0 or a.input_amax <= 0 or not math.isfinite(a.weight_amax * a.input_amax):
                raise BuildError(f"FP8 calibration gave an unusable amax {a}: check the calibration data")
        part_scales = [torch.tensor(a.weight_amax / FP8_E4M3_MAX, dtype=torch.float32) for a in amax]
        q = torch.cat([(w.float() / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
                       for w, s in zip(weights, part_scales)])
        if len(part_scales) == 1:
            weight_scale = part_scales[0]
        else:
            weight_scale = torch.cat([s.expand(w.shape[0]) for w, s in zip(weights, part_scales)])
        input_scale = torch.tensor(max(a.input_amax for a in amax) / FP8_E4M3_MAX, dtype=torch.float32)
        self.register_buffer("weight", q.contiguous())
        self.register_buffer("weight_scale", weight_scale.contiguous())
        self.register_buffer("input_scale", input_scale)
        self.register_buffer("bias", None if bias is None else bias.to(dtype).contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kilnlm.fp8_linear(x, self.weight, self.weight_scale, self.input_scale, self.bias)


def make_linear(
    weights: list[torch.Tensor],
    biases: list[torch.Tensor | None],
    dtype: torch.dtype,
    amax: list[Fp8Amax] | None = None,
) -> nn.Module:
    """One linear from the row-concatenation of ``weights`` (a fused QKV / gate-up projection, or a
    single weight). ``amax`` (one per part) selects FP8 with per-part weight scales; None keeps ``dtype``."""
    bias = None
    if any(b is not None for b in biases):
        bias = torch.cat([b if b is not None else torch.zeros(w.shape[0]) for w, b in zip(weights, biases)])
    if amax is None:
        return Linear(torch.cat(weights, dim=0) if len(weights) > 1 else weights[0], bias, dtype)
    return Fp8Linear(weights, bias, amax, dtype)


@dataclass
class QuantizedWeights:
    """One quantized linear in the layout of its kilnlm op (all CPU tensors).

    ``weight``: int4 ``[out_features, in_features // 2] uint8`` (two values per byte, see
    :func:`kilnlm.plugins.reference.pack_int4`) or int8 ``[out_features, in_features] int8``;
    ``weight_scale``: int4 ``[out_features, in_features // group_size]`` / int8 ``[out_features]``, float32;
    ``input_scale``: int8_sq's per-tensor activation scale, 0-dim float32, else None; ``pre_quant_scale``:
    AWQ / SmoothQuant per-input-channel scale ``[in_features]`` float32 (None once folded into the
    preceding norm); ``bias``: ``[out_features]`` or None; ``zero_point``: int4 asymmetric groups' zero
    points ``[out_features, in_features // group_size]`` int8 in [-8, 7] (the weight is ``(q - zero) *
    scale``), None when symmetric."""

    weight: torch.Tensor
    weight_scale: torch.Tensor
    input_scale: torch.Tensor | None = None
    pre_quant_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None


@dataclass
class IntQuantization:
    """The quantized linears of a whole network built from per-linear weights (the integer formats and
    fp8_rowwise): ``linears`` by HF module name (``model.layers.{i}.self_attn.q_proj``, ..., ``lm_head``
    when the LM head is quantized); ``group_size`` for the int4 formats (None otherwise)."""

    qformat: str  # a kilnlm.builder.formats name whose linear_module builds these linears (from_parts)
    group_size: int | None
    linears: dict[str, QuantizedWeights]
    per_token: bool = False  # int8_sq: dynamic per-token activation scales (int8_sq_linear's per_token)


def _shared_pre_quant_scale(parts: list[QuantizedWeights]) -> torch.Tensor | None:
    """The one ``pre_quant_scale`` the parts of a fused linear share (they read the same input)."""
    scales = [p.pre_quant_scale for p in parts]
    if all(s is None for s in scales):
        return None
    if any(s is None for s in scales) or any(not torch.equal(s, scales[0]) for s in scales[1:]):
        raise BuildError("the parts of a fused linear (q/k/v or gate/up) have different pre_quant_scales, so they "
                         "cannot share one input: quantize them with one smoothing scale (ModelOpt's export "
                         "re-smooths them) or build without fusion")
    return scales[0].float().contiguous()


def _cat_bias(parts: list[QuantizedWeights], dtype: torch.dtype) -> torch.Tensor | None:
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.bias.float() if p.bias is not None else torch.zeros(p.weight.shape[0]) for p in parts]).to(dtype)


def _register_per_channel(module: nn.Module, parts: list[QuantizedWeights], dtype: torch.dtype,
                          weight_dtype: torch.dtype) -> None:
    """Registers ``module``'s buffers of a per-output-channel linear (int8_wo, fp8_rowwise) from ``parts``:
    ``weight [out_features, in_features]`` of ``weight_dtype`` and ``weight_scale [out_features]`` float32, the
    parts' rows concatenated, and ``bias`` (in ``dtype``) or None."""
    module.register_buffer("weight", torch.cat([p.weight for p in parts]).contiguous())
    module.register_buffer("weight_scale", torch.cat([p.weight_scale.float().reshape(-1) for p in parts]).contiguous())
    module.register_buffer("bias", _cat_bias(parts, dtype))
    if module.weight.dtype != weight_dtype or module.weight_scale.shape != (module.weight.shape[0],):
        raise BuildError(f"{weight_dtype} weight {tuple(module.weight.shape)} {module.weight.dtype} / scales "
                         f"{tuple(module.weight_scale.shape)} are not per output channel: report this as a kilnlm bug")


def int4_engine_scales(scales: torch.Tensor) -> torch.Tensor:
    """The group scales an int4 engine stores: float16 when every scale is 0 or a normal float16 (|s| in
    [2^-14, 65504]; rounded with a relative error of at most 2^-11, against the up to 1/2 of a scale that
    rounding a weight to int4 costs), else float32. float16 is how AutoAWQ and TensorRT-LLM keep int4
    scales; here it is half the bytes a decode step streams for them (float32 scales were 11% of an int4
    layer's bytes at group size 64, float16 ones are 6%)."""
    scales = scales.float().contiguous()
    magnitude = scales.abs()
    if bool(((magnitude == 0) | ((magnitude >= 2.0**-14) & (magnitude <= 65504.0))).all()):
        return scales.half()
    return scales


def _cat_zero_points(parts: list[QuantizedWeights]) -> torch.Tensor | None:
    """The fused parts' int4 zero points (zeros for a symmetric part), or None when every part is symmetric."""
    if all(p.zero_point is None for p in parts):
        return None
    return torch.cat([p.zero_point if p.zero_point is not None else torch.zeros_like(p.weight_scale, dtype=torch.int8)
                      for p in parts]).contiguous()


class Int4Linear(nn.Module):
    """W4A16 linear through ``torch.ops.kilnlm.int4_linear`` (int4_awq, int4_wo): packed int4 weight with
    group-wise scales along the input dimension (float16 where they fit, :func:`int4_engine_scales`),
    optional AWQ ``pre_quant_scale`` and optional int8 zero points (asymmetric groups).

    Fused parts are concatenated along out_features (their scale and zero-point rows with them: both are
    per output row and input group, so nothing is re-quantized). x: ``[T, in_features]`` float32 /
    bfloat16; returns ``[T, out_features]`` in x's dtype."""

    @classmethod
    def from_parts(cls, parts: list[QuantizedWeights], quant: IntQuantization, dtype: torch.dtype) -> Int4Linear:
        """The linear of ``parts`` (a fused projection's, or one) with ``quant``'s group size."""
        return cls(parts, quant.group_size, dtype)

    def __init__(self, parts: list[QuantizedWeights], group_size: int, dtype: torch.dtype):
        super().__init__()
        self.group_size = group_size
        self.register_buffer("weight", torch.cat([p.weight for p in parts]).contiguous())  # [out, in // 2] uint8
        self.register_buffer("weight_scale", int4_engine_scales(torch.cat([p.weight_scale.float() for p in parts])))
        self.register_buffer("pre_quant_scale", _shared_pre_quant_scale(parts))
        self.register_buffer("bias", _cat_bias(parts, dtype))
        self.register_buffer("zero_point", _cat_zero_points(parts))
        in_features = self.weight.shape[1] * 2
        if (self.weight.dtype != torch.uint8 or self.weight_scale.shape != (self.weight.shape[0], in_features // group_size)
                or (self.zero_point is not None and self.zero_point.shape != self.weight_scale.shape)):
            raise BuildError(f"int4 weight {tuple(self.weight.shape)} {self.weight.dtype} / scales "
                             f"{tuple(self.weight_scale.shape)} do not match group size {group_size}: report this as a kilnlm bug")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_point is None:  # symmetric: version 1's call
            return torch.ops.kilnlm.int4_linear(x, self.weight, self.weight_scale, self.pre_quant_scale, self.bias,
                                                self.group_size)
        return torch.ops.kilnlm.int4_linear(x, self.weight, self.weight_scale, self.pre_quant_scale, self.bias,
                                            self.group_size, self.zero_point)


class Int8Linear(nn.Module):
    """W8A16 weight-only linear through ``torch.ops.kilnlm.int8_linear`` (int8_wo): int8 weight with one
    float32 scale per output channel. Fused parts are concatenated along out_features.

    x: ``[T, in_features]`` float32 / bfloat16; returns ``[T, out_features]`` in x's dtype."""

    @classmethod
    def from_parts(cls, parts: list[QuantizedWeights], quant: IntQuantization, dtype: torch.dtype) -> Int8Linear:
        """The linear of ``parts`` (a fused projection's, or one)."""
        return cls(parts, dtype)

    def __init__(self, parts: list[QuantizedWeights], dtype: torch.dtype):
        super().__init__()
        if _shared_pre_quant_scale(parts) is not None:
            raise BuildError("int8_wo linears carry no pre_quant_scale: report this as a kilnlm bug")
        _register_per_channel(self, parts, dtype, torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kilnlm.int8_linear(x, self.weight, self.weight_scale, self.bias)


class Int8SqLinear(nn.Module):
    """SmoothQuant W8A8 linear through ``torch.ops.kilnlm.int8_sq_linear`` (int8_sq): per-channel int8
    weight, static per-tensor int8 activation scale, optional unfolded ``pre_quant_scale``. Fused parts
    read one input, so they share one ``input_scale`` (the max of the parts'). ``per_token``: dynamic
    per-token activation scales instead (the calibrated ``input_scale`` is kept but unused).

    x: ``[T, in_features]`` float32 / bfloat16; returns ``[T, out_features]`` in x's dtype."""

    @classmethod
    def from_parts(cls, parts: list[QuantizedWeights], quant: IntQuantization, dtype: torch.dtype) -> Int8SqLinear:
        """The linear of ``parts`` (a fused projection's, or one) with ``quant``'s per_token."""
        return cls(parts, dtype, quant.per_token)

    def __init__(self, parts: list[QuantizedWeights], dtype: torch.dtype, per_token: bool = False):
        super().__init__()
        self.per_token = per_token
        if any(p.input_scale is None for p in parts):
            raise BuildError("int8_sq linear without a calibrated input_scale: report this as a kilnlm bug")
        self.register_buffer("weight", torch.cat([p.weight for p in parts]).contiguous())  # [out, in] int8
        self.register_buffer("weight_scale", torch.cat([p.weight_scale.float().reshape(-1) for p in parts]).contiguous())
        self.register_buffer("input_scale", torch.stack([p.input_scale.float().reshape(()) for p in parts]).max())
        self.register_buffer("pre_quant_scale", _shared_pre_quant_scale(parts))
        self.register_buffer("bias", _cat_bias(parts, dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kilnlm.int8_sq_linear(x, self.weight, self.weight_scale, self.input_scale,
                                               self.pre_quant_scale, self.bias, self.per_token)


class Fp8RowwiseLinear(nn.Module):
    """FP8 rowwise linear through ``torch.ops.kilnlm.fp8_rowwise_linear`` (fp8_rowwise, TensorRT-LLM's
    FP8_PER_CHANNEL_PER_TOKEN): float8_e4m3fn weight with one float32 scale per output channel; the
    activations get a per-token scale at run time, so there is no input scale to calibrate. Fused parts
    (QKV, gate/up) simply concatenate their rows and scales.

    x: ``[T, in_features]`` float32 / bfloat16; returns ``[T, out_features]`` in x's dtype."""

    @staticmethod
    def quantize(weight: torch.Tensor, bias: torch.Tensor | None = None) -> QuantizedWeights:
        """Per-channel E4M3 quantization of a float ``[out_features, in_features]`` weight: row o's scale is
        ``amax_o / 448`` (``amax_o = max |weight[o]|`` in float32; 1 for an all-zero row), ``q =
        fp8_e4m3(clamp(weight / scale, -448, 448))`` (round to nearest even). This is what ModelOpt's
        ``FP8_PER_CHANNEL_PER_TOKEN_CFG`` weight quantizer (max calibrator, axis 0) computes from the weights
        alone, so it is computed here directly, without ModelOpt or calibration text."""
        w = weight.float()
        amax = w.abs().amax(dim=1) if w.shape[1] else w.new_zeros(w.shape[0])
        scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))  # [out] float32
        q = (w / scale[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return QuantizedWeights(weight=q.contiguous(), weight_scale=scale.contiguous(), bias=bias)

    @classmethod
    def from_parts(cls, parts: list[QuantizedWeights], quant: IntQuantization, dtype: torch.dtype) -> Fp8RowwiseLinear:
        """The linear of ``parts`` (a fused projection's, or one)."""
        return cls(parts, dtype)

    def __init__(self, parts: list[QuantizedWeights], dtype: torch.dtype):
        super().__init__()
        _register_per_channel(self, parts, dtype, torch.float8_e4m3fn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kilnlm.fp8_rowwise_linear(x, self.weight, self.weight_scale, self.bias)


class GatedMLP(nn.Module):
    """SwiGLU MLP: fused gate/up linear, ``silu(gate) * up``, down linear (Shazeer, 2020).

    x: ``[T, hidden]``; returns ``[T, hidden]``."""

    def __init__(self, gate_up: nn.Module, down: nn.Module):
        super().__init__()
        self.gate_up = gate_up
        self.down = down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


class PagedAttention(nn.Module):
    """Fused QKV projection, ``torch.ops.kilnlm.paged_attention`` (RoPE, KV write into the paged pool,
    causal GQA attention over each sequence's KV), output projection.

    x: ``[T, hidden]``; kv_cache: ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``
    mutated in place at layer ``layer_idx``, in the activation dtype or, once :meth:`set_kv_scale` gave
    this layer its calibrated scales, float8_e4m3fn / int8; other inputs as in :mod:`kilnlm.runtime.abi`."""

    def __init__(self, layer_idx: int, shape: AttentionShape, qkv: nn.Module, o_proj: nn.Module):
        super().__init__()
        self.layer_idx = layer_idx
        self.shape = shape
        self.qkv = qkv
        self.o_proj = o_proj
        self.scale = shape.head_dim**-0.5
        self.register_buffer("kv_scale", None)  # [2] float32 (k_scale, v_scale) for an 8-bit KV pool

    def set_kv_scale(self, kv_scale: torch.Tensor) -> None:
        """This layer's 8-bit KV-cache scales ``[2] float32`` = (k_scale, v_scale) (see
        :mod:`kilnlm.builder.kv_quant`); the pool is then float8_e4m3fn / int8."""
        if kv_scale.shape != (2,) or kv_scale.dtype != torch.float32:
            raise BuildError(f"kv_scale must be [2] float32 (k_scale, v_scale), got {tuple(kv_scale.shape)} "
                             f"{kv_scale.dtype}: report this as a kilnlm bug")
        self.kv_scale = kv_scale.contiguous()

    def forward(self, x, positions, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping, kv_cache):
        s = self.shape
        num_tokens = x.shape[0]
        q, k, v = self.qkv(x).split(
            [s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.num_kv_heads * s.head_dim], dim=-1
        )
        # A 16/32-bit pool keeps the 12-argument call (plugin version 1's form); an 8-bit pool adds kv_scale.
        extra = () if self.kv_scale is None else (self.kv_scale,)
        out = torch.ops.kilnlm.paged_attention(
            q.reshape(num_tokens, s.num_heads, s.head_dim),  # [T, H, D]
            k.reshape(num_tokens, s.num_kv_heads, s.head_dim),  # [T, Hkv, D]
            v.reshape(num_tokens, s.num_kv_heads, s.head_dim),
            kv_cache,
            self.layer_idx,
            positions,
            inv_freq,
            cu_seqlens_q,
            seq_lens_kv,
            block_tables,
            slot_mapping,
            self.scale,
            *extra,
        )
        return self.o_proj(out.reshape(num_tokens, s.num_heads * s.head_dim))


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict | None) -> torch.Tensor:
    """RoPE inverse frequencies ``[head_dim // 2] float32`` for the rotate-half layout.

    ``inv_freq[i] = rope_theta ** (-2i / head_dim)`` (Su et al., RoFormer, 2021), then by
    ``rope_scaling["rope_type"]``: ``default`` (none), ``linear`` (position interpolation, Chen et al.
    2023: divide by ``factor``), ``llama3`` (Meta's Llama 3.1 frequency-dependent scaling: wavelengths
    above ``original_max_position_embeddings / low_freq_factor`` are divided by ``factor``, those below
    ``... / high_freq_factor`` kept, a linear blend in between). Raises :class:`BuildError` for other
    types."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope_theta**exponent)
    rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low_freq_factor = float(rope_scaling["low_freq_factor"])
        high_freq_factor = float(rope_scaling["high_freq_factor"])
        original_len = float(rope_scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        long_wavelen = original_len / low_freq_factor  # above: fully scaled
        short_wavelen = original_len / high_freq_factor  # below: unchanged
        blend = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - blend) * inv_freq / factor + blend * inv_freq
        out = torch.where(wavelen > long_wavelen, inv_freq / factor, inv_freq)
        middle = (wavelen <= long_wavelen) & (wavelen >= short_wavelen)
        return torch.where(middle, blended, out)
    raise BuildError(
        f"rope_scaling type {rope_type!r} is not supported: kilnlm builds rope types default, linear and llama3"
    )
