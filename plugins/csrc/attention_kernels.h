// Raw attention kernels of kilnlm::paged_attention, compiled per ISA by isa_variants.h (see there for the
// rules a kernel header follows): portable scalar, AVX2 and AVX-512 versions, chosen at run time, and an
// AMX copy: the AVX-512 code plus AMX tiles for bf16 activations with a bf16 or 8-bit pool
// (amx_attend_block; an 8-bit pool's codes are converted to bf16, exactly, as they are read).
// `AttnWork` is defined by the including file, outside the ISA namespaces, with store_output (the
// output's dtype conversion, shared with the split-KV merge).

#if KILN_ISA == KILN_ISA_GENERIC || KILN_ISA == KILN_ISA_AVX2 || KILN_ISA == KILN_ISA_AVX512 || \
    KILN_ISA == KILN_ISA_AVX512_BF16 || KILN_ISA == KILN_ISA_AMX_BF16

// KV elements are float (float32 pool), uint16_t (bfloat16 bits), uint8_t (float8_e4m3fn bits) or int8_t
// (int8 pool); kv_f32() reads one as float32 (exact: bf16 bits are a float's upper half).
//
// 8-bit pools hold quantized values (stored = x / scale, see paged_attention.cpp); the kernels read the
// stored value, never the scale: the caller folds k_scale into the query and v_scale into the output.
// An FP8 element reads as 2^-8 times its E4M3 value (the byte placed into IEEE half bits, exactly as the
// AVX2 / AVX-512 loads convert it with F16C; see fp8_kernels.h), so its caller folds 256 * scale.
// E4M3FN NaN encodings (0x7F / 0xFF) never occur: the writer saturates at +-448.
static inline float kv_f32(float v) { return v; }
static inline float kv_f32(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}
static inline float kv_f32(int8_t v) { return static_cast<float>(v); }
static inline float kv_f32(uint8_t v) {  // 2^-8 * E4M3 value, exact
  const uint32_t exponent = (v >> 3) & 0xFu, mantissa = v & 0x7u;
  float f;
  if (exponent == 0) {
    f = static_cast<float>(mantissa) * 7.62939453125e-06f;  // subnormal: m / 8 * 2^-6 * 2^-8 = m * 2^-17
  } else {
    const uint32_t bits = ((exponent + 112u) << 23) | (mantissa << 20);  // 2^(e - 7 - 8) * (1 + m / 8)
    __builtin_memcpy(&f, &bits, sizeof(f));
  }
  return (v & 0x80u) ? -f : f;
}

// The query heads of one GQA group read the same K and V rows. On AVX2, kGroupHeads of them at a time are
// scored and accumulated together (group_scores, group_pv), so that each row is loaded and converted once
// for all of them rather than once per head: SmolLM2's groups of 3 load K and V a third as often (a decode
// call at KV 192, one thread, cache-hot: 16.5 -> 10.2 us). Scratch holds that many heads' block scores.
constexpr int64_t kGroupHeads = 3;
// Rows of block scores the scratch holds: kGroupHeads heads (AVX2) or kTileQueries query vectors (AVX-512).
constexpr int64_t kScoreRows = 4;
// Tiles of 16 query vectors the AMX path takes through each phase of a 32-key step together (amx_attend_block).
constexpr int64_t kAmxPhaseTiles = 4;

#if KILN_ISA == KILN_ISA_AVX512 || KILN_ISA == KILN_ISA_AVX512_BF16 || KILN_ISA == KILN_ISA_AMX_BF16

static inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
static inline __m512 load16(const uint16_t* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(u, 16));
}
static inline __m512 load16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// FP8 bytes -> half bits (2^-8 * value) -> float32. Sign-extending to 16 bits and shifting left by 7 gives
// `s s eeee mmm 0000000`; clearing bit 14 leaves the half `s 0 eeee mmm 0000000`.
static inline __m512 load16(const uint8_t* p) {
  const __m256i u = _mm256_slli_epi16(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 7);
  return _mm512_cvtph_ps(_mm256_and_si256(u, _mm256_set1_epi16(static_cast<short>(0xBFFF))));
}

template <typename kv_t>
static inline float dot(const float* a, const kv_t* b, int64_t n) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), s0);
    s1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), load16(b + i + 16), s1);
  }
  for (; i + 16 <= n; i += 16) s0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), s0);
  float r = _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
  for (; i < n; ++i) r += a[i] * kv_f32(b[i]);
  return r;
}

template <typename kv_t>
static inline void axpy(float alpha, const kv_t* x, float* y, int64_t n) {
  const __m512 a = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(a, load16(x + i), _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * kv_f32(x[i]);
}

static inline void scale_f32(float alpha, float* y, int64_t n) {
  const __m512 a = _mm512_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, _mm512_mul_ps(a, _mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] *= alpha;
}

// exp(x) for x <= 0: the AVX2 version's algorithm on 16 lanes.
static inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  x = _mm512_min_ps(x, _mm512_set1_ps(88.0f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(e));
}

// Horizontal sums of 16 accumulators at once (transpose-and-add tree): out[o] = sum of a[o]'s lanes.
__attribute__((always_inline)) static inline void reduce16_rows(const __m512* a, float* out) {
  __m512 x[8], y[4];
  for (int m = 0; m < 8; ++m)  // 128-bit lanes: [a2m (l0+l2), a2m (l1+l3), a2m+1 (l0+l2), a2m+1 (l1+l3)]
    x[m] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int p = 0; p < 4; ++p)  // lane j: a 4-float partial of a[4p + j]
    y[p] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0x88),
                         _mm512_shuffle_f32x4(x[2 * p], x[2 * p + 1], 0xDD));
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(y[0], y[1]), _mm512_unpackhi_ps(y[0], y[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(y[2], y[3]), _mm512_unpackhi_ps(y[2], y[3]));
  const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
  const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23));
  // lane j holds the totals of a[j], a[4 + j], a[8 + j], a[12 + j]: reorder to a[0..15]
  const __m512 z = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(order, z));
}

// s[o] = dot(q, k_o) for the n rows k_o = k + o * row_stride, sixteen rows at a time.
template <typename kv_t>
static inline void block_scores(const float* q, const kv_t* k, int64_t row_stride, int64_t n, int64_t D, float* s) {
  int64_t o = 0;
  if (D % 16 == 0) {
    for (; o + 16 <= n; o += 16) {
      __m512 acc[16];
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; d += 16) {
        const __m512 qv = _mm512_loadu_ps(q + d);
        for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(qv, load16(k + (o + r) * row_stride + d), acc[r]);
      }
      reduce16_rows(acc, s + o);
    }
  }
  for (; o < n; ++o) s[o] = dot(q, k + o * row_stride, D);
}

static inline float block_exp(float* s, float m, int64_t n) {
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum = _mm512_setzero_ps();
  int64_t o = 0;
  for (; o + 16 <= n; o += 16) {
    const __m512 p = exp_ps(_mm512_sub_ps(_mm512_loadu_ps(s + o), mv));
    _mm512_storeu_ps(s + o, p);
    sum = _mm512_add_ps(sum, p);
  }
  float total = _mm512_reduce_add_ps(sum);
  for (; o < n; ++o) {
    s[o] = __builtin_expf(s[o] - m);
    total += s[o];
  }
  return total;
}

// acc[0:D] += sum_o p[o] * v_o, 128 columns of acc held in registers across the rows.
template <typename kv_t>
static inline void block_pv(const float* p, const kv_t* v, int64_t row_stride, int64_t n, int64_t D, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    __m512 a[4];
    for (int c = 0; c < 4; ++c) a[c] = _mm512_loadu_ps(acc + d0 + 16 * c);
    for (int64_t o = 0; o < n; ++o) {
      const __m512 pv = _mm512_set1_ps(p[o]);
      const kv_t* row = v + o * row_stride + d0;
      for (int c = 0; c < 4; ++c) a[c] = _mm512_fmadd_ps(pv, load16(row + 16 * c), a[c]);
    }
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc + d0 + 16 * c, a[c]);
  }
  if (d0 < D)
    for (int64_t o = 0; o < n; ++o) axpy(p[o], v + o * row_stride + d0, acc + d0, D - d0);
}

// dst[0:n] = kv_f32(src[0:n]), sixteen at a time.
template <typename kv_t>
static inline void to_f32(const kv_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, load16(src + i));
  for (; i < n; ++i) dst[i] = kv_f32(src[i]);
}

#elif KILN_ISA == KILN_ISA_AVX2

static inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
static inline __m256 load8(const uint16_t* p) {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
static inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
static inline __m256 load8(const uint8_t* p) {  // FP8 bytes -> half bits -> float32, as load16 (AVX-512)
  const __m128i u = _mm_slli_epi16(_mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))), 7);
  return _mm256_cvtph_ps(_mm_and_si128(u, _mm_set1_epi16(static_cast<short>(0xBFFF))));
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

template <typename kv_t>
static inline float dot(const float* a, const kv_t* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), load8(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), s0);
  float r = hsum8(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) r += a[i] * kv_f32(b[i]);
  return r;
}

// y += alpha * x
template <typename kv_t>
static inline void axpy(float alpha, const kv_t* x, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, load8(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * kv_f32(x[i]);
}

static inline void scale_f32(float alpha, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(a, _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] *= alpha;
}

// exp(x) for x <= 0 (scores minus their running max), Cephes-style: 2^n * P(r), r = x - n ln2,
// degree-5 polynomial; relative error ~2e-7 (about a float32 ulp). Inputs below -87 give ~0.
static inline __m256 exp_ps(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
  x = _mm256_min_ps(x, _mm256_set1_ps(88.0f));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// s[o] = dot(q, k_o) for the n rows k_o = k + o * row_stride (D elements each). Eight rows at a time
// with eight independent accumulators reduced together (no horizontal sum per score).
template <typename kv_t>
static inline void block_scores(const float* q, const kv_t* k, int64_t row_stride, int64_t n, int64_t D, float* s) {
  int64_t o = 0;
  if (D % 8 == 0) {
    for (; o + 8 <= n; o += 8) {
      __m256 acc[8];
      for (int r = 0; r < 8; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int r = 0; r < 8; ++r) acc[r] = _mm256_fmadd_ps(qv, load8(k + (o + r) * row_stride + d), acc[r]);
      }
      const __m256 t0 = _mm256_hadd_ps(acc[0], acc[1]), t1 = _mm256_hadd_ps(acc[2], acc[3]);
      const __m256 t2 = _mm256_hadd_ps(acc[4], acc[5]), t3 = _mm256_hadd_ps(acc[6], acc[7]);
      const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
      _mm256_storeu_ps(s + o, _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31)));
    }
  }
  for (; o < n; ++o) s[o] = dot(q, k + o * row_stride, D);
}

// s[o] = exp(s[o] - m) for o < n; returns their sum.
static inline float block_exp(float* s, float m, int64_t n) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  int64_t o = 0;
  for (; o + 8 <= n; o += 8) {
    const __m256 p = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(s + o), mv));
    _mm256_storeu_ps(s + o, p);
    sum = _mm256_add_ps(sum, p);
  }
  float total = hsum8(sum);
  for (; o < n; ++o) {
    s[o] = __builtin_expf(s[o] - m);
    total += s[o];
  }
  return total;
}

// acc[0:D] += sum_o p[o] * v_o, 64 columns of acc held in registers across the rows.
template <typename kv_t>
static inline void block_pv(const float* p, const kv_t* v, int64_t row_stride, int64_t n, int64_t D, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    __m256 a[8];
    for (int c = 0; c < 8; ++c) a[c] = _mm256_loadu_ps(acc + d0 + 8 * c);
    for (int64_t o = 0; o < n; ++o) {
      const __m256 pv = _mm256_set1_ps(p[o]);
      const kv_t* row = v + o * row_stride + d0;
      for (int c = 0; c < 8; ++c) a[c] = _mm256_fmadd_ps(pv, load8(row + 8 * c), a[c]);
    }
    for (int c = 0; c < 8; ++c) _mm256_storeu_ps(acc + d0 + 8 * c, a[c]);
  }
  if (d0 < D)
    for (int64_t o = 0; o < n; ++o) axpy(p[o], v + o * row_stride + d0, acc + d0, D - d0);
}

// dst[0:n] = kv_f32(src[0:n]), eight at a time.
template <typename kv_t>
static inline void to_f32(const kv_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8(src + i));
  for (; i < n; ++i) dst[i] = kv_f32(src[i]);
}

// s[h * s_stride + o] = dot(q + h * D, k_o) for G heads (query vectors D floats apart) and the n rows
// k_o = k + o * row_stride; D % 8 == 0. Four rows x G heads of accumulators, reduced as block_scores'.
template <int G, typename kv_t>
static inline void group_scores(const float* q, const kv_t* k, int64_t row_stride, int64_t n, int64_t D, float* s,
                                int64_t s_stride) {
  int64_t o = 0;
  for (; o + 4 <= n; o += 4) {
    __m256 acc[G][4];
    for (int h = 0; h < G; ++h)
      for (int r = 0; r < 4; ++r) acc[h][r] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 qv[G];
      for (int h = 0; h < G; ++h) qv[h] = _mm256_loadu_ps(q + h * D + d);
      for (int r = 0; r < 4; ++r) {
        const __m256 kv = load8(k + (o + r) * row_stride + d);
        for (int h = 0; h < G; ++h) acc[h][r] = _mm256_fmadd_ps(qv[h], kv, acc[h][r]);
      }
    }
    for (int h = 0; h < G; ++h) {
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(acc[h][0], acc[h][1]), _mm256_hadd_ps(acc[h][2], acc[h][3]));
      _mm_storeu_ps(s + h * s_stride + o, _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
    }
  }
  for (; o < n; ++o)
    for (int h = 0; h < G; ++h) s[h * s_stride + o] = dot(q + h * D, k + o * row_stride, D);
}

// max(s[0:n], floor) (floor: the running max, -inf on the first block)
static inline float block_max_from(const float* s, int64_t n, float floor) {
  __m256 mv = _mm256_set1_ps(floor);
  int64_t o = 0;
  for (; o + 8 <= n; o += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + o));
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  float r = _mm_cvtss_f32(x);
  for (; o < n; ++o) r = s[o] > r ? s[o] : r;
  return r;
}

// acc[h * D + d] += sum_o p[h * p_stride + o] * v_o[d] for G heads; D % 32 == 0. 32 columns of the G
// heads' outputs held in registers across the rows.
template <int G, typename kv_t>
static inline void group_pv(const float* p, int64_t p_stride, const kv_t* v, int64_t row_stride, int64_t n, int64_t D,
                            float* acc) {
  for (int64_t d0 = 0; d0 < D; d0 += 32) {
    __m256 a[G][4];
    for (int h = 0; h < G; ++h)
      for (int c = 0; c < 4; ++c) a[h][c] = _mm256_loadu_ps(acc + h * D + d0 + 8 * c);
    for (int64_t o = 0; o < n; ++o) {
      __m256 pv[G];
      for (int h = 0; h < G; ++h) pv[h] = _mm256_broadcast_ss(p + h * p_stride + o);
      const kv_t* row = v + o * row_stride + d0;
      for (int c = 0; c < 4; ++c) {
        const __m256 x = load8(row + 8 * c);
        for (int h = 0; h < G; ++h) a[h][c] = _mm256_fmadd_ps(pv[h], x, a[h][c]);
      }
    }
    for (int h = 0; h < G; ++h)
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + h * D + d0 + 8 * c, a[h][c]);
  }
}

#else  // portable scalar path

template <typename kv_t>
static inline void to_f32(const kv_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = kv_f32(src[i]);
}

template <typename kv_t>
static inline float dot(const float* a, const kv_t* b, int64_t n) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * kv_f32(b[i]);
    s1 += a[i + 1] * kv_f32(b[i + 1]);
    s2 += a[i + 2] * kv_f32(b[i + 2]);
    s3 += a[i + 3] * kv_f32(b[i + 3]);
  }
  for (; i < n; ++i) s0 += a[i] * kv_f32(b[i]);
  return (s0 + s1) + (s2 + s3);
}

static inline void scale_f32(float alpha, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
}

template <typename kv_t>
static inline void block_scores(const float* q, const kv_t* k, int64_t row_stride, int64_t n, int64_t D, float* s) {
  for (int64_t o = 0; o < n; ++o) s[o] = dot(q, k + o * row_stride, D);
}

static inline float block_exp(float* s, float m, int64_t n) {
  float total = 0.f;
  for (int64_t o = 0; o < n; ++o) {
    s[o] = __builtin_expf(s[o] - m);
    total += s[o];
  }
  return total;
}

template <typename kv_t>
static inline void block_pv(const float* p, const kv_t* v, int64_t row_stride, int64_t n, int64_t D, float* acc) {
  for (int64_t o = 0; o < n; ++o)
    for (int64_t d = 0; d < D; ++d) acc[d] += p[o] * kv_f32(v[o * row_stride + d]);
}

#endif

// One work item: the query vectors of `num_q_tokens` consecutive new tokens of one sequence, for query
// heads [head_begin, head_end) (query head h reads KV head h / group), over that sequence's paged KV.
// Flash-style online softmax over the KV blocks (Milakov & Gimelshein 2018, "Online normalizer
// calculation for softmax"; Dao et al. 2022, FlashAttention): per query vector a running max m, running
// sum l and unnormalized output acc; no [T, T] score matrix is ever built. Each KV block is visited once
// per item, for all the item's heads, while its rows are in cache; K/V are read in the pool's dtype.
//
//   KV position p of the sequence:   block_table[p / tokens_per_block], offset p % tokens_per_block
//   query token qi sits at position  first_q_pos + qi and sees KV positions 0..first_q_pos + qi
//
// An item may cover only the KV blocks [kv_block_begin, kv_block_end): one part of a sequence whose KV was
// split between threads (split-KV, as flash-decoding: Dao et al. 2023). It then leaves m, l and acc in
// `partial` for the caller to merge instead of writing the output.
//
// scratch: at least attn_scratch_floats(M, D, tokens_per_block, kv_row_stride) floats.
static inline int64_t attn_scratch_floats(int64_t M, int64_t D, int64_t tpb, int64_t kv_row_stride) {
  // + the AMX path's buffers (packed Q^T tiles, V tiles, scores, P, outputs), whatever the ISA: one
  // formula sizes every variant
  return M * (D + 2) + kScoreRows * tpb + 2 * tpb * kv_row_stride + (M + 16 * (kv_row_stride / D)) * D / 2 + 16 * D +
         kAmxPhaseTiles * (512 + 256 + 16 * D) + 256;
}

// The online-softmax step of one query vector for a block's scores s[0:n], m_new being their max with the
// running max m: rescales the running sum l and output acc[0:D] if the max grew, turns s into
// probabilities and adds them to l.
static inline void softmax_update(float* s, int64_t n, float m_new, float& m, float& l, float* acc, int64_t D) {
  if (m_new != m) {
    const float alpha = __builtin_expf(m - m_new);  // 0 on the first block (m = -inf)
    l *= alpha;
    scale_f32(alpha, acc, D);
    m = m_new;
  }
  l += block_exp(s, m_new, n);
}

// softmax_update for one query vector's block scores s[0:n], the running max m raised to their largest.
static inline void softmax_update_block(float* s, int64_t n, float& m, float& l, float* acc, int64_t D) {
  float block_max = -__builtin_inff();
  for (int64_t o = 0; o < n; ++o) block_max = s[o] > block_max ? s[o] : block_max;
  softmax_update(s, n, block_max > m ? block_max : m, m, l, acc, D);
}

#if KILN_ISA == KILN_ISA_AVX2
// A block for G query heads of one GQA group (query vectors, running max / sum and outputs consecutive per
// head): scores all G together, updates each head's softmax state, adds all G outputs together.
// s: [G, tpb] scratch.
template <int G, typename kv_t>
static inline void attend_group(const float* q, const kv_t* k, const kv_t* v, int64_t row_stride, int64_t n, int64_t D,
                                int64_t tpb, float* s, float* m, float* l, float* acc) {
  group_scores<G>(q, k, row_stride, n, D, s, tpb);
  for (int j = 0; j < G; ++j)
    softmax_update(s + j * tpb, n, block_max_from(s + j * tpb, n, m[j]), m[j], l[j], acc + j * D, D);
  group_pv<G>(s, tpb, v, row_stride, n, D, acc);
}
#endif

// Query vectors reading each KV row of one KV head (the item's query tokens x its query heads sharing
// that KV head) from which the item's KV heads' rows of a 16/8-bit block are converted to float32 once
// rather than converted on every read. A generation-phase item over one KV head of SmolLM2 reads each
// row 3 times (its GQA group); converting for it measured 1.25-1.5x slower than reading the pool's dtype
// three times.
constexpr int64_t kConvertMinQueries = 8;

#if KILN_ISA == KILN_ISA_AVX512 || KILN_ISA == KILN_ISA_AVX512_BF16 || KILN_ISA == KILN_ISA_AMX_BF16
// The context phase on AVX-512: the query vectors that see a whole KV block (every query token past the
// block's last position) go through it kTileQueries at a time, so that each K and V row loaded serves all
// of them (per 16 FMAs, 8 loads instead of 17 for the scores and 20 for the outputs). Each (query, key) dot
// product and each output sum keeps block_scores' and block_pv's arithmetic (the same FMA chain per lane,
// and reduce16_rows sums every accumulator by the same tree), so the results are bitwise those of one
// query vector at a time and never depend on how a batch was split between items.
constexpr int kTileQueries = 4;
static_assert(kTileQueries <= kScoreRows, "the scratch holds a tile's scores");

// s[j * s_stride + o] = dot(q[j], k_o) for j < NQ and o < n (n and D multiples of 16): up to 4 query
// vectors x 4 keys per 16-accumulator reduction (the accumulators of absent query vectors stay zero).
template <int NQ, typename kv_t>
static inline void tile_scores(const float* const* q, const kv_t* k, int64_t row_stride, int64_t n, int64_t D,
                               float* s, int64_t s_stride) {
  for (int64_t o = 0; o < n; o += 4) {
    __m512 acc[16];
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; d += 16) {
      __m512 kv[4];
      for (int r = 0; r < 4; ++r) kv[r] = load16(k + (o + r) * row_stride + d);
      for (int j = 0; j < NQ; ++j) {
        const __m512 qv = _mm512_loadu_ps(q[j] + d);
        for (int r = 0; r < 4; ++r) acc[4 * j + r] = _mm512_fmadd_ps(qv, kv[r], acc[4 * j + r]);
      }
    }
    alignas(64) float out[16];
    reduce16_rows(acc, out);
    for (int j = 0; j < NQ; ++j)
      for (int r = 0; r < 4; ++r) s[j * s_stride + o + r] = out[4 * j + r];
  }
}

// acc[j][0:D] += sum_o p[j * p_stride + o] * v_o for j < NQ: block_pv's arithmetic, NQ outputs per V row.
template <int NQ, typename kv_t>
static inline void tile_pv(const float* p, int64_t p_stride, const kv_t* v, int64_t row_stride, int64_t n, int64_t D,
                           float* const* acc) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) {
    __m512 a[NQ][4];
    for (int j = 0; j < NQ; ++j)
      for (int c = 0; c < 4; ++c) a[j][c] = _mm512_loadu_ps(acc[j] + d0 + 16 * c);
    for (int64_t o = 0; o < n; ++o) {
      const kv_t* row = v + o * row_stride + d0;
      __m512 vv[4];
      for (int c = 0; c < 4; ++c) vv[c] = load16(row + 16 * c);
      for (int j = 0; j < NQ; ++j) {
        const __m512 pv = _mm512_set1_ps(p[j * p_stride + o]);
        for (int c = 0; c < 4; ++c) a[j][c] = _mm512_fmadd_ps(pv, vv[c], a[j][c]);
      }
    }
    for (int j = 0; j < NQ; ++j)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(acc[j] + d0 + 16 * c, a[j][c]);
  }
  if (d0 < D)
    for (int j = 0; j < NQ; ++j)
      for (int64_t o = 0; o < n; ++o) axpy(p[j * p_stride + o], v + o * row_stride + d0, acc[j] + d0, D - d0);
}

// One whole block of n keys for NQ query vectors q[0..NQ-1], whose softmax state and output are m[idx[j]],
// l[idx[j]] and acc + idx[j] * D. s: [kTileQueries, tpb] scratch.
template <int NQ, typename kv_t>
static inline void attend_tile(const float* const* q, const int64_t* idx, const kv_t* k, const kv_t* v,
                               int64_t row_stride, int64_t n, int64_t D, int64_t tpb, float* s, float* m, float* l,
                               float* acc) {
  tile_scores<NQ>(q, k, row_stride, n, D, s, tpb);
  float* outputs[NQ];
  for (int j = 0; j < NQ; ++j) {
    const int64_t i = idx[j];
    outputs[j] = acc + i * D;
    softmax_update_block(s + j * tpb, n, m[i], l[i], outputs[j], D);
  }
  tile_pv<NQ>(s, tpb, v, row_stride, n, D, outputs);
}

// The query vectors of heads [h_begin, h_end) (of the item's) for query tokens [qi_begin, num_q_tokens),
// all of which see the whole block of n keys, kTileQueries at a time.
template <typename kv_t>
static inline void attend_full_block(const AttnWork& w, const kv_t* k_head, const kv_t* v_head, int64_t row_stride,
                                     int64_t n, int64_t qi_begin, int64_t h_begin, int64_t h_end, float* m, float* l,
                                     float* acc, float* s) {
  const int64_t D = w.head_dim, num_heads_item = w.head_end - w.head_begin;
  const float* q[kTileQueries];
  int64_t idx[kTileQueries];
  int nq = 0;
  const auto flush = [&]() {
    switch (nq) {
      case 4: attend_tile<4>(q, idx, k_head, v_head, row_stride, n, D, w.tokens_per_block, s, m, l, acc); break;
      case 3: attend_tile<3>(q, idx, k_head, v_head, row_stride, n, D, w.tokens_per_block, s, m, l, acc); break;
      case 2: attend_tile<2>(q, idx, k_head, v_head, row_stride, n, D, w.tokens_per_block, s, m, l, acc); break;
      default: attend_tile<1>(q, idx, k_head, v_head, row_stride, n, D, w.tokens_per_block, s, m, l, acc); break;
    }
    nq = 0;
  };
  for (int64_t qi = qi_begin; qi < w.num_q_tokens; ++qi)
    for (int64_t h = h_begin; h < h_end; ++h) {
      q[nq] = w.q + qi * w.q_tok_stride + h * D;
      idx[nq++] = qi * num_heads_item + h;
      if (nq == kTileQueries) flush();
    }
  if (nq > 0) flush();
}
#endif

// The item's query heads that read KV head kv_head (its GQA group), item-relative: [begin, end).
struct GroupHeads {
  int64_t begin, end;
};
static inline GroupHeads group_heads(const AttnWork& w, int64_t kv_head) {
  return {(kv_head * w.group > w.head_begin ? kv_head * w.group : w.head_begin) - w.head_begin,
          ((kv_head + 1) * w.group < w.head_end ? (kv_head + 1) * w.group : w.head_end) - w.head_begin};
}

// The online-softmax update with one KV block of num_block_tokens tokens starting at KV position
// base_pos, for the item's query vectors of KV head kv_head; k_head / v_head: that head's slice of the
// block's first row, consecutive rows row_stride elements apart.
template <typename kv_t>
static inline void attend_block(const AttnWork& w, int64_t kv_head, const kv_t* k_head, const kv_t* v_head,
                                int64_t row_stride, int64_t base_pos, int64_t num_block_tokens, float* m, float* l,
                                float* acc, float* s) {
  const int64_t D = w.head_dim, num_heads_item = w.head_end - w.head_begin;
  const GroupHeads heads = group_heads(w, kv_head);
  const int64_t h_begin = heads.begin, h_end = heads.end;
  int64_t qi_end = w.num_q_tokens;  // query tokens [0, qi_end) go one vector at a time
#if KILN_ISA == KILN_ISA_AVX512 || KILN_ISA == KILN_ISA_AVX512_BF16 || KILN_ISA == KILN_ISA_AMX_BF16
  if (D % 16 == 0 && num_block_tokens % 16 == 0) {
    // Query tokens from first_full on see all num_block_tokens keys (causal: q_pos >= the block's last).
    const int64_t first_full = base_pos + num_block_tokens - 1 - w.first_q_pos;
    qi_end = first_full > 0 ? (first_full < w.num_q_tokens ? first_full : w.num_q_tokens) : 0;
    if (qi_end < w.num_q_tokens)
      attend_full_block(w, k_head, v_head, row_stride, num_block_tokens, qi_end, h_begin, h_end, m, l, acc, s);
  }
#endif
  for (int64_t qi = 0; qi < qi_end; ++qi) {
    const int64_t q_pos = w.first_q_pos + qi;
    int64_t num_valid = q_pos - base_pos + 1;  // causal: KV positions <= q_pos
    if (num_valid <= 0) continue;
    if (num_valid > num_block_tokens) num_valid = num_block_tokens;
#if KILN_ISA == KILN_ISA_AVX2
    if (D % 32 == 0) {
      static_assert(kGroupHeads == 3, "attend_group is instantiated for 1..3 heads");
      for (int64_t h0 = h_begin; h0 < h_end; h0 += kGroupHeads) {
        const int64_t i0 = qi * num_heads_item + h0;
        const float* q0 = w.q + qi * w.q_tok_stride + h0 * D;
        const auto run = [&](auto heads) {
          attend_group<decltype(heads)::value>(q0, k_head, v_head, row_stride, num_valid, D, w.tokens_per_block, s,
                                                m + i0, l + i0, acc + i0 * D);
        };
        const int64_t g = (h_end - h0) < kGroupHeads ? (h_end - h0) : kGroupHeads;
        if (g == 3) run(std::integral_constant<int, 3>{});
        else if (g == 2) run(std::integral_constant<int, 2>{});
        else run(std::integral_constant<int, 1>{});
      }
      continue;
    }
#endif
    for (int64_t h = h_begin; h < h_end; ++h) {
      const int64_t i = qi * num_heads_item + h;
      const float* qv = w.q + qi * w.q_tok_stride + h * D;
      block_scores(qv, k_head, row_stride, num_valid, D, s);
      float* a = acc + i * D;
      softmax_update_block(s, num_valid, m[i], l[i], a, D);
      block_pv(s, v_head, row_stride, num_valid, D, a);
    }
  }
}

#if KILN_ISA == KILN_ISA_AVX512_BF16 || KILN_ISA == KILN_ISA_AMX_BF16
// 32 consecutive KV elements as bfloat16: a bf16 pool's as they are, an 8-bit pool's converted exactly
// (load16 reads the stored value, an FP8 one as 2^-8 times it (see kv_f32), whose 8 or 4 significant bits
// bfloat16 holds).
static inline __m512i load32_bf16(const uint16_t* p) { return _mm512_loadu_si512(p); }
// FP8 directly into bfloat16 bits, in 16-bit lanes (7 instructions per 32 elements; through float32 they
// took 12, and made an FP8 pool's decode 0.75x a bf16 pool's against int8's 0.96x). E4M3 `s eeee mmm` with
// e > 0 is 2^(e - 7) * (1 + m / 8), so 2^-8 times it is the bfloat16 `s (e + 112) mmm0000`: the byte's low
// seven bits shifted left by 4, plus 112 << 7. Exponent 0 (zero and the subnormals m * 2^-9, i.e.
// m * 2^-17 after the 2^-8) is the 8-entry table below, indexed by m, the lane's low bits; the sign is then
// bit 15 of the sign-extended byte.
static inline __m512i load32_bf16(const uint8_t* p) {
  const __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i normal = _mm512_add_epi16(_mm512_and_si512(_mm512_slli_epi16(w, 4), _mm512_set1_epi16(0x07F0)),
                                          _mm512_set1_epi16(112 << 7));
  const __mmask32 tiny = _mm512_testn_epi16_mask(w, _mm512_set1_epi16(0x78));  // exponent 0
  const __m512i subnormal = _mm512_zextsi128_si512(  // m * 2^-17
      _mm_setr_epi16(0, 0x3700, 0x3780, 0x37C0, 0x3800, 0x3820, 0x3840, 0x3860));
  const __m512i magnitude = _mm512_mask_permutexvar_epi16(normal, tiny, w, subnormal);
  return _mm512_ternarylogic_epi32(magnitude, w, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xD8);  // c ? b : a
}
template <typename kv_t>
static inline __m512i load32_bf16(const kv_t* p) {
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(load16(p + 16), load16(p)));
}

// dst[r * span + c] = src[r * row_stride + c] as bfloat16 for r < rows, c < span (a multiple of 32): an
// 8-bit block's K (and, off AMX, V) rows.
template <typename kv_t>
static inline void rows_to_bf16(const kv_t* src, int64_t row_stride, uint16_t* dst, int64_t span, int64_t rows) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < span; c += 32) _mm512_storeu_si512(dst + r * span + c, load32_bf16(src + r * row_stride + c));
}

#endif

// Prefetches of one cache line into L1 (prefetcht0) and into L2 (prefetcht1) that the compiler keeps. GCC
// (12, -O3, C++20) deletes a loop whose body only prefetches: __builtin_prefetch has no side effect, and
// -ffinite-loops lets it assume the loop ends. That had removed every block prefetch of this file.
static inline void prefetch_l1(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p);
#endif
}
static inline void prefetch_l2(const void* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// The next KV block's K and V lines, prefetched into L2 a few at a time by the VDPBF16PS loops while they
// read the current block: step() at each 4 keys scored and each 8 keys of P . V, finish() for whatever is
// left when the block is done (the float32 paths' prefetch_share finishes one share of a block at once).
// An empty one (end 0) prefetches nothing. Spread this finely, the prefetches overlap the block's
// arithmetic (attend_typed's prefetch_share has the coarser schedules' figures); 2 or 4 lines a step left
// part of each block to finish() and measured 55 and 41-43 ms there, 8 lines 36-48.
struct NextBlockPrefetch {
  static constexpr int kLinesPerStep = 6;  // of K and of V: 36 steps of a 3-head item cover a 12 KB block
  const char* k = nullptr;
  const char* v = nullptr;
  int64_t offset = 0;  // bytes of K (and of V) prefetched so far
  int64_t end = 0;     // bytes of K (and of V) in the block
  inline void step() {
    for (int i = 0; i < kLinesPerStep && offset < end; ++i, offset += 64) {
      prefetch_l2(k + offset);
      prefetch_l2(v + offset);
    }
  }
  inline void finish() {
    for (; offset < end; offset += 64) {
      prefetch_l2(k + offset);
      prefetch_l2(v + offset);
    }
  }
};

#if KILN_ISA == KILN_ISA_AVX512_BF16
// The VDPBF16PS path (AVX512-BF16 without AMX, e.g. AMD Zen 4): bfloat16 activations with a bfloat16 or
// 8-bit pool, in both phases, whatever the block size (even). As on AMX, each query vector is rounded to
// bfloat16 once per item (as the bf16 model's own q is) and the probabilities are rounded to bfloat16
// for P . V (as FlashAttention's bf16 kernels feed P to the tensor cores); an 8-bit pool's codes are
// converted to bfloat16 exactly as they are read (load32_bf16), or once per block into a buffer for an item
// of many query vectors (rows_to_bf16). VDPBF16PS multiplies bf16 pairs into float32 lanes:
//   a score: per 32 dims one VDPBF16PS of the query's and the key's bf16 into the (query, key)'s
//     accumulator, its 16 lanes then summed by reduce16_rows' tree;
//   the output: per pair of keys (o, o + 1) one VDPBF16PS of the broadcast probability pair into each
//     32-column chunk's two accumulators, whose lanes hold V's two rows interleaved by unpacklo / hi_epi16
//     (columns 0-3, 8-11, 16-19, 24-27 and 4-7, 12-15, 20-23, 28-31 of the chunk; put back in order as
//     they are stored); an odd count's last pair takes probability 0 and a zero row.
// Per key and KV head of a 3-head GQA group that is about half the float32 kernel's instructions (no
// widening of K and V, half the multiply-adds): on an AMD Zen 4, one thread, a 256-token chunk after 256
// cached positions 3.2-3.5 ms against 4.0 (bf16 pool), batch-1 decode at 512 positions 20-21 us against
// 25-26; batch-32 decode is bound by the pool's bytes either way. Every (query vector, key) score and
// every output sum is computed by the same chain whatever tile holds the query vector (1 to kTileQueries
// of them) and whatever item holds it, so a query's result is the same bits alone, in a batch, in a decode
// step or in a context chunk (batch invariance; speculative verification sums as decoding does).

static inline __m512 dp_bf16(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(a), reinterpret_cast<__m512bh>(b));
}

// s[j * s_stride + o] = q[j] . k_o for j < NQ, o < n (keys k_o = k + o * k_stride, in the pool's dtype, read
// as bf16 by load32_bf16; q bf16; D % 32 == 0). kRows keys per reduction: 16 for one query vector, 4 for
// up to 4.
template <int NQ, int kRows, bool kFull, typename kv_t>
__attribute__((always_inline)) static inline void dp_scores_rows(const uint16_t* const* q, const kv_t* k,
                                                                 int64_t k_stride, int64_t o, int rows, int64_t D,
                                                                 float* s, int64_t s_stride, NextBlockPrefetch& pf) {
  pf.step();
  __m512 acc[16];
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    __m512i kv[kRows];
    for (int r = 0; r < kRows; ++r)
      if (kFull || r < rows) kv[r] = load32_bf16(k + (o + r) * k_stride + d);
    for (int j = 0; j < NQ; ++j) {
      const __m512i qv = _mm512_loadu_si512(q[j] + d);
      for (int r = 0; r < kRows; ++r)
        if (kFull || r < rows) acc[kRows * j + r] = dp_bf16(acc[kRows * j + r], qv, kv[r]);
    }
  }
  alignas(64) float out[16];
  reduce16_rows(acc, out);
  for (int j = 0; j < NQ; ++j)
    for (int r = 0; r < kRows; ++r)
      if (kFull || r < rows) s[j * s_stride + o + r] = out[kRows * j + r];
}

template <int NQ, typename kv_t>
static inline void dp_scores(const uint16_t* const* q, const kv_t* k, int64_t k_stride, int64_t n, int64_t D,
                             float* s, int64_t s_stride, NextBlockPrefetch& pf) {
  static_assert(NQ >= 1 && NQ <= 4, "16 accumulators per reduction");
  constexpr int kRows = NQ == 1 ? 16 : 4;
  int64_t o = 0;
  for (; o + kRows <= n; o += kRows) dp_scores_rows<NQ, kRows, true>(q, k, k_stride, o, kRows, D, s, s_stride, pf);
  if (o < n) dp_scores_rows<NQ, kRows, false>(q, k, k_stride, o, static_cast<int>(n - o), D, s, s_stride, pf);
}

// p[0:n] (float32, in place) -> bfloat16 bits at the same address, and a zero after them when n is odd
// (the last pair's second probability). Writes end at or before the floats still to read.
static inline void dp_round_probs(float* p, int64_t n) {
  uint16_t* out = reinterpret_cast<uint16_t*>(p);
  for (int64_t o = 0; o < n; o += 16) {
    const int64_t left = n - o, pairs = left >= 16 ? 16 : (left + 1) & ~static_cast<int64_t>(1);
    const __mmask16 valid = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, p + o)));
    _mm256_mask_storeu_epi16(out + o, static_cast<__mmask16>(pairs >= 16 ? 0xFFFF : (1u << pairs) - 1), bits);
  }
}

// acc[j][d0 : d0 + 32 * kChunks] += sum_o p[j][o] * v_o for j < NQ (p: bf16 bits, zero past n when n is
// odd; v rows in the pool's dtype, v_stride apart).
template <int NQ, int kChunks, typename kv_t>
static inline void dp_pv_cols(const uint16_t* const* p, const kv_t* v, int64_t v_stride, int64_t n, int64_t d0,
                              float* const* acc, NextBlockPrefetch& pf) {
  const __m512i to_lo = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
  const __m512i to_hi = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  __m512 a[NQ][2 * kChunks];
  for (int j = 0; j < NQ; ++j)
    for (int c = 0; c < kChunks; ++c) {
      const __m512 x = _mm512_loadu_ps(acc[j] + d0 + 32 * c), y = _mm512_loadu_ps(acc[j] + d0 + 32 * c + 16);
      a[j][2 * c] = _mm512_permutex2var_ps(x, to_lo, y);
      a[j][2 * c + 1] = _mm512_permutex2var_ps(x, to_hi, y);
    }
  for (int64_t o = 0; o < n; o += 2) {
    if (o % 8 == 0) pf.step();
    const kv_t* row = v + o * v_stride + d0;
    __m512i vv[2 * kChunks];
    for (int c = 0; c < kChunks; ++c) {
      const __m512i ra = load32_bf16(row + 32 * c);
      const __m512i rb = o + 1 < n ? load32_bf16(row + v_stride + 32 * c) : _mm512_setzero_si512();
      vv[2 * c] = _mm512_unpacklo_epi16(ra, rb);
      vv[2 * c + 1] = _mm512_unpackhi_epi16(ra, rb);
    }
    for (int j = 0; j < NQ; ++j) {
      uint32_t pair;
      __builtin_memcpy(&pair, p[j] + o, sizeof(pair));
      const __m512i pv = _mm512_set1_epi32(static_cast<int>(pair));
      for (int c = 0; c < 2 * kChunks; ++c) a[j][c] = dp_bf16(a[j][c], pv, vv[c]);
    }
  }
  for (int j = 0; j < NQ; ++j)
    for (int c = 0; c < kChunks; ++c) {
      _mm512_storeu_ps(acc[j] + d0 + 32 * c, _mm512_permutex2var_ps(a[j][2 * c], first_half, a[j][2 * c + 1]));
      _mm512_storeu_ps(acc[j] + d0 + 32 * c + 16, _mm512_permutex2var_ps(a[j][2 * c], second_half, a[j][2 * c + 1]));
    }
}

template <int NQ, typename kv_t>
static inline void dp_pv(const uint16_t* const* p, const kv_t* v, int64_t v_stride, int64_t n, int64_t D,
                         float* const* acc, NextBlockPrefetch& pf) {
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64) dp_pv_cols<NQ, 2>(p, v, v_stride, n, d0, acc, pf);
  if (d0 < D) dp_pv_cols<NQ, 1>(p, v, v_stride, n, d0, acc, pf);
}

// n keys (K and V rows in the pool's dtype or bf16, kv_stride apart) for the NQ query vectors q[j] (bf16)
// whose softmax state and output are m[idx[j]], l[idx[j]] and acc + idx[j] * D. s: [kTileQueries, tpb]
// scratch.
template <int NQ, typename kv_t>
static inline void dp_attend_tile(const uint16_t* const* q, const int64_t* idx, const kv_t* k, const kv_t* v,
                                  int64_t kv_stride, int64_t n, int64_t D, int64_t tpb, float* s, float* m, float* l,
                                  float* acc, NextBlockPrefetch& pf) {
  dp_scores<NQ>(q, k, kv_stride, n, D, s, tpb, pf);
  float* outputs[NQ];
  const uint16_t* probs[NQ];
  for (int j = 0; j < NQ; ++j) {
    const int64_t i = idx[j];
    outputs[j] = acc + i * D;
    softmax_update_block(s + j * tpb, n, m[i], l[i], outputs[j], D);
    dp_round_probs(s + j * tpb, n);
    probs[j] = reinterpret_cast<const uint16_t*>(s + j * tpb);
  }
  dp_pv<NQ>(probs, v, kv_stride, n, D, outputs, pf);
}

// Up to kTileQueries query vectors at a time, each seeing the same n keys.
template <typename kv_t>
struct DpTile {
  const uint16_t* q[kTileQueries];
  int64_t idx[kTileQueries];
  int count = 0;
  void flush(const kv_t* k, const kv_t* v, int64_t kv_stride, int64_t n, int64_t D, int64_t tpb, float* s,
             float* m, float* l, float* acc, NextBlockPrefetch& pf) {
    switch (count) {
      case 4: dp_attend_tile<4>(q, idx, k, v, kv_stride, n, D, tpb, s, m, l, acc, pf); break;
      case 3: dp_attend_tile<3>(q, idx, k, v, kv_stride, n, D, tpb, s, m, l, acc, pf); break;
      case 2: dp_attend_tile<2>(q, idx, k, v, kv_stride, n, D, tpb, s, m, l, acc, pf); break;
      case 1: dp_attend_tile<1>(q, idx, k, v, kv_stride, n, D, tpb, s, m, l, acc, pf); break;
      default: break;
    }
    count = 0;
  }
};

// The item's query vectors as bfloat16 (nearest even): qb[i * D ...] for vector i = token * heads + head.
static inline void dp_pack_queries(const AttnWork& w, uint16_t* qb) {
  const int64_t D = w.head_dim, heads = w.head_end - w.head_begin;
  for (int64_t qi = 0; qi < w.num_q_tokens; ++qi)
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = w.q + qi * w.q_tok_stride + h * D;
      uint16_t* dst = qb + (qi * heads + h) * D;
      for (int64_t d = 0; d < D; d += 32)
        _mm512_storeu_si512(dst + d, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + d + 16),
                                                                                     _mm512_loadu_ps(q + d))));
    }
}

// attend_block on this path: the block's num_block_tokens keys from KV position base_pos for the item's
// query vectors of KV head kv_head (qb: dp_pack_queries'; k_head / v_head: rows kv_stride apart).
// Query tokens that see the whole block go kTileQueries vectors at a time across tokens; the others, each
// token's heads together over the keys that token sees.
template <typename kv_t>
static inline void dp_attend_block(const AttnWork& w, int64_t kv_head, const uint16_t* qb, const kv_t* k_head,
                                   const kv_t* v_head, int64_t kv_stride, int64_t base_pos,
                                   int64_t num_block_tokens, float* m, float* l, float* acc, float* s,
                                   NextBlockPrefetch& pf) {
  const int64_t D = w.head_dim, tpb = w.tokens_per_block, num_heads_item = w.head_end - w.head_begin;
  const GroupHeads heads = group_heads(w, kv_head);
  // query tokens from first_full on see all num_block_tokens keys (causal: q_pos >= the block's last)
  const int64_t first_full = base_pos + num_block_tokens - 1 - w.first_q_pos;
  const int64_t qi_end = first_full > 0 ? (first_full < w.num_q_tokens ? first_full : w.num_q_tokens) : 0;
  DpTile<kv_t> tile;
  const auto flush = [&](int64_t n) { tile.flush(k_head, v_head, kv_stride, n, D, tpb, s, m, l, acc, pf); };
  // query token qi's vectors into the tile, which runs whenever it is full (over n keys)
  const auto add_token = [&](int64_t qi, int64_t n) {
    for (int64_t h = heads.begin; h < heads.end; ++h) {
      const int64_t i = qi * num_heads_item + h;
      tile.q[tile.count] = qb + i * D;
      tile.idx[tile.count++] = i;
      if (tile.count == kTileQueries) flush(n);
    }
  };
  for (int64_t qi = qi_end; qi < w.num_q_tokens; ++qi) add_token(qi, num_block_tokens);
  flush(num_block_tokens);
  for (int64_t qi = 0; qi < qi_end; ++qi) {
    const int64_t num_valid = w.first_q_pos + qi - base_pos + 1;  // causal: KV positions <= q_pos
    if (num_valid <= 0) continue;
    add_token(qi, num_valid);
    flush(num_valid);
  }
}
#endif

#if KILN_ISA == KILN_ISA_AMX_BF16
// The AMX path: bfloat16 activations with a bfloat16 pool, or an 8-bit one (an engine of any format),
// on AMX tiles, in both phases, for blocks of a multiple of 32 tokens. An 8-bit pool's elements are
// converted to bfloat16 as they are read (load32_bf16; exact), K's rows into a buffer first (rows_to_bf16)
// since the A tiles load rows; its scales fold as on the other paths (k_scale rounds to bf16 with the
// query, v_scale multiplies the output). Per KV block, KV head and
// 32 keys, up to 16 query vectors of its GQA group at a time:
//   scores, transposed: S^T [keys, queries] = K . Q^T -- K's rows are the A tiles, loaded as they are
//     (16 keys x 32 dims, rows k_stride apart); Q^T is packed once per item into bf16-pair B
//     tiles, each query vector rounded to bfloat16 (as the bf16 model's own q is); S^T is transposed back
//     in registers, one query vector's 32 scores per two vectors;
//   the online softmax per query vector (Milakov & Gimelshein 2018), over the keys it sees;
//   P . V -- the probabilities rounded to bfloat16 (as FlashAttention's bf16 kernels feed P to the
//     tensor cores) as A tiles of 16 query vectors x 32 keys, V's rows interleaved in key pairs as B
//     tiles; the block's product goes into the running output as acc * alpha + PV.
// Every number a query vector gets is computed from its own row or lane only, by the same tiles whatever
// else shares them and whatever item holds it: a query's result is the same bits alone, in a batch, in a
// decode step or in a context chunk (batch invariance; speculative verification sums as decoding does).
// Keys a query may not see (causal, past the block's tokens) get probability exactly 0, adding nothing.
#include "amx_tiles.h"

constexpr int64_t kAmxKeys = 32;  // keys per step: one A tile of P

// v rounded to bfloat16 precision (nearest even), as float32.
static inline __m512 amx_round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF),
                                                           _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// The query vectors of one KV head in an item: j-th = (query token j / heads, head h_begin + j % heads).
struct AmxQueries {
  int64_t h_begin, heads, count;  // item-relative heads [h_begin, h_begin + heads), count = tokens * heads
  uint32_t* packed;               // [ceil(count / 16)][D / 32][16 pairs][16 queries] Q^T B tiles
};

// The item's query vectors of KV head kv_head, their tiles at `packed`.
static inline AmxQueries amx_queries(const AttnWork& w, int64_t kv_head, uint32_t* packed) {
  const GroupHeads heads = group_heads(w, kv_head);
  AmxQueries g;
  g.h_begin = heads.begin;
  g.heads = heads.end - heads.begin;
  g.count = w.num_q_tokens * g.heads;
  g.packed = packed;
  return g;
}

// u32 of the packed Q^T tiles of g.
static inline int64_t amx_queries_size(const AmxQueries& g, int64_t D) { return (g.count + 15) / 16 * (D / 32) * 256; }

// Packs g's query vectors (amx_queries) into its Q^T B tiles (bfloat16, rounded to nearest even by
// VCVTNE2PS2BF16), zero past g.count: per 16 vectors and 32 dims, their bf16 pairs transposed. Query token
// qi's row: q_rows[qi] where given (a SharedUnit's tokens of several items), else w.q + qi * w.q_tok_stride.
static inline void amx_pack_queries(const AttnWork& w, const AmxQueries& g, const float* const* q_rows = nullptr) {
  const int64_t D = w.head_dim, steps = D / 32;
  for (int64_t j0 = 0; j0 < g.count; j0 += 16)
    for (int64_t s = 0; s < steps; ++s) {
      __m512 v[16];
      for (int64_t j = 0; j < 16; ++j) {
        if (j0 + j < g.count) {
          const int64_t qi = (j0 + j) / g.heads, h = g.h_begin + (j0 + j) % g.heads;
          const float* q = (q_rows != nullptr ? q_rows[qi] : w.q + qi * w.q_tok_stride) + h * D + 32 * s;
          v[j] = reinterpret_cast<__m512>(_mm512_cvtne2ps_pbh(_mm512_loadu_ps(q + 16), _mm512_loadu_ps(q)));
        } else {
          v[j] = _mm512_setzero_ps();
        }
      }
      transpose16x16(v);
      float* tile = reinterpret_cast<float*>(g.packed + ((j0 / 16) * steps + s) * 256);
      for (int p = 0; p < 16; ++p) _mm512_store_ps(tile + 16 * p, v[p]);
    }
}

// V's B tiles interleave two key rows with unpacklo / unpackhi_epi16, which leaves the 16 columns of a
// tile in the order 0-3, 8-11, 16-19, 24-27 (tile 2c) and 4-7, 12-15, 20-23, 28-31 (tile 2c + 1) of
// the 32 dims 32c..; the output's columns are put back in order as they are added to acc.
// vp [D / 16][16 key pairs][16] u32 <- 32 V rows of one KV head from v_rows (row_stride apart; zero past
// the first nk), as bf16.
template <typename kv_t>
static inline void amx_pack_v(const kv_t* v_rows, int64_t row_stride, int64_t nk, int64_t D, uint32_t* vp) {
  for (int64_t p = 0; p < 16; ++p)
    for (int64_t c = 0; c < D / 32; ++c) {
      const __m512i a = 2 * p < nk ? load32_bf16(v_rows + 2 * p * row_stride + 32 * c) : _mm512_setzero_si512();
      const __m512i b = 2 * p + 1 < nk ? load32_bf16(v_rows + (2 * p + 1) * row_stride + 32 * c) : _mm512_setzero_si512();
      _mm512_store_si512(vp + ((2 * c) * 16 + p) * 16, _mm512_unpacklo_epi16(a, b));
      _mm512_store_si512(vp + ((2 * c + 1) * 16 + p) * 16, _mm512_unpackhi_epi16(a, b));
    }
}

// Per thread, per call (AttnWork::call_id): the full KV blocks this thread has read twice, each KV head's K
// rows as bf16 (an 8-bit pool's; a bf16 pool's are read in place) and V as packed B tiles, so that a block
// many sequences share (a common prompt prefix from the prefix cache) is converted and packed once per
// thread, not once per sequence. A block seen once is prepared in the item's own scratch as before: a
// block only one sequence reads costs a tag write, and never evicts a block this call has prepared. The
// pool is not written during the attention phase (rope_and_write_kv runs first), so an entry holds for
// the rest of its call; a later call's id differs. Direct-mapped, a power-of-two number of entries (up to
// 64, at least 4) of 2 * tpb * D bf16 each, up to kAmxCacheBytes per thread (L2-resident).
constexpr int64_t kAmxCacheBytes = 512 * 1024;
struct AmxBlockTag {
  const void* k_block;
  int64_t head;
  uint64_t call;
  int64_t times_seen;  // 1: seen, not prepared; 2: prepared
};
struct AmxBlockCache {
  AmxBlockTag* tags;
  uint16_t* data;
  int64_t num_entries, entry_elems;
};

static inline AmxBlockCache amx_block_cache(int64_t tpb, int64_t D) {
  AmxBlockCache c;
  c.entry_elems = 2 * tpb * D;
  c.num_entries = 4;
  while (c.num_entries < 64 && 2 * c.num_entries * c.entry_elems * 2 <= kAmxCacheBytes) c.num_entries *= 2;
  const int64_t tag_floats = (c.num_entries * static_cast<int64_t>(sizeof(AmxBlockTag)) + 63) / 64 * 16;
  float* buffer = kiln::thread_scratch<9>(tag_floats + c.num_entries * c.entry_elems / 2);
  thread_local const float* cleared = nullptr;  // the buffer whose tags are valid, and their count
  thread_local int64_t cleared_entries = 0;
  c.tags = reinterpret_cast<AmxBlockTag*>(buffer);
  if (buffer != cleared || cleared_entries != c.num_entries) {
    for (int64_t i = 0; i < c.num_entries; ++i) c.tags[i] = AmxBlockTag{nullptr, 0, 0, 0};
    cleared = buffer;
    cleared_entries = c.num_entries;
  }
  c.data = reinterpret_cast<uint16_t*>(buffer + tag_floats);
  return c;
}

// KV head `head` of the full block at k_block / v_block from c: its K rows ([tpb][D] bf16, 8-bit pools) then
// its V tiles ([tpb / 32] x amx_pack_v's), prepared on the block's second sight in call `call`; null on the
// first (the caller prepares it in its scratch).
template <typename kv_t>
static inline const uint16_t* amx_cached_block(const AmxBlockCache& c, const kv_t* k_block, const kv_t* v_block,
                                               int64_t head, int64_t row_stride, int64_t tpb, int64_t D, uint64_t call) {
  const uint64_t h = (static_cast<uint64_t>(reinterpret_cast<uintptr_t>(k_block)) ^
                      static_cast<uint64_t>(head) * 0xC2B2AE3D27D4EB4Full) * 0x9E3779B97F4A7C15ull;
  const int64_t i = static_cast<int64_t>(h >> 40) & (c.num_entries - 1);
  AmxBlockTag& t = c.tags[i];
  uint16_t* entry = c.data + i * c.entry_elems;
  if (t.k_block != k_block || t.head != head || t.call != call) {
    if (t.call != call || t.times_seen != 2) t = AmxBlockTag{k_block, head, call, 1};  // keeps this call's prepared
    return nullptr;
  }
  if (t.times_seen == 1) {
    if (sizeof(kv_t) == 1) rows_to_bf16(k_block + head * D, row_stride, entry, D, tpb);
    uint32_t* v_tiles = reinterpret_cast<uint32_t*>(entry + tpb * D);
    for (int64_t kb = 0; kb < tpb; kb += kAmxKeys)
      amx_pack_v(v_block + head * D + kb * row_stride, row_stride, kAmxKeys, D, v_tiles + (kb / kAmxKeys) * (D / 16) * 256);
    t.times_seen = 2;
  }
  return entry;
}

// amx_attend_block's scratch (vp, st, pa, ob: see there), laid out from `after`, the end of the packed
// Q^T tiles (64-byte aligned).
struct AmxStepBuffers {
  uint32_t* vp;
  float* st;
  uint16_t* pa;
  float* ob;
};
static inline AmxStepBuffers amx_step_buffers(uint32_t* after, int64_t D) {
  float* st = reinterpret_cast<float*>(after + 16 * D);
  return {after, st, reinterpret_cast<uint16_t*>(st + kAmxPhaseTiles * 512), st + kAmxPhaseTiles * (512 + 256)};
}

// One KV block (n keys from KV position base_pos; k_head: its first K row's slice of this KV head in
// bf16, rows k_stride apart; v_head: the V row's in the pool's dtype, rows row_stride apart, or v_ready:
// its V tiles, amx_pack_v's for each 32 keys, already packed) for the query vectors g; m, l, acc: the
// item's softmax state (vector i = query token * heads of the item + head). Scratch, 64-byte aligned: vp
// [D / 16][16][16] u32, and for each of kAmxPhaseTiles tiles of 16 query vectors st [32][16] float, pa
// [16][32] bfloat16 and ob [D / 16][16][16] float.
//
// Each 32-key step takes up to kAmxPhaseTiles tiles of query vectors through four phases in turn: their
// scores (tile products, stored), their softmax (vector code on the stored scores, P stored as bf16),
// P . V (tile products of the stored P, stored) and the running outputs' update (vector code). A tile
// load of what vector stores have just written, or a vector load of a tile store's output, waits for the
// stores to complete; one query tile at a time, every step waited four times so (on the Xeon with AMX the
// two tile products right after such a load held ~18% of the kernel's samples in a 128-token prefill).
// Between phases, the other tiles' work now covers that wait. Each query vector's arithmetic and its order
// are unchanged: the same bits.
template <typename kv_t>
static inline void amx_attend_block(const AttnWork& w, const AmxQueries& g, const uint16_t* k_head, int64_t k_stride,
                                    const kv_t* v_head, const uint32_t* v_ready, int64_t row_stride, int64_t base_pos,
                                    int64_t n, float* m, float* l, float* acc, uint32_t* vp, float* st, uint16_t* pa,
                                    float* ob) {
  const int64_t D = w.head_dim, steps = D / 32, num_heads_item = w.head_end - w.head_begin;
  const int64_t stride_bytes = k_stride * 2;
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  alignas(64) float alpha[kAmxPhaseTiles][16];
  int64_t idx[kAmxPhaseTiles][16];
  uint32_t seen[kAmxPhaseTiles];
  for (int64_t kb = 0; kb < n; kb += kAmxKeys) {
    const int64_t nk = n - kb < kAmxKeys ? n - kb : kAmxKeys;  // valid keys of this step
    const uint16_t* k_rows = k_head + kb * k_stride;
    const uint32_t* vt = vp;  // V rows kb.. as B tiles: prepared by the caller, or packed here
    if (v_ready != nullptr) {
      vt = v_ready + (kb / kAmxKeys) * (D / 16) * 256;
    } else {
      amx_pack_v(v_head + kb * row_stride, row_stride, nk, D, vp);
    }
    for (int64_t p0 = 0; p0 < g.count; p0 += 16 * kAmxPhaseTiles) {
      const int64_t p_end = g.count - p0 < 16 * kAmxPhaseTiles ? g.count : p0 + 16 * kAmxPhaseTiles;
      const int64_t tiles = (p_end - p0 + 15) / 16;
      // scores: S^T for keys kb.. (rows) x the tile's 16 query vectors (columns), rows 0-15 then 16-31
      for (int64_t t = 0; t < tiles; ++t) {
        const uint32_t* q_tiles = g.packed + (p0 / 16 + t) * steps * 256;
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t s = 0; s < steps; ++s) {
          _tile_loadd(4, q_tiles + s * 256, 64);
          _tile_loadd(2, k_rows + 32 * s, stride_bytes);
          _tile_dpbf16ps(0, 2, 4);
          if (nk > 16) {
            _tile_loadd(3, k_rows + 16 * k_stride + 32 * s, stride_bytes);
            _tile_dpbf16ps(1, 3, 4);
          }
        }
        _tile_stored(0, st + 512 * t, 64);
        _tile_stored(1, st + 512 * t + 256, 64);
      }
      // online softmax per query vector, over the keys it sees (causal, and only the block's n): S^T
      // transposed back, lo / hi[j] = query vector j0 + j's scores of keys kb..kb + 15 / kb + 16..kb + 31
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t j0 = p0 + 16 * t, nq = g.count - j0 < 16 ? g.count - j0 : 16;
        __m512 lo[16], hi[16];
        for (int r = 0; r < 16; ++r) {
          lo[r] = _mm512_load_ps(st + 512 * t + 16 * r);
          hi[r] = _mm512_load_ps(st + 512 * t + 256 + 16 * r);
        }
        transpose16x16(lo);
        transpose16x16(hi);
        seen[t] = 0;
        for (int64_t j = 0; j < 16; ++j) {
          __m512 p_lo = _mm512_setzero_ps(), p_hi = _mm512_setzero_ps();
          if (j < nq) {
            const int64_t qi = (j0 + j) / g.heads, h = g.h_begin + (j0 + j) % g.heads;
            const int64_t i = qi * num_heads_item + h;
            idx[t][j] = i;
            int64_t visible = w.first_q_pos + qi - (base_pos + kb) + 1;  // keys kb.. it sees
            visible = visible < 0 ? 0 : (visible > nk ? nk : visible);
            if (visible > 0) {
              seen[t] |= 1u << j;
              const __mmask16 k_lo = static_cast<__mmask16>(visible >= 16 ? 0xFFFF : (1u << visible) - 1);
              const __mmask16 k_hi =
                  static_cast<__mmask16>(visible >= 32 ? 0xFFFF : visible > 16 ? (1u << (visible - 16)) - 1 : 0);
              const __m512 none = _mm512_set1_ps(-__builtin_inff());
              const float top = _mm512_reduce_max_ps(
                  _mm512_max_ps(_mm512_mask_mov_ps(none, k_lo, lo[j]), _mm512_mask_mov_ps(none, k_hi, hi[j])));
              const float m_old = m[i], m_new = top > m_old ? top : m_old;
              // e^(m_old - m_new) where the max grew (0 for m_old = -inf: l and acc are 0 then), else 1
              alpha[t][j] = m_new != m_old ? _mm512_cvtss_f32(exp_ps(_mm512_set1_ps(m_old - m_new))) : 1.f;
              const __m512 mv = _mm512_set1_ps(m_new);
              p_lo = amx_round_bf16(_mm512_maskz_mov_ps(k_lo, exp_ps(_mm512_maskz_sub_ps(k_lo, lo[j], mv))));
              p_hi = amx_round_bf16(_mm512_maskz_mov_ps(k_hi, exp_ps(_mm512_maskz_sub_ps(k_hi, hi[j], mv))));
              m[i] = m_new;
              l[i] = __builtin_fmaf(l[i], alpha[t][j], _mm512_reduce_add_ps(_mm512_add_ps(p_lo, p_hi)));
            }
          }
          _mm512_store_si512(pa + 512 * t + 32 * j, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(p_hi, p_lo)));
        }
      }
      // P . V, 64 output columns (4 C tiles) at a time, into ob
      for (int64_t t = 0; t < tiles; ++t) {
        if (seen[t] == 0) continue;
        float* out = ob + 16 * D * t;
        _tile_loadd(4, pa + 512 * t, 64);
        for (int64_t c0 = 0; c0 < D / 16; c0 += 4) {
          const int64_t num_c = D / 16 - c0 < 4 ? D / 16 - c0 : 4;
          _tile_zero(0);
          _tile_zero(1);
          _tile_loadd(5, vt + (c0 + 0) * 256, 64);
          _tile_dpbf16ps(0, 4, 5);
          _tile_loadd(6, vt + (c0 + 1) * 256, 64);
          _tile_dpbf16ps(1, 4, 6);
          if (num_c > 2) {
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(7, vt + (c0 + 2) * 256, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, vt + (c0 + 3) * 256, 64);
            _tile_dpbf16ps(3, 4, 5);
          }
          _tile_stored(0, out + 256 * c0, 64);
          _tile_stored(1, out + 256 * (c0 + 1), 64);
          if (num_c > 2) {
            _tile_stored(2, out + 256 * (c0 + 2), 64);
            _tile_stored(3, out + 256 * (c0 + 3), 64);
          }
        }
      }
      // acc = acc * alpha + PV, C tiles c, c + 1: dims 16 * c .. + 31
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t nq = g.count - (p0 + 16 * t) < 16 ? g.count - (p0 + 16 * t) : 16;
        const float* out = ob + 16 * D * t;
        for (int64_t j = 0; j < nq; ++j) {
          if (!((seen[t] >> j) & 1)) continue;
          const __m512 al = _mm512_set1_ps(alpha[t][j]);
          for (int64_t c = 0; c < D / 16; c += 2) {
            float* a = acc + idx[t][j] * D + 16 * c;
            const __m512 x = _mm512_load_ps(out + 256 * c + 16 * j), y = _mm512_load_ps(out + 256 * (c + 1) + 16 * j);
            _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_loadu_ps(a), al, _mm512_permutex2var_ps(x, first_half, y)));
            _mm512_storeu_ps(a + 16, _mm512_fmadd_ps(_mm512_loadu_ps(a + 16), al, _mm512_permutex2var_ps(x, second_half, y)));
          }
        }
      }
    }
  }
}
#endif

// Prefetches every cache line of [p, p + num_bytes) into L1.
static inline void prefetch_lines(const char* p, int64_t num_bytes) {
  const uintptr_t end = reinterpret_cast<uintptr_t>(p) + static_cast<uintptr_t>(num_bytes);
  for (uintptr_t a = reinterpret_cast<uintptr_t>(p) & ~static_cast<uintptr_t>(63); a < end; a += 64)
    prefetch_l1(reinterpret_cast<const char*>(a));
}

template <typename kv_t>
static void attend_typed(const AttnWork& w, float* scratch) {
  const int64_t D = w.head_dim, tpb = w.tokens_per_block, row_stride = w.kv_row_stride;
  const int64_t num_heads_item = w.head_end - w.head_begin;
  const int64_t M = w.num_q_tokens * num_heads_item;  // query vectors in this item
  float* m = scratch;                                  // [M] running max
  float* l = m + M;                                    // [M] running sum of exp
  float* acc = l + M;                                  // [M, D] unnormalized output
  float* s = acc + M * D;                              // [kScoreRows, tpb] scores, then probabilities, of
                                                       //   one block (one row per vector scored together)
  float* k_f32 = s + kScoreRows * tpb;                 // [tpb, span] the item's KV heads' rows of a block,
  float* v_f32 = k_f32 + tpb * row_stride;             //   as float32 (span <= row_stride)
  if (w.init_m != nullptr) {  // the state after the blocks before kv_block_begin, shared with other items
    for (int64_t i = 0; i < M; ++i) {
      m[i] = w.init_m[i];
      l[i] = w.init_l[i];
    }
    for (int64_t i = 0; i < M * D; ++i) acc[i] = w.init_acc[i];
  } else {
    for (int64_t i = 0; i < M; ++i) {
      m[i] = -__builtin_inff();
      l[i] = 0.f;
    }
    for (int64_t i = 0; i < M * D; ++i) acc[i] = 0.f;
  }
  const int64_t kv_head_begin = w.head_begin / w.group, kv_head_end = (w.head_end - 1) / w.group + 1;
  const int64_t span = (kv_head_end - kv_head_begin) * D;  // elements of a row the item reads
  const int64_t reads_per_row = w.num_q_tokens * (num_heads_item < w.group ? num_heads_item : w.group);
  const bool convert = sizeof(kv_t) != sizeof(float) && reads_per_row >= kConvertMinQueries;

  const kv_t* k_pool = static_cast<const kv_t*>(w.k_base);
  const kv_t* v_pool = static_cast<const kv_t*>(w.v_base);
  const int64_t last_pos = w.first_q_pos + w.num_q_tokens - 1;
  const int64_t end_block = (last_pos / tpb + 1) < w.kv_block_end ? (last_pos / tpb + 1) : w.kv_block_end;
  // Block j's K and V rows (the item's slice of each), into L1. Blocks sit anywhere in the pool (paged)
  // and the hardware prefetcher only follows a block once it has started: the loop prefetches each next
  // block while it computes one (an item of every KV head through prefetch_share or NextBlockPrefetch
  // instead), and the first block is prefetched whole before the loop, so that its misses overlap instead
  // of coming one row at a time (a decode part reads only ~3 blocks).
  const auto prefetch_block = [&](int64_t j) {
    const int64_t first_row = static_cast<int64_t>(w.block_table[j]) * tpb;
    const int64_t num_rows = (last_pos + 1 - j * tpb) < tpb ? (last_pos + 1 - j * tpb) : tpb;
    const char* k_rows = reinterpret_cast<const char*>(k_pool + first_row * row_stride + kv_head_begin * D);
    const char* v_rows = reinterpret_cast<const char*>(v_pool + first_row * row_stride + kv_head_begin * D);
    const int64_t row_bytes = row_stride * static_cast<int64_t>(sizeof(kv_t));
    const int64_t span_bytes = span * static_cast<int64_t>(sizeof(kv_t));
    if (span == row_stride) {  // every KV head: the block's rows are contiguous
      for (int64_t b = 0; b < num_rows * row_bytes; b += 64) {
        prefetch_l1(k_rows + b);
        prefetch_l1(v_rows + b);
      }
    } else {  // only the slice of each row this item reads (other KV heads belong to other threads' items)
      const int64_t lead = static_cast<int64_t>(reinterpret_cast<uintptr_t>(k_rows) & 63);
      if (row_bytes % 64 == 0 && lead == static_cast<int64_t>(reinterpret_cast<uintptr_t>(v_rows) & 63)) {
        for (int64_t r = 0; r < num_rows; ++r)  // every row's slice starts `lead` bytes into a line
          for (int64_t b = r * row_bytes - lead; b < r * row_bytes + span_bytes; b += 64) {
            prefetch_l1(k_rows + b);
            prefetch_l1(v_rows + b);
          }
      } else {
        for (int64_t r = 0; r < num_rows; ++r) {
          prefetch_lines(k_rows + r * row_bytes, span_bytes);
          prefetch_lines(v_rows + r * row_bytes, span_bytes);
        }
      }
    }
  };
  // Share `part` of `num_parts` of block j's K and V rows (an item of every KV head: contiguous rows), into
  // L2. The float32 loops over KV heads below prefetch the next block this way, a head's share before each
  // head's tiles, rather than all of it at once; the VDPBF16PS loops spread it finer (NextBlockPrefetch).
  // On an AMD Zen 4 (batch-32 decode at 400 KV positions over a 30-layer pool on huge pages, one thread;
  // next block not prefetched / whole into L1 / shares into L2 / NextBlockPrefetch): VDPBF16PS 59-63 /
  // 52-65 / 48-57 / 34-35 ms, float32 AVX-512 61-92 / 55-57 / 47-50 ms, AVX2 71-76 / 64-67 / 54-55 ms.
  // Items of fewer KV heads prefetch their slice of each next block whole (prefetch_block).
  const bool by_shares = span == row_stride;
  const auto block_lines = [&](int64_t j) {  // all of block j's K and V rows, not yet prefetched
    NextBlockPrefetch lines;
    const int64_t row = static_cast<int64_t>(w.block_table[j]) * tpb;
    lines.k = reinterpret_cast<const char*>(k_pool + row * row_stride);
    lines.v = reinterpret_cast<const char*>(v_pool + row * row_stride);
    lines.end = tpb * row_stride * static_cast<int64_t>(sizeof(kv_t));
    return lines;
  };
  const auto prefetch_share = [&](int64_t j, int64_t part, int64_t num_parts) {
    NextBlockPrefetch lines = block_lines(j);
    const int64_t share = (lines.end + num_parts - 1) / num_parts, first = part * share;
    lines.offset = first & ~static_cast<int64_t>(63);
    if (first + share < lines.end) lines.end = first + share;
    lines.finish();
  };
#if KILN_ISA == KILN_ISA_AMX_BF16
  // bf16 activations with a bf16 or 8-bit pool: the AMX path. Its buffers follow the float32 rows it has
  // no use for; an 8-bit block's K rows, as bf16, take their place ([tpb, span]).
  const bool amx = sizeof(kv_t) <= 2 && w.out_bf16 && D % 32 == 0 && tpb % kAmxKeys == 0;
  uint16_t* k_bf16 = reinterpret_cast<uint16_t*>(k_f32);
  uint32_t* amx_q = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(v_f32 + tpb * row_stride) + 63) &
                                                ~static_cast<uintptr_t>(63));  // the sizes below keep 64 bytes
  int64_t amx_q_size = 0;
  AmxBlockCache block_cache{};
  if (amx) {
    block_cache = amx_block_cache(tpb, D);
    amx_configure_tiles();
    for (int64_t g = kv_head_begin; g < kv_head_end; ++g) {
      const AmxQueries queries = amx_queries(w, g, amx_q + amx_q_size);
      amx_pack_queries(w, queries);
      amx_q_size += amx_queries_size(queries, D);
    }
  }
  const AmxStepBuffers amx_buf = amx_step_buffers(amx_q + amx_q_size, D);
#endif
#if KILN_ISA == KILN_ISA_AVX512_BF16
  // bf16 activations with a bf16 or 8-bit pool: the VDPBF16PS path, for every item of such a call. Its
  // bf16 query vectors follow the float32 rows it has no use for; an 8-bit block's K and V rows, as bf16,
  // take their place ([tpb, span] each).
  const bool dpbf16 = sizeof(kv_t) <= 2 && w.out_bf16 && D % 32 == 0 && tpb % 2 == 0;
  uint16_t* dp_q = reinterpret_cast<uint16_t*>((reinterpret_cast<uintptr_t>(v_f32 + tpb * row_stride) + 63) &
                                               ~static_cast<uintptr_t>(63));
  if (dpbf16) dp_pack_queries(w, dp_q);
#endif
#if KILN_ISA == KILN_ISA_AMX_BF16
  // The AMX path prefetches nothing: on an Intel Xeon with AMX (family 6 model 207) the next block prefetched
  // into L2 whole, by KV heads' shares or spread over the softmax was no faster than none beyond the host's
  // swing (docs/performance.md, "Measured and left").
  const bool prefetching = !amx;
#else
  const bool prefetching = true;
#endif
  if (w.kv_block_begin < end_block && prefetching) prefetch_block(w.kv_block_begin);
  for (int64_t j = w.kv_block_begin; j < end_block; ++j) {
    const int64_t base_pos = j * tpb;
    const int64_t num_block_tokens = (last_pos + 1 - base_pos) < tpb ? (last_pos + 1 - base_pos) : tpb;
    const int64_t first_row = static_cast<int64_t>(w.block_table[j]) * tpb;  // pool row of offset 0
    const kv_t* k_block = k_pool + first_row * row_stride;
    const kv_t* v_block = v_pool + first_row * row_stride;
    if (j + 1 < end_block && prefetching && !by_shares) prefetch_block(j + 1);
    const auto prefetch_next = [&](int64_t g) {  // before KV head g's tiles
      if (j + 1 < end_block && prefetching && by_shares)
        prefetch_share(j + 1, g - kv_head_begin, kv_head_end - kv_head_begin);
    };
#if KILN_ISA == KILN_ISA_AMX_BF16
    if (amx) {
      // KV head g's K rows: at k_rows + (g - first_head) * D, k_stride apart (an 8-bit pool's converted to
      // bf16 first, when the first head not in the cache needs them); its V rows are read from the pool
      // (load32_bf16). A full block's second sight in this thread and call comes from the block cache.
      const uint16_t* k_rows = reinterpret_cast<const uint16_t*>(k_block);
      int64_t first_head = 0, k_stride = row_stride;
      bool k_ready = sizeof(kv_t) != 1;
      int64_t offset = 0;
      for (int64_t g = kv_head_begin; g < kv_head_end; ++g) {
        const AmxQueries queries = amx_queries(w, g, amx_q + offset);
        offset += amx_queries_size(queries, D);
        const uint16_t* cached = num_block_tokens == tpb ?
            amx_cached_block(block_cache, k_block, v_block, g, row_stride, tpb, D, w.call_id) : nullptr;
        if (cached != nullptr) {
          const uint16_t* k_head = sizeof(kv_t) == 1 ? cached : reinterpret_cast<const uint16_t*>(k_block) + g * D;
          amx_attend_block(w, queries, k_head, sizeof(kv_t) == 1 ? D : row_stride, v_block + g * D,
                           reinterpret_cast<const uint32_t*>(cached + tpb * D), row_stride, base_pos, num_block_tokens,
                           m, l, acc, amx_buf.vp, amx_buf.st, amx_buf.pa, amx_buf.ob);
          continue;
        }
        if (!k_ready) {
          rows_to_bf16(k_block + kv_head_begin * D, row_stride, k_bf16, span, num_block_tokens);
          k_rows = k_bf16;
          first_head = kv_head_begin;
          k_stride = span;
          k_ready = true;
        }
        amx_attend_block(w, queries, k_rows + (g - first_head) * D, k_stride, v_block + g * D,
                         static_cast<const uint32_t*>(nullptr), row_stride, base_pos, num_block_tokens, m, l, acc,
                         amx_buf.vp, amx_buf.st, amx_buf.pa, amx_buf.ob);
      }
      continue;
    }
#endif
#if KILN_ISA == KILN_ISA_AVX512_BF16
    if (dpbf16) {
      // the next block of an item of every KV head, spread over this block's loops
      NextBlockPrefetch next = j + 1 < end_block && by_shares ? block_lines(j + 1) : NextBlockPrefetch{};
      if (sizeof(kv_t) == 1 && convert) {  // an 8-bit block many query vectors read: converted once
        uint16_t* k_bf16 = reinterpret_cast<uint16_t*>(k_f32);
        uint16_t* v_bf16 = reinterpret_cast<uint16_t*>(v_f32);
        rows_to_bf16(k_block + kv_head_begin * D, row_stride, k_bf16, span, num_block_tokens);
        rows_to_bf16(v_block + kv_head_begin * D, row_stride, v_bf16, span, num_block_tokens);
        for (int64_t g = kv_head_begin; g < kv_head_end; ++g) {
          const int64_t offset = (g - kv_head_begin) * D;
          dp_attend_block(w, g, dp_q, static_cast<const uint16_t*>(k_bf16 + offset),
                          static_cast<const uint16_t*>(v_bf16 + offset), span, base_pos, num_block_tokens, m, l, acc, s,
                          next);
        }
      } else {
        for (int64_t g = kv_head_begin; g < kv_head_end; ++g)
          dp_attend_block(w, g, dp_q, k_block + g * D, v_block + g * D, row_stride, base_pos, num_block_tokens, m, l,
                          acc, s, next);
      }
      next.finish();
      continue;
    }
#endif
    if (convert) {
      const kv_t* k_span = k_block + kv_head_begin * D;
      const kv_t* v_span = v_block + kv_head_begin * D;
      if (span == row_stride) {  // all KV heads: the block is contiguous
        to_f32(k_span, k_f32, num_block_tokens * span);
        to_f32(v_span, v_f32, num_block_tokens * span);
      } else {
        for (int64_t r = 0; r < num_block_tokens; ++r) {
          to_f32(k_span + r * row_stride, k_f32 + r * span, span);
          to_f32(v_span + r * row_stride, v_f32 + r * span, span);
        }
      }
      for (int64_t g = kv_head_begin; g < kv_head_end; ++g) {
        const int64_t offset = (g - kv_head_begin) * D;
        prefetch_next(g);
        attend_block<float>(w, g, k_f32 + offset, v_f32 + offset, span, base_pos, num_block_tokens, m, l, acc, s);
      }
    } else {
      for (int64_t g = kv_head_begin; g < kv_head_end; ++g) {
        prefetch_next(g);
        attend_block<kv_t>(w, g, k_block + g * D, v_block + g * D, row_stride, base_pos, num_block_tokens, m, l, acc, s);
      }
    }
  }
#if KILN_ISA == KILN_ISA_AMX_BF16
  if (amx) _tile_release();
#endif
  if (w.partial != nullptr) {  // one part of a split sequence: its state, for merge_parts
    for (int64_t i = 0; i < M * (D + 2); ++i) w.partial[i] = m[i];  // m, l and acc are contiguous
    return;
  }
  for (int64_t qi = 0; qi < w.num_q_tokens; ++qi) {
    for (int64_t h = 0; h < num_heads_item; ++h) {
      const int64_t i = qi * num_heads_item + h;
      store_output(w, qi, h, acc + i * D, w.out_scale / l[i]);  // out_scale: 1, or the 8-bit pool's v_scale
    }
  }
}

#if KILN_ISA == KILN_ISA_AMX_BF16
// Cascade attention's shared part (paged_attention.cpp, share_prefixes): the unit's query vectors of KV head
// u.kv_head, tokens of several items whose KV blocks [u.work.kv_block_begin, u.work.kv_block_end) of a
// bfloat16 pool are the same, through those blocks together, up to 16 to a tile. Leaves each vector's
// state after them (u.m, u.l, u.acc), the same bits as its item's own loop would: amx_attend_block
// computes a vector's numbers from its own row or lane only. Scratch: attn_scratch_floats(kSharedUnitVectors, ...) floats.
static void attend_shared(const SharedUnit& u, float* scratch) {
  const AttnWork& w = u.work;
  const int64_t D = w.head_dim, tpb = w.tokens_per_block, row_stride = w.kv_row_stride;
  const int64_t num_heads_item = w.head_end - w.head_begin;
  uint32_t* packed =
      reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(scratch) + 63) & ~static_cast<uintptr_t>(63));
  const AmxQueries queries = amx_queries(w, u.kv_head, packed);
  amx_pack_queries(w, queries, u.q_rows);
  const AmxStepBuffers buf = amx_step_buffers(packed + amx_queries_size(queries, D), D);
  for (int64_t qi = 0; qi < w.num_q_tokens; ++qi)
    for (int64_t h = queries.h_begin; h < queries.h_begin + queries.heads; ++h) {
      const int64_t i = qi * num_heads_item + h;
      u.m[i] = -__builtin_inff();
      u.l[i] = 0.f;
      for (int64_t e = 0; e < D; ++e) u.acc[i * D + e] = 0.f;
    }
  const uint16_t* k_pool = static_cast<const uint16_t*>(w.k_base);
  const uint16_t* v_pool = static_cast<const uint16_t*>(w.v_base);
  amx_configure_tiles();
  for (int64_t j = w.kv_block_begin; j < w.kv_block_end; ++j) {
    const int64_t first_row = static_cast<int64_t>(w.block_table[j]) * tpb;
    amx_attend_block(w, queries, k_pool + first_row * row_stride + u.kv_head * D, row_stride,
                     v_pool + first_row * row_stride + u.kv_head * D, static_cast<const uint32_t*>(nullptr), row_stride,
                     j * tpb, tpb, u.m, u.l, u.acc, buf.vp, buf.st, buf.pa, buf.ob);
  }
  _tile_release();
}
#endif

static void attend(const AttnWork& w, float* scratch) {
  switch (w.kv_type) {
    case KvType::kBFloat16: attend_typed<uint16_t>(w, scratch); break;
    case KvType::kFp8E4M3: attend_typed<uint8_t>(w, scratch); break;
    case KvType::kInt8: attend_typed<int8_t>(w, scratch); break;
    default: attend_typed<float>(w, scratch); break;
  }
}

#endif  // KILN_ISA == KILN_ISA_GENERIC || AVX2 || AVX512 || AVX512_BF16 || AMX_BF16
