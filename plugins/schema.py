"""The plugins' schemas, declared once (torch.library). Every implementation registers against these:
the plain-torch reference (``reference.py``, the numerical oracle), the CPU kernels (``csrc/``, loaded by
``kilnlm.plugins.load_cpu_kernels``), and later GPU / TensorRT / ONNX glue.

Ops (namespace ``kilnlm``):

``paged_attention(q, k, v, kv_cache!, layer_idx, positions, inv_freq, cu_seqlens_q, seq_lens_kv,
block_tables, slot_mapping, scale, kv_scale=None) -> out``
    q ``[T, num_heads, head_dim]``, k / v ``[T, num_kv_heads, head_dim]`` -- this step's projections,
    *before* RoPE, activation dtype (float32 or bfloat16); ``kv_cache`` the runtime's paged pool
    ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` (same dtype), mutated in
    place; ``layer_idx`` selects ``kv_cache[layer_idx]``; ``positions [T] int64``; ``inv_freq
    [head_dim // 2] float32`` RoPE inverse frequencies (rotate-half / GPT-NeoX layout, as Hugging Face
    Llama); ``cu_seqlens_q [B+1] int32``, ``seq_lens_kv [B] int32``, ``block_tables [B, max_blocks]
    int32``, ``slot_mapping [T] int64`` as in ``kilnlm.runtime.abi``; ``scale`` the softmax scale
    (usually ``head_dim ** -0.5``).
    Applies RoPE to q and k, writes k and v into the pool at ``slot_mapping``, then computes causal
    attention of each sequence's new query tokens over that sequence's KV ``[0, seq_lens_kv[b])`` (query
    row i of sequence b sits at KV position ``seq_lens_kv[b] - num_new_b + i``; GQA: query head h reads
    KV head ``h // (num_heads // num_kv_heads)``). Returns ``out [T, num_heads, head_dim]``, q's dtype.
    8-bit KV cache (version 2): ``kv_cache`` float8_e4m3fn or int8 with ``kv_scale [2] float32`` = (k_scale,
    v_scale), this layer's calibrated per-tensor scales; K/V are stored as ``quantize(x / scale)`` (FP8:
    saturate at ±448, round to nearest even; int8: round half to even, clamp to [-128, 127]) and read as
    ``stored * scale``. ``kv_scale`` None (the default, and version 1's 12-argument form): the pool is
    in q's dtype.

``gemm(x, weight, bias?) -> y``   (16/32-bit float linear layers and the LM head; TensorRT-LLM's GEMM plugin)
    x ``[T, in_features]`` float32 / bfloat16; ``weight [out_features, in_features]`` and ``bias
    [out_features]`` (or None) in x's dtype. ``y = x @ weight.T + bias``, accumulated in float32, returned
    in x's dtype (``torch.nn.functional.linear``'s result up to the summation order).

``fp8_linear(x, weight, weight_scale, input_scale, bias?) -> y``
    x ``[T, in_features]`` float32 / bfloat16; ``weight [out_features, in_features] float8_e4m3fn``;
    ``input_scale`` 0-dim float32 (per-tensor, static); ``weight_scale`` 0-dim float32 (per-tensor) or
    ``[out_features]`` float32 (version 2: one scale per output row, which lets each part of a fused QKV /
    gate-up GEMM keep its own per-tensor scale); ``bias [out_features]`` or None. Numerics of a Hopper FP8
    GEMM: ``x_q = fp8_e4m3(clamp(x / input_scale, -448, 448))`` (round to nearest even), ``y = (x_q @
    weight.T) * (input_scale * weight_scale[o]) + bias`` accumulated in float32, returned in x's dtype.

``fp8_rowwise_linear(x, weight, weight_scale, bias?) -> y``   (fp8_rowwise: TensorRT-LLM's FP8_PER_CHANNEL_PER_TOKEN)
    x ``[T, in_features]`` float32 / bfloat16; ``weight [out_features, in_features] float8_e4m3fn``;
    ``weight_scale [out_features]`` float32 (per output channel); ``bias [out_features]`` or None. The
    activations are quantized per token with a scale computed at run time, in float32: ``s_t = max_c
    |float(x[t, c])| / 448`` (1 where that amax is 0 -- an all-zero row -- or NaN), ``x_q[t] =
    fp8_e4m3(clamp(float(x[t]) / s_t, -448, 448))`` (round to nearest even, as fp8_linear's), ``y[t, o] =
    (x_q @ weight.T)[t, o] * (s_t * weight_scale[o]) + bias[o]``: float32 accumulation, one float32 product
    of the two scales, returned in x's dtype. A new op rather than an argument of fp8_linear: compiled
    engines call fp8_linear through a C shim whose signature is its schema's.

``int4_linear(x, weight, weight_scale, pre_quant_scale?, bias?, group_size, weight_zero_point?) -> y``   (W4A16: int4_awq, int4_wo)
    x ``[T, in_features]`` float32 / bfloat16; ``weight [out_features, in_features // 2] uint8``: two
    signed 4-bit values per byte, column ``2j`` in the low nibble and ``2j + 1`` in the high nibble, each
    a two's-complement integer in [-8, 7]; ``weight_scale [out_features, in_features // group_size]
    float32`` or (version 4) ``float16`` (one scale per group of ``group_size`` consecutive input columns;
    ``group_size == in_features`` is per-channel; float16 scales are widened exactly to float32 before
    use); ``pre_quant_scale [in_features] float32`` or None (AWQ's activation-aware per-input-channel
    scale, Lin et al. 2023, ``x * pre_quant_scale`` before the GEMM when the builder could not fold it
    into the preceding layer); ``bias [out_features]`` or None;
    ``weight_zero_point [out_features, in_features // group_size] int8`` in [-8, 7] or None (version 2:
    asymmetric groups, AWQ's zero points; None is all zeros). ``y = (x * pre_quant_scale) @ ((q -
    weight_zero_point[:, g(c)]) * weight_scale[:, g(c)]).T + bias`` (``q - zero`` exact, times the scale
    rounded once in float32), accumulated in float32, returned in x's dtype. Activations are not quantized
    (W4A16); the CPU kernel on AVX2 CPUs carries bfloat16 x as block floating point int16 per token and
    group (15 significant bits for the group's largest |x|, more than bfloat16's 8; csrc/int16_quantize.h).

``int8_linear(x, weight, weight_scale, bias?) -> y``   (W8A16 weight-only: int8_wo)
    x ``[T, in_features]`` float32 / bfloat16; ``weight [out_features, in_features] int8``;
    ``weight_scale [out_features] float32`` (per output channel); ``bias [out_features]`` or None.
    ``y = x @ (weight * weight_scale[:, None]).T + bias``, accumulated in float32, returned in x's dtype
    (bfloat16 x on AVX2 CPUs as block floating point int16 per 64 columns, as for int4_linear).

``int8_sq_linear(x, weight, weight_scale, input_scale, pre_quant_scale?, bias?, per_token=False) -> y``   (W8A8: int8_sq)
    SmoothQuant (Xiao et al. 2023) GEMM. x ``[T, in_features]`` float32 / bfloat16; ``weight
    [out_features, in_features] int8`` (smoothed, per-channel quantized); ``weight_scale [out_features]
    float32``; ``input_scale`` 0-dim float32 (per-tensor, calibrated); ``pre_quant_scale [in_features]
    float32`` or None (the smoothing factor ``1 / s`` when it was not folded into the preceding norm);
    ``bias`` or None. ``x_q = clamp(round_half_even((x * pre_quant_scale) / input_scale), -128, 127)``
    as int8, ``y = (x_q @ weight.T)`` accumulated exactly in int32, times ``input_scale *
    weight_scale[o]``, plus bias, returned in x's dtype. ``per_token`` (version 2, default False):
    dynamic per-token activation scales instead (TensorRT-LLM's ``--per_token``): row t uses
    ``s_t = max_c |x[t, c] * pre_quant_scale[c]| / 127`` (1 for an all-zero row) in place of
    ``input_scale``, which is then ignored; ``y[t, o] = acc * (s_t * weight_scale[o])``.

``all_reduce(x) -> y``   (tensor parallelism: TensorRT-LLM's AllReduce plugin, Megatron's row-parallel output)
    x any shape, float32 / bfloat16. ``y`` (a new tensor; x is untouched) is the element-wise sum of x over
    the ranks of the process's tensor-parallel group, identical on every rank; summed in x's dtype by the
    group's backend (gloo adds bfloat16 in bfloat16, one rounding per addition: with 2 ranks that is the
    float32 sum rounded once). The group is no argument: it is the one the runtime set once per process
    with ``kilnlm.plugins.set_tensor_parallel_group`` (a ``torch.distributed`` ProcessGroup; gloo on CPU,
    NCCL on GPU); a call with none set raises RuntimeError, never acts as identity. A call blocks until
    every rank has made it; the group's timeout bounds the wait, and a peer that has exited is an error.

``all_gather(x, tp_size) -> y``   (tensor parallelism: a vocabulary-parallel LM head's logits)
    x ``[rows, cols]`` float32 / bfloat16 (this rank's columns); ``tp_size`` the number of ranks the engine
    was compiled for, which must equal the size of the process's tensor-parallel group (it fixes y's shape
    at compile time, when no group exists). Returns ``y [rows, tp_size * cols]``: the ranks' x concatenated
    along the last dimension in group-rank order, ``y[:, r * cols:(r + 1) * cols]`` = rank r's x, bit for
    bit. Group, errors and blocking as for ``all_reduce``.
"""

from __future__ import annotations

import torch

# Bump a plugin's version whenever its schema, its numerics or the way compiled engines call it change;
# engines record the versions they were compiled against and the runtime refuses engines whose plugin
# versions it does not implement. The current versions are called through their C shims (csrc/c_shim.h):
# an older kilnlm, whose kernels library has no such symbols, refuses those engines by version instead of
# failing to load them.
PLUGIN_VERSIONS: dict[str, int] = {
    "paged_attention": 3,  # 2: optional trailing kv_scale (8-bit KV pools); 3: C shim
    "gemm": 2,  # 2: C shim
    "fp8_linear": 3,  # 2: weight_scale may be [out_features] (per-part scales of fused linears); 3: C shim
    "fp8_rowwise_linear": 1,
    "int4_linear": 4,  # 2: optional trailing weight_zero_point (asymmetric groups); 3: C shim; 4: float16 weight_scale
    "int8_linear": 2,  # 2: C shim
    "int8_sq_linear": 3,  # 2: optional trailing per_token (dynamic per-token activation scales); 3: C shim
    "all_reduce": 1,
    "all_gather": 1,
}

# Versions of a plugin that this kilnlm still runs (older engines whose calls the current kernels serve
# unchanged; engines from before the C shims call the ops through AOTInductor's proxy executor, which the
# dispatcher registrations still serve). paged_attention 1 -> 2 only added a trailing optional argument
# with a default; fp8_linear 1 -> 2 only widened weight_scale's accepted shapes.
PLUGIN_ACCEPTED_VERSIONS: dict[str, tuple[int, ...]] = {
    "paged_attention": (1, 2, 3),
    "gemm": (1, 2),
    "fp8_linear": (1, 2, 3),  # version 1's 0-dim weight_scale is still accepted
    "fp8_rowwise_linear": (1,),
    "int4_linear": (1, 2, 3, 4),  # version 1's calls (no weight_zero_point) and 3's float32 scales are unchanged
    "int8_linear": (1, 2),
    "int8_sq_linear": (1, 2, 3),  # version 1's calls (no per_token) are unchanged
    "all_reduce": (1,),
    "all_gather": (1,),
}

# The TensorRT target's plugins (kilnlm.plugins.tensorrt_plugins), one kernel each: paged_attention lowered
# into its KV write and its attention (kilnlm.builder.targets.tensorrt_lowering). A plan records them.
TENSORRT_PLUGIN_VERSIONS: dict[str, int] = {
    "paged_kv_write": 1,
    "paged_attention_core": 1,
}

_LIB = torch.library.Library("kilnlm", "DEF")
_LIB.define(
    "paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer_idx, Tensor positions, "
    "Tensor inv_freq, Tensor cu_seqlens_q, Tensor seq_lens_kv, Tensor block_tables, Tensor slot_mapping, "
    "float scale, Tensor? kv_scale=None) -> Tensor"
)
_LIB.define("gemm(Tensor x, Tensor weight, Tensor? bias) -> Tensor")
_LIB.define("fp8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor input_scale, Tensor? bias) -> Tensor")
_LIB.define("fp8_rowwise_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias) -> Tensor")
_LIB.define("int4_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? pre_quant_scale, Tensor? bias, "
            "int group_size, Tensor? weight_zero_point=None) -> Tensor")
_LIB.define("int8_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor? bias) -> Tensor")
_LIB.define("int8_sq_linear(Tensor x, Tensor weight, Tensor weight_scale, Tensor input_scale, "
            "Tensor? pre_quant_scale, Tensor? bias, bool per_token=False) -> Tensor")
_LIB.define("all_reduce(Tensor x) -> Tensor")
_LIB.define("all_gather(Tensor x, int tp_size) -> Tensor")


@torch.library.register_fake("kilnlm::paged_attention")
def _paged_attention_fake(q, k, v, kv_cache, layer_idx, positions, inv_freq, cu_seqlens_q, seq_lens_kv,
                          block_tables, slot_mapping, scale, kv_scale=None):
    return torch.empty_like(q)


@torch.library.register_fake("kilnlm::gemm")
def _gemm_fake(x, weight, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("kilnlm::fp8_linear")
def _fp8_linear_fake(x, weight, weight_scale, input_scale, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("kilnlm::fp8_rowwise_linear")
def _fp8_rowwise_linear_fake(x, weight, weight_scale, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("kilnlm::int4_linear")
def _int4_linear_fake(x, weight, weight_scale, pre_quant_scale, bias, group_size, weight_zero_point=None):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("kilnlm::int8_linear")
def _int8_linear_fake(x, weight, weight_scale, bias):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("kilnlm::int8_sq_linear")
def _int8_sq_linear_fake(x, weight, weight_scale, input_scale, pre_quant_scale, bias, per_token=False):
    return x.new_empty((x.shape[0], weight.shape[0]))


@torch.library.register_fake("kilnlm::all_reduce")
def _all_reduce_fake(x):
    return torch.empty_like(x)


@torch.library.register_fake("kilnlm::all_gather")
def _all_gather_fake(x, tp_size):
    return x.new_empty((x.shape[0], tp_size * x.shape[1]))


# C types of a C shim's parameters by schema type (torchgen's convention for torch's own shims).
_C_SHIM_TYPES = {"Tensor": "AtenTensorHandle", "Optional[Tensor]": "AtenTensorHandle*", "int": "int64_t",
                 "float": "double", "bool": "int32_t"}


def c_shim_declaration(name: str) -> str:
    """The C declaration of op ``kilnlm::<name>``'s C shim, derived from its schema: ``AOTITorchError
    aoti_torch_cpu_<name>(...)`` with Tensor -> ``AtenTensorHandle``, Tensor? -> ``AtenTensorHandle*``
    (nullptr for None), int -> ``int64_t``, float -> ``double``, bool -> ``int32_t``, then ``AtenTensorHandle*
    ret0`` for the returned tensor. AOTInductor declares it in a compiled engine
    (``aot_inductor.custom_ops_to_c_shims``) and calls it directly instead of through its proxy executor;
    the kernels library defines it (csrc/c_shim.h). Raises ValueError for a schema type without a C mapping."""
    schema = getattr(torch.ops.kilnlm, name).default._schema
    params = []
    for arg in schema.arguments:
        c_type = _C_SHIM_TYPES.get(str(arg.type))
        if c_type is None:
            raise ValueError(f"kilnlm::{name}: no C shim type for argument {arg.name}: {arg.type}")
        params.append(f"{c_type} {arg.name}")
    if [str(r.type) for r in schema.returns] != ["Tensor"]:
        raise ValueError(f"kilnlm::{name}: a C shim returns one tensor, the schema returns {schema.returns}")
    return f"AOTITorchError aoti_torch_cpu_{name}({', '.join(params + ['AtenTensorHandle* ret0'])})"
