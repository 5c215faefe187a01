// Context-phase GEMM of bfloat16 tiles on CPUs with AVX512-BF16 (AMD Zen 4+, Intel Sapphire Rapids+), the
// quantized linears' (quant_linear.h, run_tiled_bf16), included by their kernel headers in the
// KILN_ISA_AVX512_BF16 / _VBMI copies of isa_variants.h; its reduce16 is also bf16_gemv.h's, so every
// kernel header that includes that includes this first.
//
// Exactness: every E4M3 value (weights and quantized activations) is exactly a normal bfloat16, and a
// product of two bfloat16 is exact in float32, so VDPBF16PS (pairwise products accumulated in float32)
// computes the same float32-accumulated GEMM as the float32 path, only in another summation order --
// at twice the multiply throughput of float32 FMAs per instruction.

// Horizontal sums of 16 accumulators a[n] at once (a transpose-and-add tree instead of 16 separate
// reductions): out[4 * (n % 4) + n / 4] = sum of a[n]'s 16 lanes.
static inline void reduce16(const __m512* a, float* out) {
  __m512 x[8], y[4];
  for (int m = 0; m < 8; ++m)  // 128-bit lanes: [a2m (l0+l2), a2m (l1+l3), a2m+1 (l0+l2), a2m+1 (l1+l3)]
    x[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int p = 0; p < 4; ++p)  // lane j holds a 4-float partial of a[4p + j]
    y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0xDD));
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi)));  // lane j: a[j], a[4+j], ...
}

// c[t, r] = sum_k xb[t, k] * wb[r, k] for t < num_tokens (a multiple of 4), r < num_rows (a multiple of
// 4); xb: [num_tokens, k_pad] bf16 bits, wb: [num_rows, k_pad] bf16 bits, k_pad a multiple of 32 (zero
// padded); c: [num_tokens, c_stride] float32.
static void bf16_gemm_nt(const uint16_t* xb, int64_t num_tokens, const uint16_t* wb, int64_t num_rows, int64_t k_pad,
                         float* c, int64_t c_stride) {
  for (int64_t t0 = 0; t0 < num_tokens; t0 += 4) {
    for (int64_t r0 = 0; r0 < num_rows; r0 += 4) {
      __m512 acc[4][4];
      for (int t = 0; t < 4; ++t)
        for (int r = 0; r < 4; ++r) acc[t][r] = _mm512_setzero_ps();
      for (int64_t k = 0; k < k_pad; k += 32) {
        __m512i xv[4];
        for (int t = 0; t < 4; ++t) xv[t] = _mm512_loadu_si512(xb + (t0 + t) * k_pad + k);
        for (int r = 0; r < 4; ++r) {
          const __m512i wv = _mm512_loadu_si512(wb + (r0 + r) * k_pad + k);
          for (int t = 0; t < 4; ++t) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], (__m512bh)xv[t], (__m512bh)wv);
        }
      }
      float sums[16];  // sums[4 * r + t] = total of acc[t][r]
      reduce16(&acc[0][0], sums);
      for (int t = 0; t < 4; ++t)
        for (int r = 0; r < 4; ++r) c[(t0 + t) * c_stride + r0 + r] = sums[4 * r + t];
    }
  }
}
