// INT8 weight kernels of kilnlm::int8_linear (W8A16) and kilnlm::int8_sq_linear (W8A8), compiled per ISA
// by isa_variants.h (see there for the rules a kernel header follows): the float32 GEMV and the exact int32
// W8A8 GEMM as portable scalar, AVX2+FMA and AVX-512 versions, chosen at run time; AVX2's block floating
// point int16 GEMV (int16_quantize.h); the AVX512-BF16 GEMV and context-phase tiles; the AVX512-VNNI W8A8
// GEMM (int8_vnni_gemm.h).
//
#if KILN_ISA == KILN_ISA_GENERIC || KILN_ISA == KILN_ISA_AVX2 || KILN_ISA == KILN_ISA_AVX512

// Arguments shared by the functions below:
//   w     [out, in] int8, row-major (rows `in` bytes apart)
//   x     [num_tokens, in] float32 (W8A16) or int16 holding int8 values (W8A8), rows `x_stride` apart
//   y     [num_tokens, *] float32 / int32, rows `y_stride` apart; row r's dot product goes to column r

// ---------------------------------------------------------------------------------------------------
// W8A16: y[t, r] = sum_c x[t, c] * q[r, c] (float32; the caller applies the per-row scale).

// Scalar dot products of columns [c0, in) -- the whole row on the portable path, the tail otherwise.
static inline float dot_f32_tail(const int8_t* row, const float* x, int64_t c0, int64_t in) {
  float s = 0.f;
  for (int64_t c = c0; c < in; ++c) s += static_cast<float>(row[c]) * x[c];
  return s;
}

// W8A8: exact int32 sum of int8 x int8 products over columns [c0, in).
static inline int32_t dot_i32_tail(const int8_t* row, const int16_t* x, int64_t c0, int64_t in) {
  int32_t s = 0;
  for (int64_t c = c0; c < in; ++c) s += static_cast<int32_t>(row[c]) * static_cast<int32_t>(x[c]);
  return s;
}

// W8A8 activation quantization, scalar: clamp(round_half_even(x / scale), -128, 127) (IEEE division first,
// as quantize_int8_reference; clamping before rounding gives the same result and keeps the cast in range).
static inline int16_t quantize_int8_scalar(float x, float scale) {
  float v = x / scale;
  v = v < -128.f ? -128.f : (v > 127.f ? 127.f : v);
  return static_cast<int16_t>(__builtin_nearbyintf(v));  // default rounding mode: nearest, ties to even
}

#if KILN_ISA == KILN_ISA_AVX512  // ---------------------------------------------------------------- AVX-512

// out[i] = quantize_int8_scalar(x[i], scale) for i < n.
static void quantize_int8_rows(const float* x, int64_t n, float scale, int16_t* out) {
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-128.f), hi = _mm512_set1_ps(127.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + i), s);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    const __m512i q = _mm512_cvt_roundps_epi32(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm512_cvtepi32_epi16(q));
  }
  for (; i < n; ++i) out[i] = quantize_int8_scalar(x[i], scale);
}

// max |x[i]| over i < n, NaN skipped as std::max(amax, |x|) skips it (VMAXPS returns its second operand
// when either is NaN); a maximum is exact in any order.
static float amax_abs(const float* x, int64_t n) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    acc = _mm512_max_ps(_mm512_castsi512_ps(_mm512_and_si512(_mm512_loadu_si512(x + i), abs_mask)), acc);
  float amax = _mm512_reduce_max_ps(acc);
  for (; i < n; ++i) amax = amax < __builtin_fabsf(x[i]) ? __builtin_fabsf(x[i]) : amax;  // (no std::max: isa_variants.h)
  return amax;
}

// NR rows x NT tokens, float32: 16 int8 weights -> int32 -> float32 once, used by NT tokens.
template <int NR, int NT>
static inline void gemv_f32_block(const int8_t* w, int64_t in, const float* x, int64_t x_stride, float* y,
                                  int64_t y_stride) {
  __m512 acc[NR][NT][2];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= in; c += 32) {
    if ((c & 63) == 0) {
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * in + c) + KILN_WEIGHT_PREFETCH_BYTES, KILN_WEIGHT_PREFETCH);
    }
    __m512 xv[NT][2];
    for (int t = 0; t < NT; ++t) {
      xv[t][0] = _mm512_loadu_ps(x + t * x_stride + c);
      xv[t][1] = _mm512_loadu_ps(x + t * x_stride + c + 16);
    }
    for (int r = 0; r < NR; ++r) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * in + c));
      const __m512 w0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(bytes)));
      const __m512 w1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(bytes, 1)));
      for (int t = 0; t < NT; ++t) {
        acc[r][t][0] = _mm512_fmadd_ps(w0, xv[t][0], acc[r][t][0]);
        acc[r][t][1] = _mm512_fmadd_ps(w1, xv[t][1], acc[r][t][1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      y[t * y_stride + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t][0], acc[r][t][1])) +
                            dot_f32_tail(w + r * in, x + t * x_stride, c, in);
}

// NR rows x NT tokens, exact int32: 32 int8 weights sign-extended to int16 once, then VPMADDWD (pairs of
// int16 products summed into int32: |sum| <= 2 * 128 * 128, no overflow) per token.
template <int NR, int NT>
static inline void gemm_i32_block(const int8_t* w, int64_t in, const int16_t* x, int64_t x_stride, int32_t* y,
                                  int64_t y_stride) {
  __m512i acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_si512();
  int64_t c = 0;
  for (; c + 32 <= in; c += 32) {
    if ((c & 63) == 0) {
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * in + c) + KILN_WEIGHT_PREFETCH_BYTES, KILN_WEIGHT_PREFETCH);
    }
    __m512i xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_loadu_si512(x + t * x_stride + c);
    for (int r = 0; r < NR; ++r) {
      const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * in + c)));
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_add_epi32(acc[r][t], _mm512_madd_epi16(wv, xv[t]));
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      y[t * y_stride + r] = _mm512_reduce_add_epi32(acc[r][t]) + dot_i32_tail(w + r * in, x + t * x_stride, c, in);
}

// One token reads its rows one after another (one sequential stream, prefetched
// KILN_WEIGHT_PREFETCH_BYTES ahead: isa_variants.h); more share each weight load between tokens. A row's
// sums do not depend on NR.
template <int NT>
struct RowsPerBlock { static constexpr int value = NT == 4 ? 2 : NT == 2 ? 4 : 1; };

#elif KILN_ISA == KILN_ISA_AVX2  // ------------------------------------------------------------ AVX2 + FMA

static void quantize_int8_rows(const float* x, int64_t n, float scale, int16_t* out) {
  const __m256 s = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-128.f), hi = _mm256_set1_ps(127.f);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i q[2];
    for (int h = 0; h < 2; ++h) {
      __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + i + 8 * h), s);
      v = _mm256_min_ps(_mm256_max_ps(v, lo), hi);
      q[h] = _mm256_cvtps_epi32(_mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    }
    // packs interleaves 128-bit lanes: [q0 lo, q1 lo, q0 hi, q1 hi] -> reorder the 64-bit quarters
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), _mm256_permute4x64_epi64(_mm256_packs_epi32(q[0], q[1]), 0xD8));
  }
  for (; i < n; ++i) out[i] = quantize_int8_scalar(x[i], scale);
}

// max |x[i]| over i < n, NaN skipped (as the AVX-512 copy's).
static float amax_abs(const float* x, int64_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float amax = 0.f;
  for (int l = 0; l < 8; ++l) amax = amax < lanes[l] ? lanes[l] : amax;
  for (; i < n; ++i) amax = amax < __builtin_fabsf(x[i]) ? __builtin_fabsf(x[i]) : amax;
  return amax;
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline int32_t hsum8_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

template <int NR, int NT>
static inline void gemv_f32_block(const int8_t* w, int64_t in, const float* x, int64_t x_stride, float* y,
                                  int64_t y_stride) {
  __m256 acc[NR][NT][2];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= in; c += 16) {
    if ((c & 63) == 0) {
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * in + c) + KILN_WEIGHT_PREFETCH_BYTES, KILN_WEIGHT_PREFETCH);
    }
    for (int r = 0; r < NR; ++r) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * in + c));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
      for (int t = 0; t < NT; ++t) {
        acc[r][t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + t * x_stride + c), acc[r][t][0]);
        acc[r][t][1] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + t * x_stride + c + 8), acc[r][t][1]);
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      y[t * y_stride + r] = hsum8(_mm256_add_ps(acc[r][t][0], acc[r][t][1])) + dot_f32_tail(w + r * in, x + t * x_stride, c, in);
}

// 64 int8 weights sign-extended to int16, 16 per vector.
struct Widened64 {
  __m256i v0, v1, v2, v3;
};

static inline Widened64 widen64(const int8_t* w) {
  const auto widen16 = [](const int8_t* p) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  };
  return {widen16(w), widen16(w + 16), widen16(w + 32), widen16(w + 48)};
}

// The eight int32 lane sums of w * x over 64 columns (x int16), the four VPMADDWD products added pairwise,
// so that a caller's accumulator takes one add per 64 weights: ~1 cycle per 16 weights on an AMD EPYC Zen 3,
// VPMOVSXBW's rate there (one per ~1.2 cycles), where a loop of 16 weights per iteration, the prefetch behind
// a test of the column, took ~3 (two taken branches per iteration).
static inline __m256i madd64(const Widened64& w, const int16_t* x) {
  const auto madd = [x](__m256i v, int k) {
    return _mm256_madd_epi16(v, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16 * k)));
  };
  return _mm256_add_epi32(_mm256_add_epi32(madd(w.v0, 0), madd(w.v1, 1)),
                          _mm256_add_epi32(madd(w.v2, 2), madd(w.v3, 3)));
}

template <int NR, int NT>
static inline void gemm_i32_block(const int8_t* w, int64_t in, const int16_t* x, int64_t x_stride, int32_t* y,
                                  int64_t y_stride) {
  __m256i acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_setzero_si256();
  int64_t c = 0;
  for (; c + 64 <= in; c += 64) {
    for (int r = 0; r < NR; ++r)  // as the W8A16 GEMV above
      _mm_prefetch(reinterpret_cast<const char*>(w + r * in + c) + KILN_WEIGHT_PREFETCH_BYTES, KILN_WEIGHT_PREFETCH);
    for (int r = 0; r < NR; ++r) {
      const Widened64 wv = widen64(w + r * in + c);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm256_add_epi32(acc[r][t], madd64(wv, x + t * x_stride + c));
    }
  }
  for (; c + 16 <= in; c += 16) {
    for (int r = 0; r < NR; ++r) {
      const __m256i wv = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * in + c)));
      for (int t = 0; t < NT; ++t)
        acc[r][t] = _mm256_add_epi32(acc[r][t], _mm256_madd_epi16(wv, _mm256_loadu_si256(
                                                                        reinterpret_cast<const __m256i*>(x + t * x_stride + c))));
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      y[t * y_stride + r] = hsum8_epi32(acc[r][t]) + dot_i32_tail(w + r * in, x + t * x_stride, c, in);
}

// One row at a time for a single token: four interleaved rows starve the memory stream on AVX2 (a
// 98304x576 weight streamed at 21 GB/s against 15 through the int16 GEMV below; int8_sq's cold decode sweep
// in scripts/bench_plugins.py: 8.8-8.9 ms at four rows, 7.0-7.6 at one). int4's int16 GEMV also takes one
// row at a time (int4_kernels.h).
template <int NT>
struct RowsPerBlock { static constexpr int value = NT <= 2 ? NT : 1; };

// int8_linear's generation phase with bfloat16 x: x as block floating point int16 (int16_activations.h,
// blocks of kInt16BlockCols columns) and VPMADDWD against the sign-extended weights, 16 weights per
// widening, multiply-add and add (the float32 GEMV above needs a widening, a conversion and an FMA per 8).
// Exact int32 sums within a block (at most 2^25 per lane), then times the block's 2^e in float32; the
// weight scale is the epilogue's, as for the float32 GEMV.
//   x16 [T, in] int16, rows x_stride apart;  x_scale [T, in / kInt16BlockCols] float32
constexpr int64_t kInt16BlockCols = 64;  // madd64's columns

template <int NR, int NT>
static inline void gemv_int16_block(const int8_t* w, int64_t in, const int16_t* x, int64_t x_stride, const float* x_scale,
                                    float* y, int64_t y_stride) {
  const int64_t num_blocks = in / kInt16BlockCols;
  __m256 total[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) total[r][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t c0 = b * kInt16BlockCols;
    for (int r = 0; r < NR; ++r)
      _mm_prefetch(reinterpret_cast<const char*>(w + r * in + c0) + KILN_WEIGHT_PREFETCH_BYTES, KILN_WEIGHT_PREFETCH);
    for (int r = 0; r < NR; ++r) {
      const Widened64 wv = widen64(w + r * in + c0);
      for (int t = 0; t < NT; ++t)
        total[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(madd64(wv, x + t * x_stride + c0)),
                                      _mm256_set1_ps(x_scale[t * num_blocks + b]), total[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * y_stride + r] = hsum8(total[r][t]);
}

template <int NT>
static inline void gemv_int16_rows_nt(const int8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const int16_t* x,
                                      int64_t x_stride, const float* x_scale, float* y, int64_t y_stride) {
  constexpr int NR = RowsPerBlock<NT>::value;
  int64_t r = row_begin;
  for (; r + NR <= row_end; r += NR) gemv_int16_block<NR, NT>(w + r * in, in, x, x_stride, x_scale, y + r, y_stride);
  for (; r < row_end; ++r) gemv_int16_block<1, NT>(w + r * in, in, x, x_stride, x_scale, y + r, y_stride);
}

// y[t, r] = sum_c x[t, c] * q[r, c] for rows [row_begin, row_end) and every token; in % kInt16BlockCols == 0.
static void gemv_int16_rows(const int8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const int16_t* x,
                            int64_t num_tokens, int64_t x_stride, const float* x_scale, float* y, int64_t y_stride) {
  const int64_t num_blocks = in / kInt16BlockCols;
  int64_t t = 0;
  for (; t + 4 <= num_tokens; t += 4)
    gemv_int16_rows_nt<4>(w, in, row_begin, row_end, x + t * x_stride, x_stride, x_scale + t * num_blocks, y + t * y_stride, y_stride);
  if (num_tokens - t >= 2) {
    gemv_int16_rows_nt<2>(w, in, row_begin, row_end, x + t * x_stride, x_stride, x_scale + t * num_blocks, y + t * y_stride, y_stride);
    t += 2;
  }
  if (t < num_tokens)
    gemv_int16_rows_nt<1>(w, in, row_begin, row_end, x + t * x_stride, x_stride, x_scale + t * num_blocks, y + t * y_stride, y_stride);
}

#else  // ------------------------------------------------------------------------------ portable scalar

static void quantize_int8_rows(const float* x, int64_t n, float scale, int16_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = quantize_int8_scalar(x[i], scale);
}

static float amax_abs(const float* x, int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = amax < __builtin_fabsf(x[i]) ? __builtin_fabsf(x[i]) : amax;
  return amax;
}

template <int NR, int NT>
static inline void gemv_f32_block(const int8_t* w, int64_t in, const float* x, int64_t x_stride, float* y,
                                  int64_t y_stride) {
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * y_stride + r] = dot_f32_tail(w + r * in, x + t * x_stride, 0, in);
}

template <int NR, int NT>
static inline void gemm_i32_block(const int8_t* w, int64_t in, const int16_t* x, int64_t x_stride, int32_t* y,
                                  int64_t y_stride) {
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * y_stride + r] = dot_i32_tail(w + r * in, x + t * x_stride, 0, in);
}

template <int NT>
struct RowsPerBlock { static constexpr int value = 1; };

#endif

struct F32Gemv {  // W8A16 micro-kernel
  template <int NR, int NT>
  static void block(const int8_t* w, int64_t in, const float* x, int64_t x_stride, float* y, int64_t y_stride) {
    gemv_f32_block<NR, NT>(w, in, x, x_stride, y, y_stride);
  }
};

struct I32Gemm {  // W8A8 micro-kernel
  template <int NR, int NT>
  static void block(const int8_t* w, int64_t in, const int16_t* x, int64_t x_stride, int32_t* y, int64_t y_stride) {
    gemm_i32_block<NR, NT>(w, in, x, x_stride, y, y_stride);
  }
};

template <class Kernel, int NT, class XT, class YT>
static inline void rows_for_tokens(const int8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const XT* x,
                                   int64_t x_stride, YT* y, int64_t y_stride) {
  constexpr int NR = RowsPerBlock<NT>::value;
  int64_t r = row_begin;
  for (; r + NR <= row_end; r += NR) Kernel::template block<NR, NT>(w + r * in, in, x, x_stride, y + r, y_stride);
  for (; r < row_end; ++r) Kernel::template block<1, NT>(w + r * in, in, x, x_stride, y + r, y_stride);
}

// y[t, r] = sum_c x[t, c] * q[r, c] for rows [row_begin, row_end) and every token (float32 for W8A16,
// exact int32 for W8A8): tokens in blocks of 4 (then 2, 1), and for each token block every NR-row block
// of the range, so a thread's few rows stay in cache across token blocks.
template <class Kernel, class XT, class YT>
static void rows_times_tokens(const int8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const XT* x,
                              int64_t num_tokens, int64_t x_stride, YT* y, int64_t y_stride) {
  int64_t t = 0;
  for (; t + 4 <= num_tokens; t += 4)
    rows_for_tokens<Kernel, 4>(w, in, row_begin, row_end, x + t * x_stride, x_stride, y + t * y_stride, y_stride);
  if (num_tokens - t >= 2) {
    rows_for_tokens<Kernel, 2>(w, in, row_begin, row_end, x + t * x_stride, x_stride, y + t * y_stride, y_stride);
    t += 2;
  }
  if (t < num_tokens)
    rows_for_tokens<Kernel, 1>(w, in, row_begin, row_end, x + t * x_stride, x_stride, y + t * y_stride, y_stride);
}

static void gemv_f32_rows(const int8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const float* x,
                          int64_t num_tokens, int64_t x_stride, float* y, int64_t y_stride) {
  rows_times_tokens<F32Gemv>(w, in, row_begin, row_end, x, num_tokens, x_stride, y, y_stride);
}

static void gemm_i32_rows(const int8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const int16_t* x,
                          int64_t num_tokens, int64_t x_stride, int32_t* y, int64_t y_stride) {
  rows_times_tokens<I32Gemm>(w, in, row_begin, row_end, x, num_tokens, x_stride, y, y_stride);
}

#endif  // KILN_ISA == KILN_ISA_GENERIC || KILN_ISA == KILN_ISA_AVX2 || KILN_ISA == KILN_ISA_AVX512

#if KILN_ISA == KILN_ISA_AVX2
#include "int16_quantize.h"
#elif KILN_ISA == KILN_ISA_AVX512_BF16
#include "fp8_bf16_gemm.h"
#include "bf16_tile.h"
#include "bf16_gemv.h"

// int8_linear, generation phase, bfloat16 x: y[t, o] = sum * scale[o] (+ bias[o]) for rows [r0, r1), the
// products of x and q exact in VDPBF16PS and summed in float32 (as int8_linear_tiled_bf16).
void gemv_int8_rows(const uint16_t* xb, int64_t num_tokens, const int8_t* w, int64_t out_features, int64_t in,
                    const float* scale, const float* bias, uint16_t* out, int64_t r0, int64_t r1) {
  gemv_any_rows(xb, num_tokens, in, PlainRows<Int8Weights>{w, in}, out_features, in, r0, r1,
                GemvEpilogue(out, out_features, bias, scale));
}
#elif KILN_ISA == KILN_ISA_AVX512_VNNI
#include "int8_vnni_gemm.h"
#elif KILN_ISA == KILN_ISA_AMX_BF16
#include "amx_tiles.h"
#include "int8_amx_gemm.h"
#endif
