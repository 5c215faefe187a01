// Kernels of kilnlm::gemm, compiled per ISA by isa_variants.h (see there for the rules a kernel header
// follows): the AMX bfloat16 GEMM (bf16_amx_gemm.h); the AVX512-BF16 GEMV (bf16_gemv.h over plain bfloat16 rows); the float32-accumulating GEMV of
// AVX2 (bfloat16 weights widened to float32 in registers, or float32 weights) and its portable scalar
// twin, for bfloat16 on CPUs without AVX512-BF16 and, batch-invariant, for float32; the widening of weight
// tiles for the float32 context-phase GEMM (see gemm.cpp). The GEMVs sum each (token, row) in one order
// whatever the token count: eight (AVX2: two vectors of eight) running lanes over the columns, reduced the
// same way.

#if KILN_ISA == KILN_ISA_AVX2 || KILN_ISA == KILN_ISA_GENERIC
// A weight as float32: bfloat16 bits widened (exact), or float32 as it is.
inline float to_float(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline float to_float(float v) { return v; }
#endif

#if KILN_ISA == KILN_ISA_AVX512_BF16
#include "fp8_bf16_gemm.h"  // reduce16
#include "bf16_gemv.h"

// y[t, r] = bf16(sum + bias[r]) for rows [r0, r1).
void gemm_rows(const uint16_t* x, int64_t num_tokens, int64_t x_stride, const uint16_t* w, int64_t n, int64_t k,
               const float* bias, uint16_t* y, int64_t r0, int64_t r1) {
  gemv_any_rows(x, num_tokens, x_stride, PlainRows<Bf16Weights>{w, k}, n, k, r0, r1, GemvEpilogue(y, n, bias));
}

#elif KILN_ISA == KILN_ISA_AMX_BF16
#include "fp8_bf16_gemm.h"  // reduce16, for bf16_gemv.h
#include "bf16_gemv.h"      // GemvEpilogue
#include "amx_tiles.h"     // tile configuration, transpose16x16
#include "bf16_amx_gemm.h"

#elif KILN_ISA == KILN_ISA_AVX2

// Eight weights as float32: bfloat16 widened (exact: zero-extended to 32 bits, moved to the high half), or
// float32 as they are.
inline __m256 load8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// acc[t * acc_stride] = sum_c w[c] * x[t, c] for the weight row at w ([k] bfloat16 or float32) and NT tokens
// of float32 x (rows x_stride apart): each weight vector is used NT times.
template <int NT, typename W>
inline void gemv_row(const W* w, int64_t k, const float* x, int64_t x_stride, float* acc, int64_t acc_stride) {
  __m256 sum[NT][2];
  for (int t = 0; t < NT; ++t) sum[t][0] = sum[t][1] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= k; c += 16) {
    // one 64-byte line per 32 columns, KILN_WEIGHT_PREFETCH_BYTES ahead in this thread's rows
    if ((c & 31) == 0) _mm_prefetch(reinterpret_cast<const char*>(w + c) + KILN_WEIGHT_PREFETCH_BYTES, KILN_WEIGHT_PREFETCH);
    const __m256 w0 = load8(w + c), w1 = load8(w + c + 8);
    for (int t = 0; t < NT; ++t) {
      sum[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * x_stride + c), sum[t][0]);
      sum[t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * x_stride + c + 8), sum[t][1]);
    }
  }
  for (; c + 8 <= k; c += 8) {
    const __m256 w0 = load8(w + c);
    for (int t = 0; t < NT; ++t) sum[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * x_stride + c), sum[t][0]);
  }
  for (int t = 0; t < NT; ++t) {
    float v = hsum8(_mm256_add_ps(sum[t][0], sum[t][1]));
    for (int64_t cc = c; cc < k; ++cc) v += to_float(w[cc]) * x[t * x_stride + cc];
    acc[t * acc_stride] = v;
  }
}

// Tokens per pass over the weight rows: each pass reads the rows from memory once, and NT tokens' 2 * NT
// accumulators, a row's two weight vectors and one x vector fit AVX2's sixteen registers up to 6.
constexpr int64_t kMaxPassTokens = 6;

// Rows [r0, r1) one at a time for NT tokens: rows interleaved read the memory as several streams, which
// starved it (a 98304x576 weight at one token: 23 GB/s one row at a time, 18 four rows at a time; SmolLM2's
// 269 MB cold at two tokens: 19.7-20.5 ms one row at a time, 28.0-28.1 two rows at a time).
template <int NT, typename W>
void gemv_rows_nt(const W* w, int64_t k, int64_t r0, int64_t r1, const float* x, int64_t x_stride, float* acc,
                  int64_t acc_stride) {
  for (int64_t r = r0; r < r1; ++r) gemv_row<NT>(w + r * k, k, x, x_stride, acc + r, acc_stride);
}

// acc[t, r] (row stride n) for weight rows [r0, r1) of w [n, k] (bfloat16 or float32) and every token of
// float32 x [T, k], in the fewest passes of at most kMaxPassTokens tokens, the tokens spread evenly over
// them (8 tokens: 4 + 4, 16: 6 + 5 + 5): a speculative step's 1 + 4 tokens read the weights once (in
// passes of 4 and 1 they read them twice). Each (token, row) has its own accumulators, summed in the same
// order whatever the pass, so the grouping never changes a result.
template <typename W>
void gemv_rows(const W* w, int64_t n, int64_t k, int64_t r0, int64_t r1, const float* x, int64_t num_tokens, float* acc) {
  const int64_t num_passes = (num_tokens + kMaxPassTokens - 1) / kMaxPassTokens;
  for (int64_t pass = 0, t = 0; pass < num_passes; ++pass) {
    const int64_t passes_left = num_passes - pass, pass_tokens = (num_tokens - t + passes_left - 1) / passes_left;
    const float* xt = x + t * k;
    float* acc_t = acc + t * n;
    t += pass_tokens;
    switch (pass_tokens) {
      case 1: gemv_rows_nt<1>(w, k, r0, r1, xt, k, acc_t, n); break;
      case 2: gemv_rows_nt<2>(w, k, r0, r1, xt, k, acc_t, n); break;
      case 3: gemv_rows_nt<3>(w, k, r0, r1, xt, k, acc_t, n); break;
      case 4: gemv_rows_nt<4>(w, k, r0, r1, xt, k, acc_t, n); break;
      case 5: gemv_rows_nt<5>(w, k, r0, r1, xt, k, acc_t, n); break;
      default: gemv_rows_nt<6>(w, k, r0, r1, xt, k, acc_t, n); break;
    }
  }
}

// dst[i] = float(src[i]) for i < count.
void widen(const uint16_t* src, int64_t count, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= count; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < count; ++i) dst[i] = to_float(src[i]);
}

#elif KILN_ISA == KILN_ISA_GENERIC

// AVX2's gemv_rows in portable code: acc[t, r] (row stride n) = sum_c w[r, c] * x[t, c], each (token, row)
// summed in 8 running lanes over the columns (lane c % 8), then pairwise.
template <typename W>
void gemv_rows(const W* w, int64_t n, int64_t k, int64_t r0, int64_t r1, const float* x, int64_t num_tokens, float* acc) {
  for (int64_t r = r0; r < r1; ++r) {
    const W* row = w + r * k;
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* xt = x + t * k;
      float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      int64_t c = 0;
      for (; c + 8 <= k; c += 8)
        for (int l = 0; l < 8; ++l) lane[l] += to_float(row[c + l]) * xt[c + l];
      float v = ((lane[0] + lane[4]) + (lane[1] + lane[5])) + ((lane[2] + lane[6]) + (lane[3] + lane[7]));
      for (; c < k; ++c) v += to_float(row[c]) * xt[c];
      acc[t * n + r] = v;
    }
  }
}
#endif
