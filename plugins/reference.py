"""Plain-torch reference implementations of the kilnlm plugins: the numerical oracle for tests.

Clarity over speed: everything is computed in float32 with explicit per-sequence loops. The arguments and
their meaning are exactly those of the op schemas in :mod:`kilnlm.plugins.schema`; the optimized kernels
(``csrc/``) must agree with these functions within the tolerances their tests state.

Importing this module only defines functions; :func:`register_references` makes them the ``kilnlm`` ops'
kernels where a caller wants that (tests, a check run without the C++ or GPU kernels).
"""

from __future__ import annotations

import torch
import torch.distributed

from kilnlm.plugins.collectives import require_tensor_parallel_group

FP8_E4M3_MAX = 448.0


def rope_tables_reference(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's cos / sin tables: ``freqs = positions * inv_freq`` in float32, returned as ``(cos(freqs),
    sin(freqs))``, each ``[T, head_dim // 2] float32`` (positions ``[T]`` int, inv_freq ``[head_dim // 2]``)."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, d/2]
    return freqs.cos(), freqs.sin()


def rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding from the tables of :func:`rope_tables_reference`, rotate-half (GPT-NeoX)
    layout exactly as Hugging Face Llama: ``out = x * cat(cos, cos) + rotate_half(x) * cat(sin, sin)`` with
    ``rotate_half(x) = cat(-x[..., d/2:], x[..., :d/2])`` (Su et al., RoFormer, 2021; Hugging Face
    ``apply_rotary_pos_emb``). x ``[T, num_heads, head_dim]`` any float dtype; cos, sin ``[T, head_dim // 2]``
    float32. Returns ``[T, num_heads, head_dim]`` float32."""
    x = x.float()
    cos = torch.cat((cos, cos), dim=-1)[:, None, :]  # [T, 1, d]
    sin = torch.cat((sin, sin), dim=-1)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def apply_rope_reference(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x ``[T, num_heads, head_dim]`` (any float dtype) at ``positions`` ``[T]``
    with ``inv_freq`` ``[head_dim // 2]`` float32: :func:`rotate_reference` with the tables of
    :func:`rope_tables_reference`. Returns ``[T, num_heads, head_dim]`` float32."""
    return rotate_reference(x, *rope_tables_reference(positions, inv_freq))


def paged_kv_write_reference(k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             slot_mapping: torch.Tensor, layer_pool: torch.Tensor,
                             kv_scale: torch.Tensor | None = None) -> None:
    """The KV-write half of ``kilnlm::paged_attention`` (the TensorRT target's ``paged_kv_write`` plugin):
    rotate k with the RoPE tables and write it and v into one layer's pool at ``slot_mapping``.

    k, v ``[T, num_kv_heads, head_dim]`` float32 / bfloat16 (before RoPE); cos, sin ``[T, head_dim // 2]``
    float32 (:func:`rope_tables_reference`); slot_mapping ``[T]`` int64 (``slot = block * tokens_per_block +
    offset``); layer_pool ``[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` (K, V), **mutated in
    place**: in the activation dtype, or float8_e4m3fn / int8 with ``kv_scale [2] float32`` (stored as
    :func:`quantize_kv_reference`)."""
    k_rot = rotate_reference(k, cos, sin)  # [T, Hkv, D] f32
    slots = slot_mapping.to(torch.int64)
    tokens_per_block = layer_pool.shape[2]
    blocks, offsets = slots // tokens_per_block, slots % tokens_per_block
    if kv_scale is None:
        layer_pool[0, blocks, offsets] = k_rot.to(layer_pool.dtype)
        layer_pool[1, blocks, offsets] = v.to(layer_pool.dtype)
    else:
        layer_pool[0, blocks, offsets] = quantize_kv_reference(k_rot, kv_scale[0].float(), layer_pool.dtype)
        layer_pool[1, blocks, offsets] = quantize_kv_reference(v, kv_scale[1].float(), layer_pool.dtype)


def paged_attention_core_reference(q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer_pool: torch.Tensor,
                                   block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_lens_kv: torch.Tensor,
                                   scale: float, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The attention half of ``kilnlm::paged_attention`` (the TensorRT target's ``paged_attention_core``
    plugin): causal GQA attention of the rotated queries over one layer's pool, after the KV write.

    q ``[T, num_heads, head_dim]`` float32 / bfloat16 (before RoPE); cos, sin ``[T, head_dim // 2]`` float32;
    layer_pool ``[2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` (read only; 8-bit pools with
    ``kv_scale [2] float32``, read back as ``stored.float() * scale``); block_tables ``[B, max_blocks]``
    int32; cu_seqlens_q ``[B+1]`` int32; seq_lens_kv ``[B]`` int32; ``scale`` the softmax scale. Returns
    ``[T, num_heads, head_dim]`` in q's dtype.

    Sequence b's new query rows are ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (n_b of them); query row i sits
    at KV position ``seq_lens_kv[b] - n_b + i`` and attends to KV positions ``0..that`` (causal). KV
    position p of sequence b lives in physical block ``block_tables[b, p // tokens_per_block]`` at offset
    ``p % tokens_per_block``."""
    num_tokens, num_heads, head_dim = q.shape
    group = num_heads // layer_pool.shape[3]
    tokens_per_block = layer_pool.shape[2]
    k_read_scale, v_read_scale = (1.0, 1.0) if kv_scale is None else (kv_scale[0].float(), kv_scale[1].float())
    q_rot = rotate_reference(q, cos, sin)  # [T, H, D] f32
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=torch.float32)
    num_seqs = seq_lens_kv.shape[0]
    for b in range(num_seqs):
        start, end = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        num_new = end - start
        if num_new == 0:
            continue
        kv_len = int(seq_lens_kv[b])
        pos = torch.arange(kv_len)
        phys = block_tables[b].to(torch.int64)[pos // tokens_per_block]
        keys = layer_pool[0, phys, pos % tokens_per_block].float() * k_read_scale  # [L, Hkv, D]
        values = layer_pool[1, phys, pos % tokens_per_block].float() * v_read_scale
        keys = keys.repeat_interleave(group, dim=1)  # [L, H, D]
        values = values.repeat_interleave(group, dim=1)
        qs = q_rot[start:end]  # [n, H, D]
        scores = torch.einsum("nhd,lhd->hnl", qs, keys) * scale  # [H, n, L]
        q_pos = kv_len - num_new + torch.arange(num_new)
        mask = pos[None, :] > q_pos[:, None]  # [n, L] True = masked out
        scores = scores.masked_fill(mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hnl,lhd->nhd", probs, values)
    return out.to(q.dtype)


def paged_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    layer_idx: int,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seq_lens_kv: torch.Tensor,
    block_tables: torch.Tensor,
    slot_mapping: torch.Tensor,
    scale: float,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``kilnlm::paged_attention`` (see :mod:`kilnlm.plugins.schema` for the contract): the KV
    write (:func:`paged_kv_write_reference`) then the attention (:func:`paged_attention_core_reference`)
    over layer ``layer_idx`` of the pool, with the RoPE tables of :func:`rope_tables_reference`.

    q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]`` (before RoPE), float32 or
    bfloat16; kv_cache: ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``, same
    dtype, **mutated in place** (RoPE'd k and v written at ``slot_mapping`` of layer ``layer_idx``);
    positions ``[T]`` int64; inv_freq ``[head_dim // 2]`` float32; cu_seqlens_q ``[B+1]`` int32;
    seq_lens_kv ``[B]`` int32; block_tables ``[B, max_blocks]`` int32; slot_mapping ``[T]`` int64.
    Returns ``[T, num_heads, head_dim]`` in q's dtype. The attention reads K/V back from the pool (after
    the write), so the new tokens' keys are seen in the pool's dtype, as the kernels see them.

    8-bit pool: kv_cache float8_e4m3fn or int8 with ``kv_scale [2] float32`` (k_scale, v_scale); K/V are
    written as :func:`quantize_kv_reference` and read back as ``stored.float() * scale``.
    """
    cos, sin = rope_tables_reference(positions, inv_freq)
    layer = kv_cache[layer_idx]  # [2, num_blocks, tpb, Hkv, D], a view
    paged_kv_write_reference(k, v, cos, sin, slot_mapping, layer, kv_scale)
    return paged_attention_core_reference(q, cos, sin, layer, block_tables, cu_seqlens_q, seq_lens_kv, scale, kv_scale)


# The largest code magnitude of each 8-bit KV-cache dtype: a scale of amax / KV_CACHE_QMAX[dtype] stores
# values up to amax without saturating.
KV_CACHE_QMAX = {torch.float8_e4m3fn: FP8_E4M3_MAX, torch.int8: 127.0}


def quantize_kv_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One 8-bit KV-cache tensor as stored: x (any shape, float32 / bfloat16) divided by the per-tensor
    ``scale`` (0-dim float32) in float32, then ``dtype`` float8_e4m3fn (saturate at ±448, round to nearest
    even) or int8 (round half to even, clamp to [-128, 127]). Read back as ``stored.float() * scale``."""
    y = x.float() / scale.float()
    if dtype == torch.float8_e4m3fn:
        return y.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    if dtype == torch.int8:
        return y.round().clamp(-128, 127).to(torch.int8)
    raise ValueError(f"8-bit KV cache dtype must be float8_e4m3fn or int8, got {dtype}")


def quantize_kv_pool_reference(pool: torch.Tensor, kv_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A whole paged KV pool ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``
    (float32 / bfloat16) as an 8-bit KV cache of ``dtype`` stores it: the K half (``pool[:, 0]``) by
    ``kv_scale[0]``, the V half by ``kv_scale[1]`` (``kv_scale``: [2] float32), each
    :func:`quantize_kv_reference`. Raises ValueError for a ``dtype`` other than float8_e4m3fn / int8."""
    return torch.stack([quantize_kv_reference(pool[:, i], kv_scale[i], dtype) for i in (0, 1)], dim=1)


def fitting_kv_scale(k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[2]`` float32 (k_scale, v_scale) that store the new keys ``k`` (before RoPE) and values ``v`` (any
    shape) in ``dtype``'s codes without saturating: RoPE keeps a key's norm per pair of dimensions, so
    max |k| * sqrt(2) bounds the rotated keys. For test and benchmark data; engines calibrate their scales
    (:mod:`kilnlm.builder.kv_quant`)."""
    qmax = KV_CACHE_QMAX[dtype]
    return torch.tensor([float(k.abs().max()) * 2**0.5 / qmax, float(v.abs().max()) / qmax])


def gemm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Reference of ``kilnlm::gemm``: ``x @ weight.T + bias`` in float32, returned in x's dtype.

    x: ``[T, in_features]`` float32 / bfloat16; weight ``[out_features, in_features]`` and bias
    ``[out_features]`` (or None) in x's dtype. Returns ``[T, out_features]``.
    """
    y = x.float() @ weight.float().T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_fp8_reference(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """Per-tensor activation quantization: ``fp8_e4m3(clamp(x / input_scale, -448, 448))``.

    x: any shape, float32 / bfloat16; input_scale: 0-dim float32 (or broadcastable to x, e.g. ``[T, 1]``
    per token). The division is done in float32 (x is upcast first), rounding to nearest even, saturating
    at ±448. Returns float8_e4m3fn, x's shape.
    """
    return (x.float() / input_scale.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    """Reference of ``kilnlm::fp8_linear``.

    x: ``[T, in_features]`` float32 / bfloat16; weight: ``[out_features, in_features]`` float8_e4m3fn;
    input_scale: 0-dim float32; weight_scale: 0-dim or ``[out_features]`` float32 (per output row);
    bias: ``[out_features]`` (any float dtype) or None. Returns ``[T, out_features]`` in x's dtype:
    ``y = (quantize(x) @ weight.T) * (input_scale * weight_scale[o]) + bias``, accumulated in float32.
    """
    x_q = quantize_fp8_reference(x, input_scale)
    y = (x_q.float() @ weight.float().T) * (input_scale.float() * weight_scale.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def fp8_token_scales_reference(x: torch.Tensor) -> torch.Tensor:
    """Per-token FP8 activation scales of ``kilnlm::fp8_rowwise_linear``: ``s_t = max_c |float(x[t, c])| / 448``
    in float32, 1 where that amax is 0 (an all-zero row) or NaN. x: ``[T, in_features]`` float32 / bfloat16.
    Returns ``[T, 1]`` float32."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1, keepdim=True) if xf.shape[-1] else xf.new_zeros(xf.shape[0], 1)
    return torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))


def fp8_rowwise_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Reference of ``kilnlm::fp8_rowwise_linear`` (TensorRT-LLM's FP8 rowwise, FP8_PER_CHANNEL_PER_TOKEN).

    x: ``[T, in_features]`` float32 / bfloat16; weight: ``[out_features, in_features]`` float8_e4m3fn;
    weight_scale: ``[out_features]`` float32; bias ``[out_features]`` or None. Each token t is quantized
    with its own scale ``s_t`` (:func:`fp8_token_scales_reference`) as :func:`quantize_fp8_reference` does
    with a per-tensor one; ``y[t, o] = (x_q @ weight.T)[t, o] * (s_t * weight_scale[o]) + bias[o]``,
    accumulated in float32, returned in x's dtype.
    """
    token_scale = fp8_token_scales_reference(x)  # [T, 1]
    x_q = quantize_fp8_reference(x, token_scale)
    y = (x_q.float() @ weight.float().T) * (token_scale * weight_scale.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


INT4_MIN, INT4_MAX = -8, 7
INT8_MIN, INT8_MAX = -128, 127


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Pack signed 4-bit values two per byte, the layout of ``kilnlm::int4_linear``.

    q: ``[rows, cols]`` integer tensor with values in [-8, 7], cols even. Returns ``[rows, cols // 2]``
    uint8: column ``2j`` in the low nibble, ``2j + 1`` in the high nibble (two's complement).
    Raises ValueError for an odd column count or out-of-range values.
    """
    if q.shape[-1] % 2:
        raise ValueError(f"pack_int4 needs an even number of columns, got {q.shape[-1]}")
    if q.numel() and (int(q.min()) < INT4_MIN or int(q.max()) > INT4_MAX):
        raise ValueError("pack_int4 values must lie in [-8, 7]")
    nibbles = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``[rows, cols // 2] uint8`` -> ``[rows, cols] int8`` in [-8, 7]."""
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    q = torch.stack((low, high), dim=-1).flatten(-2)
    return torch.where(q >= 8, q - 16, q)


def int4_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    pre_quant_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    group_size: int,
    weight_zero_point: torch.Tensor | None = None,
) -> torch.Tensor:
    """Reference of ``kilnlm::int4_linear`` (W4A16, group-wise scales; see the schema).

    x: ``[T, in_features]`` float32 / bfloat16; weight: ``[out_features, in_features // 2]`` uint8 packed
    int4; weight_scale: ``[out_features, in_features // group_size]`` float32; pre_quant_scale:
    ``[in_features]`` float32 or None; bias ``[out_features]`` or None; weight_zero_point
    ``[out_features, in_features // group_size]`` int8 or None (zeros). Returns ``[T, out_features]`` in
    x's dtype, computed in float32 from the dequantized weight ``(q - zero) * scale``.
    """
    q = unpack_int4(weight).float()
    if weight_zero_point is not None:
        q = q - weight_zero_point.float().repeat_interleave(group_size, dim=1)
    w = q * weight_scale.float().repeat_interleave(group_size, dim=1)
    xf = x.float() if pre_quant_scale is None else x.float() * pre_quant_scale.float()
    y = xf @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def int8_linear_reference(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Reference of ``kilnlm::int8_linear`` (W8A16 weight-only, per-channel scales).

    x: ``[T, in_features]`` float32 / bfloat16; weight: ``[out_features, in_features]`` int8;
    weight_scale: ``[out_features]`` float32; bias or None. Returns ``[T, out_features]`` in x's dtype.
    """
    y = x.float() @ (weight.float() * weight_scale.float()[:, None]).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_int8_reference(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """INT8 activation quantization: ``clamp(round_half_even(x / input_scale), -128, 127)``, computed in
    float32. x: any shape, float32 / bfloat16; input_scale: 0-dim float32 (per tensor) or broadcastable to
    x (e.g. ``[T, 1]`` per token). Returns int8."""
    return torch.round(x.float() / input_scale.float()).clamp(INT8_MIN, INT8_MAX).to(torch.int8)


def int8_sq_linear_reference(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    input_scale: torch.Tensor,
    pre_quant_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    per_token: bool = False,
) -> torch.Tensor:
    """Reference of ``kilnlm::int8_sq_linear`` (SmoothQuant W8A8, Xiao et al. 2023).

    x: ``[T, in_features]`` float32 / bfloat16; weight ``[out_features, in_features]`` int8; weight_scale
    ``[out_features]`` float32; input_scale 0-dim float32; pre_quant_scale ``[in_features]`` float32 or
    None; bias or None. ``per_token``: each row's own scale ``amax_t / 127`` (float32; 1 for an all-zero
    row) replaces input_scale. The int8 x int8 products are summed exactly (float64 holds every int32
    sum here). Returns ``[T, out_features]`` in x's dtype.
    """
    xf = x.float() if pre_quant_scale is None else x.float() * pre_quant_scale.float()
    if per_token:
        amax = xf.abs().amax(dim=-1, keepdim=True) if xf.shape[-1] else xf.new_zeros(xf.shape[0], 1)
        scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))  # [T, 1]
    else:
        scale = input_scale.float()
    x_q = quantize_int8_reference(xf, scale)
    acc = x_q.double() @ weight.double().T  # exact integer sums
    y = acc.float() * (scale * weight_scale.float())
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def all_reduce_reference(x: torch.Tensor) -> torch.Tensor:
    """Reference of ``kilnlm::all_reduce``: ``torch.distributed.all_reduce`` (SUM) of a copy of x over the
    process's tensor-parallel group (:func:`kilnlm.plugins.set_tensor_parallel_group`). x: any shape, float32 /
    bfloat16, on the group backend's device. Returns the sum in x's dtype (summed by the backend in that
    dtype, as the kernels do: the one reference not computed in float32). Raises RuntimeError when no group
    is set, and the backend's error when a peer fails or the group's timeout passes."""
    group = require_tensor_parallel_group("all_reduce")
    out = x.clone(memory_format=torch.contiguous_format)
    torch.distributed.all_reduce(out, op=torch.distributed.ReduceOp.SUM, group=group)
    return out


def all_gather_reference(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Reference of ``kilnlm::all_gather``: x ``[rows, cols]`` float32 / bfloat16 of every rank of the
    process's tensor-parallel group, which must have ``tp_size`` ranks, concatenated along the last dim in
    group-rank order: returns ``[rows, tp_size * cols]`` in x's dtype. Raises RuntimeError when no group is
    set or its size is not ``tp_size``."""
    group = require_tensor_parallel_group("all_gather")
    if group.size() != tp_size:
        raise RuntimeError(f"kilnlm::all_gather: the engine was compiled for tp_size={tp_size} but the "
                           f"tensor-parallel group has {group.size()} ranks: run it with a group of {tp_size} ranks")
    parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(tp_size)]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=-1)


# The ops (``kilnlm::{name}``) whose references are :func:`{name}_reference`.
REFERENCE_OPS = ("paged_attention", "gemm", "fp8_linear", "fp8_rowwise_linear", "int4_linear", "int8_linear",
                 "int8_sq_linear", "all_reduce", "all_gather")


def register_references(dispatch_key: str, ops: tuple[str, ...] = REFERENCE_OPS) -> torch.library.Library | None:
    """Register each of ``ops``' reference as ``kilnlm::{op}``'s kernel for ``dispatch_key`` ("CPU", "CUDA")
    where no kernel is registered there yet (loaded C++ or GPU kernels keep theirs). Returns the library
    handle, which must be kept alive as long as the registrations are used, or None when nothing was
    registered."""
    import kilnlm.plugins.schema  # noqa: F401  (declares the ops)

    library = None
    for op in ops:
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"kilnlm::{op}", dispatch_key):
            library = library or torch.library.Library("kilnlm", "IMPL")
            library.impl(op, globals()[f"{op}_reference"], dispatch_key)
    return library
