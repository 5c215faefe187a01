"""GPU kernels of ``kilnlm::paged_attention`` in the Triton language (OpenAI Triton), for CUDA tensors.

One op call is three steps on the tensors' stream, no host synchronisation:

1. RoPE tables: ``freqs = positions * inv_freq``, ``cos(freqs)``, ``sin(freqs)`` ``[T, head_dim // 2] float32``
   with torch on q's device (the reference's own expressions, so the rotation uses the same cos / sin
   values; Triton's ``tl.cos`` is another implementation and the interpreter's is numpy's);
2. ``_rope_kv_write_kernel``, one program per new token: rotates k, and writes k and v into the paged pool
   at ``slot_mapping`` (8-bit pools: quantized with the layer's ``kv_scale``);
3. ``_paged_attention_kernel``: causal attention of every sequence's new query tokens over its KV blocks,
   read back from the pool through ``block_tables`` (FlashAttention-2's online softmax, Dao 2023, over a
   paged KV cache as in vLLM, Kwon et al. 2023).

The attention grid packs context (prefill) and generation (decode) sequences into one launch. Axis 0 walks
query tiles: sequence b owns the tiles ``[cu_seqlens_q[b] // BLOCK_Q + b, cu_seqlens_q[b+1] // BLOCK_Q + b + 1)``
(at least ``ceil(n_b / BLOCK_Q)`` of them; spares exit at once), so the grid ``T // BLOCK_Q + B`` is known
without reading the device; a program finds its sequence by binary search over those starts. Axis 1 is the
KV head. The GQA group is folded into the tile's rows (all query heads of one KV head read each KV tile
once)::

    tile rows (BLOCK_M, GROUP = num_heads // num_kv_heads = 3, BLOCK_Q = BLOCK_M // GROUP tokens)
    row r:   0    1    2    3    4    5   ...  3*BLOCK_Q-1  | spare rows up to BLOCK_M
    token:   t0   t0   t0   t1   t1   t1  ...  t(BLOCK_Q-1) |
    q head:  3g   3g+1 3g+2 3g   3g+1 3g+2 ...              |   (g = this program's KV head)

Query row i of sequence b sits at KV position ``seq_lens_kv[b] - n_b + i`` and sees positions ``0..that``;
KV position p lives at ``block_tables[b, p // tokens_per_block]``, offset ``p % tokens_per_block``.

Numerics against :func:`kilnlm.plugins.reference.paged_attention_reference`:

- The pool write is bit-exact given the same cos / sin: the rotation is ``x * cos + rotate_half(x) * sin``
  in float32 without FMA contraction (``enable_fp_fusion=False``), ``x / scale`` is an IEEE division
  (``div_rn``) and every narrowing is round-to-nearest-even done in integer arithmetic
  (:func:`_bf16_bits`, :func:`_fp8_e4m3_code`, :func:`_int8_code`), so Triton's interpreter (whose
  float32 -> bfloat16 cast truncates) and the GPU store the same bits. FP8 is handled as raw bytes, encoded
  and decoded in software: Triton has no float8e4nv type on sm_80, and one code path serves sm_80 to sm_90.
- Attention runs in float32 (scores, online softmax, accumulator); 8-bit scales are folded in
  (``scores = (q * k_scale) . stored_k``, ``out = (p . stored_v) * v_scale``). Float32 activations use
  IEEE float32 dots. Bfloat16 activations use tensor-core dots with float32 accumulation
  (:func:`attention_dot_dtype`): bfloat16 operands over a bfloat16 pool, float16 over an 8-bit pool (every
  FP8 / int8 code is exact in float16 and is decoded to it by integer operations alone, no conversion
  instructions). The rotated q and the probabilities are rounded to that dtype for the two products; K
  and V are exact. Under ``TRITON_INTERPRET=1`` (CPU tensors) bfloat16 dots take float32 operands instead,
  because Triton 3.9's interpreter multiplies bfloat16 operands as their raw 16-bit integer patterns.
- Index tensors are not range-checked (that would synchronise with the device): ``slot_mapping``,
  ``block_tables`` and ``seq_lens_kv`` must address the pool, as the runtime guarantees.

Triton is optional (``pip install 'kilnlm[gpu]'``): without it this module imports, and calling a kernel
raises ImportError. It is imported with this module, not later, because the kernels must be module-level
functions with ``triton.language`` in their globals (Triton's interpreter requires it).
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass

import torch

import kilnlm.plugins.schema  # noqa: F401  (declares kilnlm::paged_attention, which this registers against)

try:
    import triton
    import triton.language as tl
except ImportError:  # optional dependency: the launchers raise with the install command
    triton = None
    tl = None

# Pool formats by pool dtype: the kernels' KV_FORMAT constexpr (names as kilnlm.runtime.abi.KV_CACHE_DTYPES).
KV_FORMATS = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float8_e4m3fn: "fp8", torch.int8: "int8"}
KV_FORMATS_BY_NAME = {name: dtype for dtype, name in KV_FORMATS.items()}
# How each format's pool is viewed by the write kernel (bfloat16 stores integer-rounded bits, FP8 raw bytes)
# and by the attention kernel (FP8 decoded in software from raw bytes).
_WRITE_VIEW = {"float32": torch.float32, "bfloat16": torch.int16, "fp8": torch.uint8, "int8": torch.int8}
_READ_VIEW = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.uint8, "int8": torch.int8}


def _jit(fn):
    """``triton.jit`` where triton is installed; otherwise the plain function (never launched)."""
    return fn if triton is None else triton.jit(fn)


# ---------------------------------------------------------------------------------------------------------
# Element conversions: exact, in integer arithmetic (encoders round to nearest even)
# ---------------------------------------------------------------------------------------------------------

@_jit
def _bf16_bits(x):
    """float32 -> bfloat16 bit pattern (int16), round to nearest even; NaN -> 0x7FC0."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@_jit
def _fp8_e4m3_code(y):
    """float32 -> float8_e4m3fn byte (uint8): saturate at ±448, round to nearest even; NaN -> 0x7F.

    Normal codes (|y| >= 2^-6): the float32 mantissa rounded to 3 bits, a carry bumping the exponent, the
    exponent rebiased 127 -> 7. Subnormal codes (|y| < 2^-6) are multiples of 2^-9: ``|y| * 512`` (exact)
    rounded to an integer 0..8 by adding and subtracting 2^23 (8 being the smallest normal code).
    """
    is_nan = y != y
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    bits = y.to(tl.uint32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    rounded = mag + 0x7FFFF + ((mag >> 20) & 1)
    normal = (rounded >> 20) - (120 << 3)  # ((exp - 127 + 7) << 3) | mantissa
    scaled = mag.to(tl.float32, bitcast=True) * 512.0
    subnormal = ((scaled + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(mag >= 0x3C800000, normal, subnormal) | sign  # 0x3C800000: 2^-6 as float32
    code = tl.where(is_nan, 0x7F, code)
    return code.to(tl.uint8)


@_jit
def _int8_code(y):
    """float32 -> int8: round half to even, clamp to [-128, 127] (adding and subtracting 1.5 * 2^23 rounds
    any |y| <= 2^22 to an integer, half to even); NaN -> 0."""
    y = tl.where(y != y, 0.0, y)
    y = tl.minimum(tl.maximum(y, -128.0), 127.0)
    return ((y + 12582912.0) - 12582912.0).to(tl.int8)


@_jit
def _fp8_e4m3_decode(code):
    """float8_e4m3fn byte (uint8) -> float16 holding the FP8 value / 256, exactly, by integer operations
    only: the byte's sign, exponent and mantissa moved into float16's fields (exponent bias 15 instead of
    7, hence the 2^-8; subnormals included); callers fold the 256 into their scale. NaN codes (0x7F, 0xFF)
    -> NaN."""
    c = code.to(tl.uint16)
    half_bits = ((c & 0x80) << 8) | ((c & 0x7F) << 7)
    half_bits = tl.where((c & 0x7F) == 0x7F, 0x7E00, half_bits)
    return half_bits.to(tl.uint16).to(tl.float16, bitcast=True)


@_jit
def _int8_decode_f16(code):
    """int8 -> float16, exactly, without a conversion instruction: the bits 0x6400 | (code + 128) are the
    float16 1024 + (code + 128); subtracting 1152 (exact) leaves code."""
    biased = (code.to(tl.uint8, bitcast=True).to(tl.uint16) ^ 0x80) | 0x6400
    return biased.to(tl.uint16).to(tl.float16, bitcast=True) - 1152.0


@_jit
def _to_dot(x, DOT_DTYPE: tl.constexpr):
    """x (float32) as a dot operand of DOT_DTYPE ("float32" | "bfloat16" | "float16")."""
    if DOT_DTYPE == "bfloat16":
        x = x.to(tl.bfloat16)
    elif DOT_DTYPE == "float16":
        x = x.to(tl.float16)
    return x


@_jit
def _kv_tile_for_dot(raw, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """A loaded pool tile as a dot operand, exactly: FP8 as value / 256 and int8 as the integer (float16
    operands for bfloat16 activations, float32 for float32 ones); float pools as stored (bfloat16) or in
    float32."""
    if KV_FORMAT == "fp8":
        x = _fp8_e4m3_decode(raw)
        if DOT_DTYPE != "float16":
            x = x.to(tl.float32)
    elif KV_FORMAT == "int8" and DOT_DTYPE == "float16":
        x = _int8_decode_f16(raw)
    elif KV_FORMAT == "bfloat16" and DOT_DTYPE == "bfloat16":
        x = raw
    else:
        x = raw.to(tl.float32)
    return x


@_jit
def _kv_scale_factor(kv_scale_ptr, index, KV_FORMAT: tl.constexpr):
    """What a decoded tile is multiplied by: kv_scale[index] (times 256 for FP8, see _fp8_e4m3_decode),
    1 for a float pool."""
    if KV_FORMAT == "fp8":
        factor = tl.load(kv_scale_ptr + index) * 256.0
    elif KV_FORMAT == "int8":
        factor = tl.load(kv_scale_ptr + index)
    else:
        factor = 1.0
    return factor


# ---------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------

@_jit
def _rope_kv_write_kernel(
    k_ptr, v_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, k_cache_ptr, v_cache_ptr, kv_scale_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_co, stride_ch, stride_cd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """One new token t: ``k_cache[slot] = encode(rope(k[t]))``, ``v_cache[slot] = encode(v[t])``.

    k, v ``[T, NUM_KV_HEADS, HEAD_DIM]`` float32 / bfloat16; cos, sin ``[T, HEAD_DIM // 2]`` float32;
    slot_mapping ``[T]`` int64; k_cache, v_cache this layer's ``[num_blocks, TOKENS_PER_BLOCK, NUM_KV_HEADS,
    HEAD_DIM]`` in the write view of KV_FORMAT (float32, bfloat16 bits as int16, FP8 bytes as uint8, int8);
    kv_scale ``[2]`` float32 for 8-bit pools. Launch with ``enable_fp_fusion=False`` (bit-exact rotation).
    """
    t = tl.program_id(0)
    HALF: tl.constexpr = HEAD_DIM // 2
    h = tl.arange(0, HEADS_PAD)[:, None]  # [Hp, 1]
    d = tl.arange(0, DIM_PAD)[None, :]  # [1, Dp]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    first_half = d < HALF
    partner = tl.where(first_half, d + HALF, d - HALF)  # rotate_half's source column
    freq = tl.where(first_half, d, d - HALF)

    k_row = k_ptr + t * stride_kt + h * stride_kh
    k = tl.load(k_row + d * stride_kd, mask=mask, other=0.0).to(tl.float32)  # [Hp, Dp]
    k_partner = tl.load(k_row + partner * stride_kd, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * HALF + freq, mask=d < HEAD_DIM, other=0.0)  # [1, Dp]
    sin = tl.load(sin_ptr + t * HALF + freq, mask=d < HEAD_DIM, other=0.0)
    k_rot = k * cos + tl.where(first_half, -k_partner, k_partner) * sin
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=mask, other=0.0).to(tl.float32)

    slot = tl.load(slot_mapping_ptr + t)  # int64
    dst = (slot // TOKENS_PER_BLOCK) * stride_cb + (slot % TOKENS_PER_BLOCK) * stride_co + h * stride_ch + d * stride_cd
    if KV_FORMAT == "float32":
        tl.store(k_cache_ptr + dst, k_rot, mask=mask)
        tl.store(v_cache_ptr + dst, v, mask=mask)
    elif KV_FORMAT == "bfloat16":
        tl.store(k_cache_ptr + dst, _bf16_bits(k_rot), mask=mask)
        tl.store(v_cache_ptr + dst, _bf16_bits(v), mask=mask)
    elif KV_FORMAT == "fp8":
        k_scale = tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
        tl.store(k_cache_ptr + dst, _fp8_e4m3_code(tl.math.div_rn(k_rot, k_scale)), mask=mask)
        tl.store(v_cache_ptr + dst, _fp8_e4m3_code(tl.math.div_rn(v, v_scale)), mask=mask)
    else:  # int8
        k_scale = tl.load(kv_scale_ptr)
        v_scale = tl.load(kv_scale_ptr + 1)
        tl.store(k_cache_ptr + dst, _int8_code(tl.math.div_rn(k_rot, k_scale)), mask=mask)
        tl.store(v_cache_ptr + dst, _int8_code(tl.math.div_rn(v, v_scale)), mask=mask)


@_jit
def _paged_attention_kernel(
    q_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, kv_scale_ptr, block_tables_ptr, cu_seqlens_q_ptr,
    seq_lens_kv_ptr, out_ptr, num_seqs, softmax_scale,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_co, stride_ch, stride_cd,
    stride_bt,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """Causal paged attention of one query tile (BLOCK_M // GROUP tokens x GROUP heads) of one sequence and
    one KV head, over its KV positions in tiles of BLOCK_N (see the module docstring for the grid).

    q ``[T, num_heads, HEAD_DIM]`` float32 / bfloat16 (before RoPE); cos, sin ``[T, HEAD_DIM // 2]``
    float32; k_cache, v_cache this layer's ``[num_blocks, TOKENS_PER_BLOCK, num_kv_heads, HEAD_DIM]`` in the
    read view of KV_FORMAT (FP8 as uint8); kv_scale ``[2]`` float32 (8-bit pools); block_tables ``[B,
    max_blocks]`` int32; cu_seqlens_q ``[B+1]`` int32; seq_lens_kv ``[B]`` int32; out ``[T, num_heads,
    HEAD_DIM]`` float32, or bfloat16 bits as int16 when OUT_BF16.
    """
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP
    HALF: tl.constexpr = HEAD_DIM // 2

    # This tile's sequence: the last b whose first tile cu_seqlens_q[b] // BLOCK_Q + b is <= tile.
    lo = tile * 0  # a tensor in compiled and interpreted kernels alike, also when the loop never runs (B = 1)
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        owns = tl.load(cu_seqlens_q_ptr + mid) // BLOCK_Q + mid <= tile
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid - 1)
    seq = lo
    q_start = tl.load(cu_seqlens_q_ptr + seq)
    num_new = tl.load(cu_seqlens_q_ptr + seq + 1) - q_start
    first = (tile - (q_start // BLOCK_Q + seq)) * BLOCK_Q  # this tile's first new token, within the sequence
    if first >= num_new:
        return
    kv_len = tl.load(seq_lens_kv_ptr + seq)
    kv_stop = kv_len - num_new + tl.minimum(num_new, first + BLOCK_Q)  # last query row's position + 1

    r = tl.arange(0, BLOCK_M)
    token = first + r // GROUP  # [M] index among the sequence's new tokens
    row_valid = (r // GROUP < BLOCK_Q) & (token < num_new)
    head = kv_head * GROUP + r % GROUP
    # Spare rows see every position up to kv_stop (finite softmax); they are never stored.
    q_pos = tl.where(row_valid, kv_len - num_new + token, kv_stop - 1)
    t = q_start + token  # [M] packed row

    d = tl.arange(0, DIM_PAD)
    d_valid = d < HEAD_DIM
    first_half = d < HALF
    partner = tl.where(first_half, d + HALF, d - HALF)
    freq = tl.where(first_half, d, d - HALF)
    q_mask = row_valid[:, None] & d_valid[None, :]
    q_row = q_ptr + t[:, None] * stride_qt + head[:, None] * stride_qh
    q = tl.load(q_row + d[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)  # [M, Dp]
    q_partner = tl.load(q_row + partner[None, :] * stride_qd, mask=q_mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t[:, None] * HALF + freq[None, :], mask=q_mask, other=0.0)
    sin = tl.load(sin_ptr + t[:, None] * HALF + freq[None, :], mask=q_mask, other=0.0)
    q_rot = q * cos + tl.where(first_half[None, :], -q_partner, q_partner) * sin
    # exp2-domain scores: softmax scale, log2(e) = 1.4426950408889634 and the K scale folded into q once.
    q_rot = q_rot * (softmax_scale * 1.4426950408889634 * _kv_scale_factor(kv_scale_ptr, 0, KV_FORMAT))
    q_dot = _to_dot(q_rot, DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (log2 domain)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    block_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for n_start in range(0, kv_stop, BLOCK_N):
        n = n_start + tl.arange(0, BLOCK_N)  # [N] KV positions
        n_valid = n < kv_stop
        block = tl.load(block_row + n // TOKENS_PER_BLOCK, mask=n_valid, other=0).to(tl.int64)
        kv_row = block * stride_cb + (n % TOKENS_PER_BLOCK) * stride_co + kv_head * stride_ch  # [N]
        kv_offs = kv_row[:, None] + d[None, :] * stride_cd  # [N, Dp]
        kv_mask = n_valid[:, None] & d_valid[None, :]
        k = _kv_tile_for_dot(tl.load(k_cache_ptr + kv_offs, mask=kv_mask, other=0), KV_FORMAT, DOT_DTYPE)
        scores = tl.dot(q_dot, tl.trans(k), input_precision="ieee")  # [M, N] float32
        scores = tl.where(n[None, :] <= q_pos[:, None], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _kv_tile_for_dot(tl.load(v_cache_ptr + kv_offs, mask=kv_mask, other=0), KV_FORMAT, DOT_DTYPE)
        acc = acc * alpha[:, None] + tl.dot(_to_dot(p, DOT_DTYPE), v, input_precision="ieee")
        m_i = m_new

    out = acc * (_kv_scale_factor(kv_scale_ptr, 1, KV_FORMAT) / l_i)[:, None]
    out_offs = t[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :] * stride_od
    if OUT_BF16:
        tl.store(out_ptr + out_offs, _bf16_bits(out), mask=q_mask)
    else:
        tl.store(out_ptr + out_offs, out, mask=q_mask)


# TensorRT's ahead-of-time plugin ABI (tensorrt.plugin.aot_impl): one kernel per plugin, its parameters the
# plugin's input pointers in order, then int32 scalars, then the output pointers; every tensor contiguous.
# These wrappers give the two kernels above that ABI, strides derived from the constexpr shape, and the K and
# V halves of a layer's pool [2, num_blocks, TOKENS_PER_BLOCK, heads, HEAD_DIM] found from num_blocks.

@_jit
def _trt_paged_kv_write_kernel(
    k_ptr, v_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, past_ptr, kv_scale_ptr, num_blocks, present_ptr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
    TOKENS_PER_BLOCK: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """``paged_kv_write``'s kernel: :func:`_rope_kv_write_kernel` into ``present`` (which aliases ``past``,
    the layer's pool, so ``past_ptr`` itself is never read), one program per new token."""
    ROW: tl.constexpr = NUM_KV_HEADS * HEAD_DIM
    BLOCK: tl.constexpr = TOKENS_PER_BLOCK * ROW
    v_cache_ptr = present_ptr + num_blocks.to(tl.int64) * BLOCK
    _rope_kv_write_kernel(k_ptr, v_ptr, cos_ptr, sin_ptr, slot_mapping_ptr, present_ptr, v_cache_ptr, kv_scale_ptr,
                          ROW, HEAD_DIM, 1, ROW, HEAD_DIM, 1, BLOCK, ROW, HEAD_DIM, 1,
                          NUM_KV_HEADS, HEAD_DIM, HEADS_PAD, DIM_PAD, TOKENS_PER_BLOCK, KV_FORMAT)


@_jit
def _trt_paged_attention_kernel(
    q_ptr, cos_ptr, sin_ptr, kv_ptr, block_tables_ptr, cu_seqlens_q_ptr, seq_lens_kv_ptr, kv_scale_ptr,
    num_blocks, num_seqs, out_ptr,
    NUM_HEADS: tl.constexpr, MAX_BLOCKS_PER_SEQ: tl.constexpr, SOFTMAX_SCALE: tl.constexpr,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr, TOKENS_PER_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KV_FORMAT: tl.constexpr, DOT_DTYPE: tl.constexpr,
    OUT_BF16: tl.constexpr,
):
    """``paged_attention_core``'s kernel: :func:`_paged_attention_kernel` over the pool after the write, the
    softmax scale baked in (TensorRT passes integer scalars only)."""
    ROW: tl.constexpr = (NUM_HEADS // GROUP) * HEAD_DIM
    BLOCK: tl.constexpr = TOKENS_PER_BLOCK * ROW
    v_cache_ptr = kv_ptr + num_blocks.to(tl.int64) * BLOCK
    _paged_attention_kernel(q_ptr, cos_ptr, sin_ptr, kv_ptr, v_cache_ptr, kv_scale_ptr, block_tables_ptr,
                            cu_seqlens_q_ptr, seq_lens_kv_ptr, out_ptr, num_seqs, SOFTMAX_SCALE,
                            NUM_HEADS * HEAD_DIM, HEAD_DIM, 1, BLOCK, ROW, HEAD_DIM, 1, MAX_BLOCKS_PER_SEQ,
                            NUM_HEADS * HEAD_DIM, HEAD_DIM, 1,
                            GROUP, HEAD_DIM, DIM_PAD, TOKENS_PER_BLOCK, BLOCK_M, BLOCK_N, KV_FORMAT, DOT_DTYPE,
                            OUT_BF16)


# ---------------------------------------------------------------------------------------------------------
# Launch configuration: every constexpr and launch option decided here, for the JIT and the AOT paths alike
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class AttentionShape:
    """What the kernels are specialized on (constexprs), fixed per engine: head counts, head_dim,
    tokens_per_block, the activation dtype and the pool format (``KV_FORMATS`` names)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    act_dtype: str = "bfloat16"  # "float32" | "bfloat16"
    kv_format: str = "bfloat16"  # "float32" | "bfloat16" | "fp8" | "int8"

    @property
    def group(self) -> int:
        return self.num_heads // self.num_kv_heads


def _write_constexprs(shape: AttentionShape) -> dict:
    return dict(NUM_KV_HEADS=shape.num_kv_heads, HEAD_DIM=shape.head_dim,
                HEADS_PAD=triton.next_power_of_2(shape.num_kv_heads), DIM_PAD=triton.next_power_of_2(shape.head_dim),
                TOKENS_PER_BLOCK=shape.tokens_per_block, KV_FORMAT=shape.kv_format)


def attention_block_m(shape: AttentionShape, max_new_tokens: int) -> int:
    """Query-tile rows for a batch whose sequences have at most ``max_new_tokens`` new tokens: 16 (the
    smallest tensor-core tile) when every sequence's tokens x GROUP fit in it (generation batches), else 64;
    never fewer than GROUP rows (one token's heads)."""
    rows = 16 if max_new_tokens * shape.group <= 16 else 64
    return max(rows, triton.next_power_of_2(shape.group))


def attention_dot_dtype(shape: AttentionShape, interpreted: bool) -> str:
    """The operand dtype of the attention kernel's two dots: float32 (IEEE) for float32 activations;
    for bfloat16 activations, bfloat16 over a bfloat16 pool and float16 over an 8-bit pool (FP8 and int8
    codes become float16 by integer operations alone, and float16 keeps 3 more bits of q and of the
    probabilities). Interpreted bfloat16 dots fall back to float32 (Triton's interpreter multiplies
    bfloat16 operands as integers)."""
    if shape.act_dtype == "float32":
        return "float32"
    if shape.kv_format in ("fp8", "int8"):
        return "float16"
    return "float32" if interpreted else "bfloat16"


def _attention_constexprs(shape: AttentionShape, block_m: int, dot_dtype: str) -> dict:
    return dict(GROUP=shape.group, HEAD_DIM=shape.head_dim, DIM_PAD=max(16, triton.next_power_of_2(shape.head_dim)),
                TOKENS_PER_BLOCK=shape.tokens_per_block, BLOCK_M=block_m,
                BLOCK_N=32 if dot_dtype == "float32" else 64, KV_FORMAT=shape.kv_format, DOT_DTYPE=dot_dtype,
                OUT_BF16=shape.act_dtype == "bfloat16")


_WRITE_OPTIONS = dict(num_warps=4, num_stages=1, enable_fp_fusion=False)
_ATTENTION_OPTIONS = dict(num_warps=4, num_stages=2, enable_fp_fusion=True)


def _require_triton() -> None:
    if triton is None:
        raise ImportError("kilnlm's GPU kernels need Triton: pip install 'kilnlm[gpu]' (or pip install triton)")


# ---------------------------------------------------------------------------------------------------------
# The op
# ---------------------------------------------------------------------------------------------------------

def _check_inputs(q, k, v, kv_cache, layer_idx, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping,
                  positions, kv_scale) -> str:
    """Validates shapes, dtypes and devices (never values: that would synchronise). Returns the pool format."""
    if q.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"paged_attention: q must be float32 or bfloat16, got {q.dtype}")
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError("paged_attention: q, k, v must be [T, heads, head_dim]")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"paged_attention: k and v must be q's dtype {q.dtype}, got {k.dtype} / {v.dtype}")
    if k.shape != (num_tokens, num_kv_heads, head_dim) or v.shape != k.shape:
        raise ValueError(f"paged_attention: k and v must be [{num_tokens}, num_kv_heads, {head_dim}], "
                         f"got {tuple(k.shape)} / {tuple(v.shape)}")
    if head_dim % 2 or num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"paged_attention: head_dim ({head_dim}) must be even and num_heads ({num_heads}) a "
                         f"multiple of num_kv_heads ({num_kv_heads})")
    if kv_cache.dim() != 6 or kv_cache.shape[1] != 2 or tuple(kv_cache.shape[4:]) != (num_kv_heads, head_dim):
        raise ValueError(f"paged_attention: kv_cache must be [num_layers, 2, num_blocks, tokens_per_block, "
                         f"{num_kv_heads}, {head_dim}], got {tuple(kv_cache.shape)}")
    if not 0 <= layer_idx < kv_cache.shape[0]:
        raise ValueError(f"paged_attention: layer_idx {layer_idx} is out of range for {kv_cache.shape[0]} layers")
    if inv_freq.shape != (head_dim // 2,):
        raise ValueError(f"paged_attention: inv_freq must have head_dim / 2 = {head_dim // 2} entries, "
                         f"got {tuple(inv_freq.shape)}")
    num_seqs = seq_lens_kv.shape[0]
    for name, tensor, dtype, shape in (("positions", positions, torch.int64, (num_tokens,)),
                                       ("slot_mapping", slot_mapping, torch.int64, (num_tokens,)),
                                       ("cu_seqlens_q", cu_seqlens_q, torch.int32, (num_seqs + 1,)),
                                       ("seq_lens_kv", seq_lens_kv, torch.int32, (num_seqs,))):
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"paged_attention: {name} must be {list(shape)} {dtype}, got "
                             f"{list(tensor.shape)} {tensor.dtype}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"paged_attention: block_tables must be [{num_seqs}, max_blocks] int32, got "
                         f"{list(block_tables.shape)} {block_tables.dtype}")
    devices = {t.device for t in (q, k, v, kv_cache, positions, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables,
                                  slot_mapping)}
    if kv_scale is not None:
        devices.add(kv_scale.device)
    if len(devices) != 1:
        raise ValueError(f"paged_attention: all tensors must be on one device, got {sorted(map(str, devices))}")
    if kv_scale is None:
        if kv_cache.dtype != q.dtype:
            raise ValueError(f"paged_attention: kv_cache must be q's dtype {q.dtype} (or an 8-bit pool with "
                             f"kv_scale), got {kv_cache.dtype}")
        return KV_FORMATS[q.dtype]
    if kv_cache.dtype not in (torch.float8_e4m3fn, torch.int8):
        raise ValueError(f"paged_attention: kv_scale given, so kv_cache must be an 8-bit pool (float8_e4m3fn "
                         f"or int8), got {kv_cache.dtype}")
    if kv_scale.dtype != torch.float32 or tuple(kv_scale.shape) != (2,):
        raise ValueError(f"paged_attention: kv_scale must be [2] float32 (k_scale, v_scale), got "
                         f"{list(kv_scale.shape)} {kv_scale.dtype}")
    return KV_FORMATS[kv_cache.dtype]


def paged_attention_triton(
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
    """``kilnlm::paged_attention`` with the Triton kernels (contract: :mod:`kilnlm.plugins.schema`).

    q ``[T, num_heads, head_dim]``, k / v ``[T, num_kv_heads, head_dim]`` float32 / bfloat16 (any strides,
    e.g. slices of a fused QKV projection); kv_cache ``[num_layers, 2, num_blocks, tokens_per_block,
    num_kv_heads, head_dim]`` in q's dtype, or float8_e4m3fn / int8 with ``kv_scale [2] float32`` (k_scale,
    v_scale), **mutated in place** at ``slot_mapping`` of layer ``layer_idx``; positions ``[T]`` int64;
    inv_freq ``[head_dim // 2]`` float32; cu_seqlens_q ``[B+1]`` int32; seq_lens_kv ``[B]`` int32;
    block_tables ``[B, max_blocks]`` int32; slot_mapping ``[T]`` int64. All on one CUDA device (or CPU
    under ``TRITON_INTERPRET=1``). Returns ``out [T, num_heads, head_dim]``, q's dtype, on that device.

    Raises ValueError for wrong shapes, dtypes or devices, ImportError without Triton. Index values are not
    checked (see the module docstring).
    """
    _require_triton()
    kv_format = _check_inputs(q, k, v, kv_cache, layer_idx, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables,
                              slot_mapping, positions, kv_scale)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    shape = AttentionShape(num_heads=num_heads, num_kv_heads=k.shape[1], head_dim=head_dim,
                           tokens_per_block=kv_cache.shape[3], act_dtype=KV_FORMATS[q.dtype], kv_format=kv_format)
    # RoPE tables, the reference's expressions: [T, head_dim // 2] float32.
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    cu_seqlens_q, seq_lens_kv = cu_seqlens_q.contiguous(), seq_lens_kv.contiguous()
    slot_mapping = slot_mapping.contiguous()
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    layer = kv_cache[layer_idx]  # [2, num_blocks, tokens_per_block, num_kv_heads, head_dim], a view
    k_write, v_write = layer.view(_WRITE_VIEW[kv_format]).unbind(0)
    k_read, v_read = layer.view(_READ_VIEW[kv_format]).unbind(0)
    out_view = out.view(torch.int16) if q.dtype == torch.bfloat16 else out
    num_seqs = seq_lens_kv.shape[0]
    # Generation batches (T == B) take the 16-row tile; an upper bound on any sequence's new tokens is T - B + 1.
    block_m = attention_block_m(shape, num_tokens - num_seqs + 1)
    consts = _attention_constexprs(shape, block_m, attention_dot_dtype(shape, interpreted=not q.is_cuda))
    grid = (num_tokens // (block_m // shape.group) + num_seqs, shape.num_kv_heads)

    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        _rope_kv_write_kernel[(num_tokens,)](
            k, v, cos, sin, slot_mapping, k_write, v_write, kv_scale,
            k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
            *k_write.stride(), **_write_constexprs(shape), **_WRITE_OPTIONS)
        _paged_attention_kernel[grid](
            q, cos, sin, k_read, v_read, kv_scale, block_tables, cu_seqlens_q, seq_lens_kv, out_view, num_seqs,
            float(scale), q.stride(0), q.stride(1), q.stride(2), *k_read.stride(), block_tables.stride(0),
            *out_view.stride(), **consts, **_ATTENTION_OPTIONS)
    return out


_REGISTER_LOCK = threading.Lock()
_REGISTERED: list = []  # [True] once the CUDA kernel is registered (torch keeps the registration)


def register_cuda_kernels() -> None:
    """Registers :func:`paged_attention_triton` as ``kilnlm::paged_attention``'s CUDA kernel, so
    ``torch.ops.kilnlm.paged_attention`` on CUDA tensors runs it. Idempotent; raises ImportError without
    Triton (checked here rather than at the first call)."""
    _require_triton()
    with _REGISTER_LOCK:
        if not _REGISTERED:
            torch.library.register_kernel("kilnlm::paged_attention", "cuda", paged_attention_triton)
            _REGISTERED.append(True)


# ---------------------------------------------------------------------------------------------------------
# Ahead-of-time compilation (no GPU needed: Triton's wheel ships ptxas)
# ---------------------------------------------------------------------------------------------------------

# The engine shape compile_for specializes on by default: SmolLM2-135M (9 query heads, 3 KV heads,
# head_dim 64) with 32-token blocks, bfloat16 activations and pool.
DEFAULT_AOT_SHAPE = AttentionShape(num_heads=9, num_kv_heads=3, head_dim=64, tokens_per_block=32)

_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.int16: "*i16", torch.uint8: "*u8",
                  torch.int8: "*i8"}


def _signature(kernel, runtime_types: dict[str, str], constexprs: dict) -> dict[str, str]:
    """The ASTSource signature of ``kernel``: every parameter typed, constexprs as "constexpr"; raises
    ValueError naming any parameter left untyped (a kernel and its AOT description out of step)."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name in runtime_types:
            signature[name] = runtime_types[name]
        else:
            raise ValueError(f"compile_for: no type for {kernel.__name__} parameter {name}")
    return signature


def compile_for(arch: int, shape: AttentionShape = DEFAULT_AOT_SHAPE) -> dict[str, dict]:
    """Compiles the kernels ahead of time for ``GPUTarget("cuda", arch, 32)`` (arch 80, 89, 90: sm_80
    Ampere, sm_89 Ada, sm_90 Hopper), specialized on ``shape``'s constexprs (head counts, head_dim,
    tokens_per_block, activation dtype, pool format) as the JIT path would be for such an engine: unit
    innermost strides (head_dim contiguous), 32-bit integer strides and counts, 16-byte-aligned pointers
    and, when head_dim is a multiple of 16, row strides divisible by 16 (Triton's ``tt.divisibility``,
    which lets it vectorize loads). A caller launching the cubins must meet those assumptions.

    Returns ``{kernel_name: {"ptx": str, "cubin": bytes, "metadata": dict}}`` for ``rope_kv_write`` and
    ``paged_attention_decode`` / ``paged_attention_prefill`` (BLOCK_M 16 / 64, tensor-core dots for
    bfloat16 activations, :func:`attention_dot_dtype`); metadata holds the launch facts (num_warps, shared
    memory bytes, kernel name).
    Raises ImportError without Triton, RuntimeError under ``TRITON_INTERPRET=1`` (interpreted kernels do not
    compile), and Triton's CompilationError for a shape the arch cannot run.
    """
    _require_triton()
    if not hasattr(_paged_attention_kernel, "arg_names") or os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_for: TRITON_INTERPRET=1 made the kernels interpreted; unset it to compile")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", arch, 32)
    act = KV_FORMATS_BY_NAME[shape.act_dtype]
    kv_write = _POINTER_TYPES[_WRITE_VIEW[shape.kv_format]]
    kv_read = _POINTER_TYPES[_READ_VIEW[shape.kv_format]]
    eight_bit = shape.kv_format in ("fp8", "int8")
    unit_strides = ("stride_kd", "stride_vd", "stride_cd", "stride_qd", "stride_od")
    ints = {name: "i32" for name in ("num_seqs", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cb",
                                     "stride_co", "stride_ch", "stride_bt", "stride_qt", "stride_qh", "stride_ot",
                                     "stride_oh")}
    scale_type = {"kv_scale_ptr": "*fp32"} if eight_bit else {}
    no_scale = {} if eight_bit else {"kv_scale_ptr": None}

    variants = {"rope_kv_write": (_rope_kv_write_kernel, _write_constexprs(shape), _WRITE_OPTIONS,
                                  {"k_ptr": _POINTER_TYPES[act], "v_ptr": _POINTER_TYPES[act], "cos_ptr": "*fp32",
                                   "sin_ptr": "*fp32", "slot_mapping_ptr": "*i64", "k_cache_ptr": kv_write,
                                   "v_cache_ptr": kv_write})}
    dot_dtype = attention_dot_dtype(shape, interpreted=False)
    for label, max_new in (("decode", 1), ("prefill", 1 << 20)):
        consts = _attention_constexprs(shape, attention_block_m(shape, max_new), dot_dtype)
        variants[f"paged_attention_{label}"] = (
            _paged_attention_kernel, consts, _ATTENTION_OPTIONS,
            {"q_ptr": _POINTER_TYPES[act], "cos_ptr": "*fp32", "sin_ptr": "*fp32", "k_cache_ptr": kv_read,
             "v_cache_ptr": kv_read, "block_tables_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
             "seq_lens_kv_ptr": "*i32", "out_ptr": "*i16" if shape.act_dtype == "bfloat16" else "*fp32",
             "softmax_scale": "fp32"})

    # Row strides are multiples of head_dim (contiguous head_dim rows, fused QKV slices included).
    divisible = set(ints) - {"num_seqs", "stride_bt"} if shape.head_dim % 16 == 0 else set()
    compiled = {}
    for name, (kernel, consts, options, pointer_types) in variants.items():
        constexprs = {**consts, **no_scale, **{s: 1 for s in unit_strides if s in kernel.arg_names}}
        runtime_types = {**pointer_types, **scale_type, **ints}
        signature = _signature(kernel, runtime_types, constexprs)
        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(kernel.arg_names)
                 if signature[arg].startswith("*") or (signature[arg] == "i32" and arg in divisible)}
        source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
        binary = triton.compile(source, target=target, options=dict(options))
        compiled[name] = {"ptx": binary.asm["ptx"], "cubin": binary.asm["cubin"],
                          "metadata": {"name": binary.metadata.name, "num_warps": binary.metadata.num_warps,
                                       "shared_bytes": binary.metadata.shared, "arch": arch}}
    return compiled


# ---------------------------------------------------------------------------------------------------------
# The TensorRT plugins' kernels (kilnlm.plugins.tensorrt_plugins): what each compiles and how it is launched
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorRTKernel:
    """One TensorRT plugin's kernel, as :func:`tensorrt_kernels` describes it: the Triton function, its
    ``ASTSource`` signature and constexprs, the compile options, and ``block_m`` (attention's query-tile
    rows; 0 for the KV write). ``grid(num_tokens, num_seqs)`` gives the launch grid from ints or from
    TensorRT's symbolic shape expressions alike (only ``+`` and ``//``)."""

    name: str
    kernel: object
    signature: dict
    constexprs: dict
    options: dict
    num_kv_heads: int
    block_m: int = 0
    group: int = 1

    def grid(self, num_tokens, num_seqs) -> tuple:
        if not self.block_m:
            return num_tokens, 1
        return num_tokens // (self.block_m // self.group) + num_seqs, self.num_kv_heads

    def compile(self, arch: int) -> dict:
        """``triton.compile`` for ``GPUTarget("cuda", arch, 32)``: ``{"name", "ptx", "cubin", "num_warps",
        "shared_bytes", "global_scratch_bytes"}``. The PTX entry takes the parameters of :attr:`signature`
        that are not constexprs, in order, then Triton's two scratch pointers (global and profile scratch,
        never dereferenced when ``global_scratch_bytes`` is 0). Raises RuntimeError under
        ``TRITON_INTERPRET=1``."""
        if not hasattr(self.kernel, "arg_names"):
            raise RuntimeError("TensorRTKernel.compile: TRITON_INTERPRET=1 made the kernels interpreted; unset it")
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        attrs = {(i,): [["tt.divisibility", 16]] for i, arg in enumerate(self.kernel.arg_names)
                 if self.signature[arg].startswith("*")}
        source = ASTSource(fn=self.kernel, signature=self.signature, constexprs=self.constexprs, attrs=attrs)
        binary = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=dict(self.options))
        return {"name": binary.metadata.name, "ptx": binary.asm["ptx"], "cubin": binary.asm["cubin"],
                "num_warps": binary.metadata.num_warps, "shared_bytes": binary.metadata.shared,
                "global_scratch_bytes": getattr(binary.metadata, "global_scratch_size", 0)}


def tensorrt_kernels(shape: AttentionShape, softmax_scale: float, max_blocks_per_seq: int,
                     interpreted: bool = False) -> dict[str, TensorRTKernel]:
    """The kernels of the ``paged_kv_write`` and ``paged_attention_core`` TensorRT plugins for an engine of
    ``shape``, ``softmax_scale`` and ``max_blocks_per_seq`` (block_tables' fixed width), keyed by plugin
    name (``interpreted``: for a launch under ``TRITON_INTERPRET=1``, see :func:`attention_dot_dtype`).
    Attention always takes the 64-row query tile (:func:`attention_block_m` for context chunks): a
    plan's kernel is fixed at build time, and that tile serves generation batches too (at more idle rows).
    Raises ImportError without Triton."""
    _require_triton()
    act = KV_FORMATS_BY_NAME[shape.act_dtype]
    write = TensorRTKernel(
        "paged_kv_write", _trt_paged_kv_write_kernel,
        {"k_ptr": _POINTER_TYPES[act], "v_ptr": _POINTER_TYPES[act], "cos_ptr": "*fp32", "sin_ptr": "*fp32",
         "slot_mapping_ptr": "*i64", "past_ptr": _POINTER_TYPES[_WRITE_VIEW[shape.kv_format]], "kv_scale_ptr": "*fp32",
         "num_blocks": "i32", "present_ptr": _POINTER_TYPES[_WRITE_VIEW[shape.kv_format]],
         **{name: "constexpr" for name in _write_constexprs(shape)}},
        _write_constexprs(shape), _WRITE_OPTIONS, shape.num_kv_heads)
    block_m = attention_block_m(shape, 1 << 20)
    dot_dtype = attention_dot_dtype(shape, interpreted)
    consts = {"NUM_HEADS": shape.num_heads, "MAX_BLOCKS_PER_SEQ": max_blocks_per_seq,
              "SOFTMAX_SCALE": float(softmax_scale), **_attention_constexprs(shape, block_m, dot_dtype)}
    attention = TensorRTKernel(
        "paged_attention_core", _trt_paged_attention_kernel,
        {"q_ptr": _POINTER_TYPES[act], "cos_ptr": "*fp32", "sin_ptr": "*fp32",
         "kv_ptr": _POINTER_TYPES[_READ_VIEW[shape.kv_format]], "block_tables_ptr": "*i32",
         "cu_seqlens_q_ptr": "*i32", "seq_lens_kv_ptr": "*i32", "kv_scale_ptr": "*fp32", "num_blocks": "i32",
         "num_seqs": "i32",
         "out_ptr": "*i16" if shape.act_dtype == "bfloat16" else "*fp32",
         **{name: "constexpr" for name in consts}},
        consts, _ATTENTION_OPTIONS, shape.num_kv_heads, block_m, shape.group)
    return {"paged_kv_write": write, "paged_attention_core": attention}


def paged_attention_tensorrt_abi(q, k, v, kv_cache, layer_idx, positions, inv_freq, cu_seqlens_q, seq_lens_kv,
                                 block_tables, slot_mapping, scale, kv_scale=None) -> torch.Tensor:
    """``kilnlm::paged_attention`` run as a TensorRT plan runs its lowering: the RoPE tables with torch (the
    lowered graph's ``Cos`` / ``Sin``), then the two kernels of :func:`tensorrt_kernels` launched with
    TensorRT's argument order, contiguous tensors and their grids (the same arguments and result as
    :func:`paged_attention_triton`, whose checks it shares; a 16-bit pool gets the lowering's unit
    ``kv_scale``, which its kernels never read). For the tests, under ``TRITON_INTERPRET=1`` or
    on a GPU; TensorRT itself launches the compiled kernels inside a plan."""
    _require_triton()
    kv_format = _check_inputs(q, k, v, kv_cache, layer_idx, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables,
                              slot_mapping, positions, kv_scale)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    shape = AttentionShape(num_heads=num_heads, num_kv_heads=k.shape[1], head_dim=head_dim,
                           tokens_per_block=kv_cache.shape[3], act_dtype=KV_FORMATS[q.dtype], kv_format=kv_format)
    kernels = tensorrt_kernels(shape, scale, block_tables.shape[1], interpreted=not q.is_cuda)
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    q, k, v, block_tables = q.contiguous(), k.contiguous(), v.contiguous(), block_tables.contiguous()
    layer = kv_cache[layer_idx]  # contiguous: the pool is
    num_blocks, num_seqs = layer.shape[1], seq_lens_kv.shape[0]
    if kv_scale is None:
        kv_scale = torch.ones(2, dtype=torch.float32, device=q.device)
    write, attention = kernels["paged_kv_write"], kernels["paged_attention_core"]
    pool_write, pool_read = layer.view(_WRITE_VIEW[kv_format]), layer.view(_READ_VIEW[kv_format])
    out_view = out.view(torch.int16) if q.dtype == torch.bfloat16 else out
    with torch.cuda.device(q.device) if q.is_cuda else contextlib.nullcontext():
        write.kernel[write.grid(num_tokens, num_seqs)](
            k, v, cos, sin, slot_mapping.contiguous(), pool_write, kv_scale, num_blocks, pool_write,
            **write.constexprs, **write.options)
        attention.kernel[attention.grid(num_tokens, num_seqs)](
            q, cos, sin, pool_read, block_tables, cu_seqlens_q.contiguous(), seq_lens_kv.contiguous(), kv_scale,
            num_blocks, num_seqs, out_view, **attention.constexprs, **attention.options)
    return out


__all__ = ["AttentionShape", "DEFAULT_AOT_SHAPE", "KV_FORMATS", "TensorRTKernel", "attention_block_m",
           "attention_dot_dtype", "compile_for", "paged_attention_tensorrt_abi", "paged_attention_triton",
           "register_cuda_kernels", "tensorrt_kernels"]
