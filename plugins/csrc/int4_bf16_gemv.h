// Generation-phase GEMV of kilnlm::int4_linear for bfloat16 x on CPUs with AVX512-BF16, included by
// int4_kernels.h in its KILN_ISA_AVX512_BF16 copy (isa_variants.h) after fp8_bf16_gemm.h (reduce16) and
// bf16_gemv.h (GemvEpilogue, kGemvBlockRows, reduce16_by_lane).
//
// Decode reads each packed weight once, so the kernel must unpack faster than DRAM delivers: four
// instructions per 32 weights here (one shift, one VPTERNLOG, one VDPBF16PS, plus a share of the load), no
// table lookups and no per-group conversions inside the dot products.
//
// - A 64-byte load holds 128 columns as 32 little-endian 16-bit words; word j holds columns 4j .. 4j + 3,
//   column 4j + k in bits 4k .. 4k + 3 (the packed layout: two nibbles per byte, low nibble first).
// - Nibble k of every word becomes a bfloat16 without arithmetic: (nibble ^ 8) | 0x4300 is the bfloat16
//   of 128 + 8 + q = 136 + q (0x4300 is 128; the 7 mantissa bits hold the integer added to it; q in
//   [-8, 7] is the two's complement nibble), one VPTERNLOG per 32 weights. VDPBF16PS multiplies 32 of them
//   with x exactly (bf16 x bf16 is exact in float32) and accumulates pairs in float32.
// - The bias of 136 (and the zero point) leaves the dot products through x's sums: for the columns C of
//   one group g,
//       sum_C (q - zero) x = sum_C (136 + q) x - (136 + zero[g]) * sum_C x,
//   so each row's accumulator starts from -sum_g scale[g] (136 + zero[g]) sum_{C in g} x. x's group sums
//   are computed once per call (int4_gemv_prepare_x, int4_gemv_group_sums), not per row.
// - The group scale multiplies each load's lanes after its four VDPBF16PS (every lane lies in one group,
//   because group_size is a multiple of 32): acc += partial * scale[g(lane)], float32.
//
// So y = sum_g scale[g] * sum_{c in g} (q - zero) * x[c], x being x * pre_quant_scale rounded once to
// bfloat16: the reference's float32-accumulated product with the scale applied per group instead of per
// weight (q - zero is exact either way; this rounds fewer times than bfloat16((q - zero) * scale) weights
// would).

constexpr int64_t kInt4LoadCols = 128;  // columns per 64-byte load
constexpr int64_t kInt4LoadLanes = 16;  // float32 lanes per load, 8 columns each

// The row-independent part of one call: for each 128-column load l, which groups its 16 float32 lanes use
// (lane i covers columns 128 l + 8 i .. + 7). Raw arrays of num_loads (* 16) entries owned by the caller.
struct Int4GemvPlan {
  int64_t in, num_loads;
  int64_t* first_group;  // [num_loads] the group of the load's first column
  int32_t* lane_group;   // [num_loads, 16] each lane's group, relative to first_group
  uint16_t* group_mask;  // [num_loads] the groups the load touches, as a mask from first_group
  uint64_t tail_mask;    // the bytes of the last load that lie inside the row
};

static inline int64_t int4_gemv_num_loads(int64_t in) { return (in + kInt4LoadCols - 1) / kInt4LoadCols; }

// Fills plan's arrays for rows of `in` columns (a multiple of 32) and group_size (a multiple of 32), without
// a division per lane (this runs on every call).
static void int4_gemv_plan(int64_t group_size, Int4GemvPlan& plan) {
  int64_t g0 = 0, offset = 0;  // the load's first group, and its first column's offset in that group
  for (int64_t l = 0; l < plan.num_loads; ++l) {
    int32_t last = 0;
    for (int64_t i = 0; i < 16; ++i) {
      int32_t rel = 0;  // lanes past the row stay in group g0: x is 0 there
      if (l * kInt4LoadCols + 8 * i < plan.in)
        for (int64_t o = offset + 8 * i; o >= group_size; o -= group_size) ++rel;
      plan.lane_group[l * 16 + i] = rel;
      if (rel > last) last = rel;
    }
    plan.first_group[l] = g0;
    plan.group_mask[l] = static_cast<uint16_t>((1u << (last + 1)) - 1u);
    for (offset += kInt4LoadCols; offset >= group_size; offset -= group_size) ++g0;
  }
  const int64_t tail_bytes = (plan.in % kInt4LoadCols) / 2;
  plan.tail_mask = tail_bytes == 0 ? ~uint64_t{0} : (uint64_t{1} << tail_bytes) - 1;
}

// x rows for the kernel, one token = num_loads * 128 bfloat16 + num_loads * 16 float32:
// xb[t, 128 l + 32 k + j] = bfloat16 of x[t, 128 l + 4 j + k] (0 past in), the order in which the k-th
// nibble of each word meets x; neg_sums[t, 16 l + i] = -sum of lane i's eight columns of that bfloat16 x
// (VDPBF16PS against ones adds exactly the pairs a lane of the GEMV multiplies).
static inline void int4_gemv_prepare_x(const float* x, const Int4GemvPlan& plan, uint16_t* xb, float* neg_sums) {
  static const uint16_t kEveryFourth[32] = {0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60,
                                            0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60};
  const __m512i every_fourth = _mm512_loadu_si512(kEveryFourth);
  const __m512bh ones = (__m512bh)_mm512_set1_epi16(0x3F80);  // bfloat16 1.0
  alignas(64) uint16_t row[kInt4LoadCols];
  for (int64_t l = 0; l < plan.num_loads; ++l) {
    const int64_t c0 = l * kInt4LoadCols, n = plan.in - c0 < kInt4LoadCols ? plan.in - c0 : kInt4LoadCols;
    to_bf16_padded(x + c0, n, row, kInt4LoadCols);
    const __m512i w0 = _mm512_load_si512(row), w1 = _mm512_load_si512(row + 32);
    const __m512i w2 = _mm512_load_si512(row + 64), w3 = _mm512_load_si512(row + 96);
    __m512 sums = _mm512_setzero_ps();
    for (int k = 0; k < 4; ++k) {
      const __m512i idx = _mm512_add_epi16(every_fourth, _mm512_set1_epi16(static_cast<short>(k)));
      // lanes j < 16: row[4 j + k] from words 0..63; lanes j >= 16: row[64 + 4 (j - 16) + k]
      const __m512i v = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_permutex2var_epi16(w0, idx, w1),
                                                _mm512_permutex2var_epi16(w2, idx, w3));
      _mm512_storeu_si512(xb + c0 + 32 * k, v);
      sums = _mm512_dpbf16_ps(sums, (__m512bh)v, ones);
    }
    _mm512_storeu_ps(neg_sums + l * 16, _mm512_sub_ps(_mm512_setzero_ps(), sums));
  }
}

// Every cache line of [p, p + num_bytes) towards the core (KILN_WEIGHT_PREFETCH: isa_variants.h).
static inline void prefetch_lines(const void* p, int64_t num_bytes) {
  const uintptr_t first = reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63}, end = reinterpret_cast<uintptr_t>(p) + num_bytes;
  for (uintptr_t line = first; line < end; line += 64) _mm_prefetch(reinterpret_cast<const char*>(line), KILN_WEIGHT_PREFETCH);
}

struct Int4GemvArgs {
  const uint8_t* w;        // [rows, in / 2] packed int4
  const float* scales;     // [rows, num_groups]
  const int8_t* zeros;     // [rows, num_groups] or null (symmetric)
  int64_t half_k, num_groups, num_rows;
  const Int4GemvPlan* plan;
  const uint16_t* xb;      // [num_tokens, num_loads * 128] (int4_gemv_prepare_x)
  const float* neg_group_sums;  // [num_tokens, num_groups] (int4_gemv_group_sums)
};

// neg_group_sums[g] = -sum of group g's columns of one token's bfloat16 x: the sums of its lanes' neg_sums
// (int4_gemv_prepare_x). Each lane's eight columns lie in one group.
static inline void int4_gemv_group_sums(const Int4GemvPlan& plan, const float* neg_sums, int64_t num_groups,
                                        float* neg_group_sums) {
  for (int64_t g = 0; g < num_groups; ++g) neg_group_sums[g] = 0.f;
  for (int64_t l = 0; l < plan.num_loads; ++l)
    for (int64_t i = 0; i < 16 && l * kInt4LoadCols + 8 * i < plan.in; ++i)
      neg_group_sums[plan.first_group[l] + plan.lane_group[l * 16 + i]] += neg_sums[l * 16 + i];
}

// Lane t * NR + r of the result (NT * NR == 16) or, for NT * NR < 16, sums[t * NR + r]: dot(x_{t0 + t},
// row r0 + r). pf_row (or -1): the first of NR rows of a later block, one prefetch per row and load.
//
// The offsets leave once per row and token, not once per load: acc starts from
// sum_g scale[g] (136 + zero[g]) neg_group_sums[g], sixteen groups per vector (the lanes are summed at the
// end anyway), and each load adds scale * sum (136 + q) x. Applied per load instead, the zero points'
// conversion and the lane sums' loads were a third of the loop's instructions; this GEMV is bound by its
// instructions, not by memory, on an AVX512-BF16 Xeon.
template <bool kZeroPoints, int NT, int NR>
static inline void int4_gemv_tile(const Int4GemvArgs& a, int64_t t0, int64_t r0, int64_t pf_row, float* sums) {
  const Int4GemvPlan& plan = *a.plan;
  const int64_t xb_stride = plan.num_loads * kInt4LoadCols;
  const __m512i nibble = _mm512_set1_epi16(0x000F), to_bf16 = _mm512_set1_epi16(0x4308);
  const __m512 bias = _mm512_set1_ps(136.f);
  __m512 acc[NT][NR];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < a.num_groups; g += 16) {
    const __mmask16 mask = a.num_groups - g >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << (a.num_groups - g)) - 1u);
    __m512 group_sums[NT];
    for (int t = 0; t < NT; ++t) group_sums[t] = _mm512_maskz_loadu_ps(mask, a.neg_group_sums + (t0 + t) * a.num_groups + g);
    for (int r = 0; r < NR; ++r) {
      __m512 offset = _mm512_maskz_loadu_ps(mask, a.scales + (r0 + r) * a.num_groups + g);
      if (kZeroPoints)
        offset = _mm512_mul_ps(offset, _mm512_add_ps(bias, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                                                        _mm_maskz_loadu_epi8(mask, a.zeros + (r0 + r) * a.num_groups + g)))));
      else
        offset = _mm512_mul_ps(offset, bias);
      for (int t = 0; t < NT; ++t) acc[t][r] = _mm512_fmadd_ps(offset, group_sums[t], acc[t][r]);
    }
  }
  const uint8_t* w_load = a.w + r0 * a.half_k;  // row r0, load l
  const uint8_t* pf_load = pf_row >= 0 ? a.w + pf_row * a.half_k : nullptr;
  if (pf_row >= 0) {  // the later block's scales and zero points: streams of their own, which the weights' prefetches miss
    prefetch_lines(a.scales + pf_row * a.num_groups, NR * a.num_groups * sizeof(float));
    if (kZeroPoints) prefetch_lines(a.zeros + pf_row * a.num_groups, NR * a.num_groups);
  }
  for (int64_t l = 0; l < plan.num_loads; ++l, w_load += 64) {
    const __m512i lane_group = _mm512_loadu_si512(plan.lane_group + l * 16);
    const __mmask16 group_mask = plan.group_mask[l];
    const __mmask64 byte_mask = l + 1 == plan.num_loads ? plan.tail_mask : ~__mmask64{0};
    const float* scale_load = a.scales + r0 * a.num_groups + plan.first_group[l];
    __m512bh xv[NT][4];
#pragma GCC unroll 4
    for (int t = 0; t < NT; ++t) {
      const uint16_t* xt = a.xb + (t0 + t) * xb_stride + l * kInt4LoadCols;
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) xv[t][k] = (__m512bh)_mm512_loadu_si512(xt + 32 * k);
    }
    if (pf_load != nullptr) {
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(pf_load + r * a.half_k + l * 64), KILN_WEIGHT_PREFETCH);
    }
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const __m512i bytes = _mm512_maskz_loadu_epi8(byte_mask, w_load + r * a.half_k);
      // bfloat16(136 + q) of column 4j + k in word j: VPTERNLOG's f(a, b, c) = b ? a ^ c : c (truth table
      // 0x6A) over (a, b, c) = (word >> 4k, 0x000F, 0x4308) keeps the nibble, flips its sign bit, sets 0x4300.
      __m512bh w[4];
      w[0] = (__m512bh)_mm512_ternarylogic_epi32(bytes, nibble, to_bf16, 0x6A);
      w[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(bytes, 4), nibble, to_bf16, 0x6A);
      w[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(bytes, 8), nibble, to_bf16, 0x6A);
      w[3] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(bytes, 12), nibble, to_bf16, 0x6A);
      const __m512 scale = _mm512_permutexvar_ps(lane_group, _mm512_maskz_loadu_ps(group_mask, scale_load + r * a.num_groups));
#pragma GCC unroll 4
      for (int t = 0; t < NT; ++t) {
        __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), xv[t][0], w[0]);
#pragma GCC unroll 4
        for (int k = 1; k < 4; ++k) part = _mm512_dpbf16_ps(part, xv[t][k], w[k]);
        acc[t][r] = _mm512_fmadd_ps(part, scale, acc[t][r]);
      }
    }
  }
  if constexpr (NT * NR == 16) {
    _mm512_storeu_ps(sums, reduce16_by_lane(&acc[0][0]));
  } else {
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < NR; ++r) sums[t * NR + r] = _mm512_reduce_add_ps(acc[t][r]);
  }
}

// y[t, r] by `epilogue` for rows [r0, r1) and every token t < num_tokens; whole 16-row blocks in tiles of
// 4 tokens x 4 rows, 2 x 8 or 1 x 16 (each weight load used by every token of the tile), the rows past
// the last whole block one at a time.
template <bool kZeroPoints>
static void int4_gemv_rows(const Int4GemvArgs& a, int64_t num_tokens, int64_t r0, int64_t r1,
                           const GemvEpilogue& epilogue) {
  alignas(64) float sums[16];
  const int64_t full_end = r0 + (r1 - r0) / kGemvBlockRows * kGemvBlockRows;
  for (int64_t r = r0; r < full_end; r += kGemvBlockRows) {
    const int64_t ahead = r + kGemvPrefetchBlocks * kGemvBlockRows;
    const int64_t pf = ahead + kGemvBlockRows <= a.num_rows ? ahead : -1;
    int64_t t = 0;
    for (; t + 4 <= num_tokens; t += 4)
      for (int64_t sub = 0; sub < kGemvBlockRows; sub += 4) {
        int4_gemv_tile<kZeroPoints, 4, 4>(a, t, r + sub, t == 0 && pf >= 0 ? pf + sub : -1, sums);
        epilogue.store16<4>(t, r + sub, _mm512_load_ps(sums));
      }
    for (; t + 2 <= num_tokens; t += 2)
      for (int64_t sub = 0; sub < kGemvBlockRows; sub += 8) {
        int4_gemv_tile<kZeroPoints, 2, 8>(a, t, r + sub, t == 0 && pf >= 0 ? pf + sub : -1, sums);
        epilogue.store16<8>(t, r + sub, _mm512_load_ps(sums));
      }
    if (t < num_tokens) {
      int4_gemv_tile<kZeroPoints, 1, 16>(a, t, r, t == 0 ? pf : -1, sums);
      epilogue.store16<16>(t, r, _mm512_load_ps(sums));
    }
  }
  for (int64_t r = full_end; r < r1; ++r)
    for (int64_t t = 0; t < num_tokens; ++t) {
      int4_gemv_tile<kZeroPoints, 1, 1>(a, t, r, -1, sums);
      epilogue.store1(t, r, sums[0]);
    }
}
