// Raw FP8 (E4M3FN) weight kernels of kilnlm::fp8_linear, compiled per ISA by isa_variants.h (see there
// for the rules a kernel header follows): the float32 GEMV, tile dequantization and activation
// quantization as a portable scalar version and an AVX2 version; the AVX512-BF16 context-phase GEMM
// (fp8_bf16_gemm.h); and with AVX512-VBMI the bfloat16 generation-phase GEMV (fp8_bf16_gemv.h).
//
// FP8 -> float32 on AVX2, two ways:
// - Shifts (the GEMV's default): byte `s eeee mmm` placed in the top byte of a 32-bit lane and shifted
//   arithmetically right by 4 is `s ssss eeee mmm 0...`; clearing the four sign copies leaves the float32
//   `s 0000eeee mmm 0...`, exactly 2^-120 times the E4M3 value -- normals and subnormals alike, since
//   E4M3's exponent bias (7) is float32's (127) minus 120. Three integer instructions per 8 weights;
//   F16C's VCVTPH2PS (below) is the bottleneck of the GEMV on CPUs where it issues once per two cycles
//   (a 98304x576 weight streamed at ~16 GB/s with it). Subnormal E4M3 weights become float32 denormals,
//   so a thread with flush-to-zero or denormals-are-zero set (MXCSR) takes the F16C path instead.
// - F16C: byte `s eeee mmm` becomes the half `s 0eeee mmm 0000000` (bits 15, 14..10, 9..7), exactly 2^-8
//   times the E4M3 value, which VCVTPH2PS converts exactly to a normal float32 (so FTZ / DAZ cannot change
//   the result). Also the dequantization of the context phase's tiles.
// The powers of two are multiplied back in exactly afterwards. E4M3FN's NaN encodings (0x7F / 0xFF) would
// read as ±480: quantized weights never hold NaN.

#if KILN_ISA == KILN_ISA_GENERIC || KILN_ISA == KILN_ISA_AVX2

// Activation quantization: out[i] = float(E4M3(clamp(x[i] / scale, -448, 448))), round to nearest even,
// bit-exact with torch's `.clamp(-448, 448).to(torch.float8_e4m3fn)` but kept as the exact float value
// (the GEMM consumes floats). On the float32 bits: normal E4M3 (|v| >= 2^-6) keeps 3 mantissa bits, so
// add 0x7FFFF plus the lowest kept bit and truncate (RNE, carries into the exponent); subnormal E4M3
// (|v| < 2^-6) is a multiple of 2^-9, obtained by RNE addition of 2^14 (whose float ulp is 2^-9).
// NaN stays NaN; clamping first keeps every result within ±448.
static inline float quantize_e4m3_scalar(float x, float scale) {
  float v = x / scale;
  v = v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v);  // NaN compares false: passes through
  uint32_t bits;
  __builtin_memcpy(&bits, &v, sizeof(bits));
  const uint32_t sign = bits & 0x80000000u;
  uint32_t mag = bits & 0x7FFFFFFFu;
  float a;
  __builtin_memcpy(&a, &mag, sizeof(a));
  if (a < 0.015625f) {  // 2^-6: E4M3 subnormal range (or zero)
    a = (a + 16384.0f) - 16384.0f;  // IEEE evaluation as written (no -ffast-math)
    __builtin_memcpy(&mag, &a, sizeof(mag));
  } else if (mag < 0x7F800000u) {
    mag = (mag + 0x7FFFFu + ((mag >> 20) & 1u)) & 0xFFF00000u;
  }
  bits = sign | mag;
  float out;
  __builtin_memcpy(&out, &bits, sizeof(out));
  return out;
}

// Per-token activation scales (fp8_rowwise_linear): max_i |x[i]|, NaN when any x[i] is NaN (as torch's
// amax), 0 for an empty or all-zero row. One element at a time: `amax` the running maximum, `nan` sticky.
static inline void amax_step(float v, float& amax, bool& nan) {
  const float a = __builtin_fabsf(v);
  nan |= a != a;
  amax = a > amax ? a : amax;
}

static inline float bf16_bits_to_float(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  __builtin_memcpy(&f, &bits, sizeof(f));
  return f;
}

// dot(fp8 row, x) for `num_rows` consecutive rows starting at row `row`, against `NT` activation rows.
// w: [rows, in] bytes (row-major); x: NT rows of `in` floats, `x_stride` apart; y: NT rows, `y_stride`
// apart, written at column `row + r`. `lut` maps a byte to its exact float value (scalar tails).
#if KILN_ISA == KILN_ISA_AVX2

static inline __m256i fp8x16_to_half_bits(__m128i bytes) {
  // bytes: 16 x u8  ->  16 x u16 half bits holding 2^-8 * value
  __m256i u = _mm256_cvtepu8_epi16(bytes);
  u = _mm256_srai_epi16(_mm256_slli_epi16(u, 8), 1);  // s s eeee mmm 0000000
  return _mm256_and_si256(u, _mm256_set1_epi16(static_cast<short>(0xBFFF)));  // clear the copied sign
}

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The GEMV's activations are x_q * 2^kXScaleLog2 (the caller scales them, exactly): the products with
// 2^-120-scaled weights are then x_q * q * 2^-20, never denormal (|x_q|, |q| >= 2^-9 or 0), and with
// 2^-8-scaled weights x_q * q * 2^92, which cannot overflow (|x_q * q| <= 448^2, in < 2^20 columns).
constexpr int kXScaleLog2 = 100;

// The GEMV converts 32 weights at a time with shifts within each 32-bit lane, which leaves them in the
// order kBlockOrder: column 4j + k of the block as element j of float vector k. The activations are laid
// out in that same order by prepare_x, once per call. Columns past the last full block of 32 keep their
// order.
constexpr int kBlock = 32;
constexpr int kBlockOrder[kBlock] = {0, 4, 8,  12, 16, 20, 24, 28, 1, 5, 9,  13, 17, 21, 25, 29,
                                     2, 6, 10, 14, 18, 22, 26, 30, 3, 7, 11, 15, 19, 23, 27, 31};

// dst[t, :] = x[t, :] * 2^kXScaleLog2 (exact), each full block of 32 columns in kBlockOrder.
static void prepare_x(const float* x, int64_t num_tokens, int64_t in, float* dst) {
  const float factor = 0x1p100f;
  static_assert(kXScaleLog2 == 100, "factor must be 2^kXScaleLog2");
  for (int64_t t = 0; t < num_tokens; ++t) {
    const float* src = x + t * in;
    float* out = dst + t * in;
    int64_t i = 0;
    for (; i + kBlock <= in; i += kBlock)
      for (int j = 0; j < kBlock; ++j) out[i + j] = src[i + kBlockOrder[j]] * factor;
    for (; i < in; ++i) out[i] = src[i] * factor;
  }
}

// 32 weights at w as float32 in kBlockOrder (v[k] holds columns k, 4 + k, ..., 28 + k), 2^-120 (kShifts)
// or 2^-8 times their value.
// kShifts: each byte is brought to the top of a 16-bit half of its 32-bit lane, s eeee mmm 0000 0000; an
// arithmetic shift by 4 and clearing the sign's copies give s 0000 eeee mmm 0000, which as the upper half
// of a float32 is exactly 2^-120 times the E4M3 value (subnormals become float32 denormals): nine shift
// and mask instructions per 32 weights, no shuffles. Otherwise F16C: the bytes are gathered into kBlockOrder
// and widened to half bits s 0 eeee mmm 0000000, 2^-8 times the value.
template <bool kShifts>
static inline void fp8x32_to_float(const uint8_t* w, __m256 v[4]) {
  const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  if (kShifts) {
    const __m256i keep = _mm256_set1_epi32(static_cast<int>(0x87F00000u));  // sign, exponent, mantissa
    const __m256i odd = _mm256_srai_epi16(bytes, 4);                            // bytes 1, 3 on top of their halves
    const __m256i even = _mm256_srai_epi16(_mm256_slli_epi16(bytes, 8), 4);     // bytes 0, 2
    v[0] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(even, 16), keep));
    v[1] = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(odd, 16), keep));
    v[2] = _mm256_castsi256_ps(_mm256_and_si256(even, keep));
    v[3] = _mm256_castsi256_ps(_mm256_and_si256(odd, keep));
  } else {
    // per 128-bit lane: bytes 0, 4, 8, 12, 1, 5, ...; then the lanes' 32-bit quarters interleaved, so
    // that 64-bit quarter k holds the columns of v[k]
    const __m256i by_column = _mm256_shuffle_epi8(
        bytes, _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15, 0, 4, 8, 12, 1, 5, 9, 13, 2, 6,
                                10, 14, 3, 7, 11, 15));
    const __m256i ordered = _mm256_permutevar8x32_epi32(by_column, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const __m256i h01 = fp8x16_to_half_bits(_mm256_castsi256_si128(ordered));
    const __m256i h23 = fp8x16_to_half_bits(_mm256_extracti128_si256(ordered, 1));
    v[0] = _mm256_cvtph_ps(_mm256_castsi256_si128(h01));
    v[1] = _mm256_cvtph_ps(_mm256_extracti128_si256(h01, 1));
    v[2] = _mm256_cvtph_ps(_mm256_castsi256_si128(h23));
    v[3] = _mm256_cvtph_ps(_mm256_extracti128_si256(h23, 1));
  }
}

// Accumulators per row and token of the NR x NT microkernel: four dependent FMA chains for one row of one
// token, two where more rows and tokens share the 16 registers.
template <int NR, int NT>
constexpr int kChains = NR * NT <= 2 ? 4 : 2;

// NR rows x NT tokens microkernel over x laid out by prepare_x: every 32 weights are converted once and
// used NT times. A accumulators per row and token, 8-column vector k of each 32 into accumulator k % A.
template <int NR, int NT, bool kShifts, int A = kChains<NR, NT>>
static inline void gemv_block(const uint8_t* w, int64_t in, const float* x, int64_t x_stride, float* y,
                              int64_t y_stride, const float* lut) {
  constexpr float kWeightScale = kShifts ? 0x1p-120f : 0x1p-8f;  // of the converted weights
  constexpr float kUnscale = kShifts ? 0x1p20f : 0x1p-92f;        // 1 / (kWeightScale * 2^kXScaleLog2)
  __m256 acc[NR][NT][A];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      for (int a = 0; a < A; ++a) acc[r][t][a] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + kBlock <= in; i += kBlock) {
    if ((i & 63) == 0) {
      // Software prefetch KILN_WEIGHT_PREFETCH_BYTES ahead in this thread's rows: the generation phase
      // streams weights from DRAM and the hardware prefetcher alone leaves bandwidth unused.
      for (int r = 0; r < NR; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + r * in + i) + KILN_WEIGHT_PREFETCH_BYTES, KILN_WEIGHT_PREFETCH);
    }
    for (int r = 0; r < NR; ++r) {
      __m256 v[4];
      fp8x32_to_float<kShifts>(w + r * in + i, v);
      for (int t = 0; t < NT; ++t)
        for (int k = 0; k < 4; ++k)
          acc[r][t][k % A] = _mm256_fmadd_ps(v[k], _mm256_loadu_ps(x + t * x_stride + i + 8 * k), acc[r][t][k % A]);
    }
  }
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) {
      __m256 sum = _mm256_add_ps(acc[r][t][0], acc[r][t][1]);
      if constexpr (A == 4) sum = _mm256_add_ps(sum, _mm256_add_ps(acc[r][t][2], acc[r][t][3]));
      float s = hsum8(sum);
      for (int64_t j = i; j < in; ++j) s += (lut[w[r * in + j]] * kWeightScale) * x[t * x_stride + j];
      y[t * y_stride + r] = s * kUnscale;
    }
  }
}

template <int NT, bool kShifts>
static inline void gemv_rows_nt(const uint8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const float* x,
                                int64_t x_stride, float* y, int64_t y_stride, const float* lut) {
  // One row at a time for a single token: a 98304x576 weight streamed at 16.1 GB/s against 14.7 (four
  // rows) and 15.0 (two) on an AVX2 machine (F16C conversion).
  constexpr int NR = NT <= 2 ? NT : 1;
  int64_t r = row_begin;
  for (; r + NR <= row_end; r += NR)
    gemv_block<NR, NT, kShifts>(w + r * in, in, x, x_stride, y + r, y_stride, lut);
  for (; r < row_end; ++r) gemv_block<1, NT, kShifts>(w + r * in, in, x, x_stride, y + r, y_stride, lut);
}

// kOneOrder: every token summed as a lone token is (four chains, one row at a time), whatever num_tokens,
// tokens in pairs (8 accumulators) and one alone -- batch invariance (cpu_features.h); otherwise tokens in
// groups of 4 / 2 / 1, each group's accumulators as gemv_rows_nt lays them out.
template <bool kShifts, bool kOneOrder>
static void gemv_rows_conv(const uint8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const float* x,
                           int64_t num_tokens, int64_t x_stride, float* y, int64_t y_stride, const float* lut) {
  if constexpr (kOneOrder) {
    constexpr int A = kChains<1, 1>;
    for (int64_t t = 0; t < num_tokens; t += 2) {
      for (int64_t r = row_begin; r < row_end; ++r) {
        if (t + 1 < num_tokens)
          gemv_block<1, 2, kShifts, A>(w + r * in, in, x + t * x_stride, x_stride, y + t * y_stride + r, y_stride, lut);
        else
          gemv_block<1, 1, kShifts, A>(w + r * in, in, x + t * x_stride, x_stride, y + t * y_stride + r, y_stride, lut);
      }
    }
    return;
  }
  int64_t t = 0;
  for (; t + 4 <= num_tokens; t += 4)
    gemv_rows_nt<4, kShifts>(w, in, row_begin, row_end, x + t * x_stride, x_stride, y + t * y_stride, y_stride, lut);
  if (num_tokens - t >= 2) {
    gemv_rows_nt<2, kShifts>(w, in, row_begin, row_end, x + t * x_stride, x_stride, y + t * y_stride, y_stride, lut);
    t += 2;
  }
  if (t < num_tokens)
    gemv_rows_nt<1, kShifts>(w, in, row_begin, row_end, x + t * x_stride, x_stride, y + t * y_stride, y_stride, lut);
}

// y[t, r] = sum_i q[r, i] * x_q[t, i] for rows [row_begin, row_end), x holding x_q laid out by prepare_x
// (kOneOrder: see gemv_rows_conv). The conversion is chosen by this thread's MXCSR (FTZ bit 15, DAZ bit 6).
template <bool kOneOrder>
static void gemv_rows(const uint8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const float* x,
                      int64_t num_tokens, int64_t x_stride, float* y, int64_t y_stride, const float* lut) {
  if ((_mm_getcsr() & 0x8040u) == 0)
    gemv_rows_conv<true, kOneOrder>(w, in, row_begin, row_end, x, num_tokens, x_stride, y, y_stride, lut);
  else
    gemv_rows_conv<false, kOneOrder>(w, in, row_begin, row_end, x, num_tokens, x_stride, y, y_stride, lut);
}

// Exact dequantization of rows [row_begin, row_end) into dst [row_end - row_begin, in] floats.
static void dequant_rows(const uint8_t* w, int64_t in, int64_t row_begin, int64_t row_end, float* dst,
                         const float* lut) {
  const __m256 two8 = _mm256_set1_ps(256.0f);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* src = w + r * in;
    float* out = dst + (r - row_begin) * in;
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
      __m256i h = fp8x16_to_half_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), two8));
      _mm256_storeu_ps(out + i + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), two8));
    }
    for (; i < in; ++i) out[i] = lut[src[i]];
  }
}


// Rows [row_begin, row_end) as bfloat16 bits into dst [rows, dst_stride] (exact: every E4M3 value is a
// normal bfloat16). Columns in..dst_stride are left untouched.
static void dequant_rows_bf16(const uint8_t* w, int64_t in, int64_t row_begin, int64_t row_end, uint16_t* dst,
                              int64_t dst_stride, const float* lut) {
  const __m256 two8 = _mm256_set1_ps(256.0f);
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* src = w + r * in;
    uint16_t* out = dst + (r - row_begin) * dst_stride;
    int64_t i = 0;
    for (; i + 16 <= in; i += 16) {
      const __m256i h = fp8x16_to_half_bits(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
      const __m256i lo = _mm256_srli_epi32(_mm256_castps_si256(_mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(h)), two8)), 16);
      const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(_mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), two8)), 16);
      // packus interleaves the 128-bit lanes: [lo0-3 hi0-3 lo4-7 hi4-7] -> reorder the 64-bit quarters
      const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
    }
    for (; i < in; ++i) {
      uint32_t bits;
      __builtin_memcpy(&bits, &lut[src[i]], sizeof(bits));
      out[i] = static_cast<uint16_t>(bits >> 16);
    }
  }
}

static inline __m256 quantize_e4m3_ps(__m256 x, __m256 scale) {
  __m256 v = _mm256_div_ps(x, scale);
  v = _mm256_max_ps(_mm256_set1_ps(-448.0f), v);  // NaN in v is returned (second operand)
  v = _mm256_min_ps(_mm256_set1_ps(448.0f), v);
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(bits, _mm256_set1_epi32(static_cast<int>(0x80000000u)));
  const __m256i mag = _mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256 a = _mm256_castsi256_ps(mag);
  // normal E4M3: RNE to 3 mantissa bits
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(mag, 20), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_and_si256(_mm256_add_epi32(_mm256_add_epi32(mag, _mm256_set1_epi32(0x7FFFF)), lsb),
                                           _mm256_set1_epi32(static_cast<int>(0xFFF00000u)));
  // NaN: keep as is (rounding could carry a NaN payload into the exponent field only for infinities,
  // which clamping has removed)
  const __m256 is_nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  __m256 normal = _mm256_blendv_ps(_mm256_castsi256_ps(rounded), a, is_nan);
  // subnormal E4M3: RNE to a multiple of 2^-9
  const __m256 magic = _mm256_set1_ps(16384.0f);
  const __m256 sub = _mm256_sub_ps(_mm256_add_ps(a, magic), magic);
  const __m256 is_sub = _mm256_cmp_ps(a, _mm256_set1_ps(0.015625f), _CMP_LT_OQ);
  const __m256 q = _mm256_blendv_ps(normal, sub, is_sub);
  return _mm256_or_ps(q, _mm256_castsi256_ps(sign));
}

static void quantize_f32(const float* x, float scale, float* out, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, quantize_e4m3_ps(_mm256_loadu_ps(x + i), s));
  for (; i < n; ++i) out[i] = quantize_e4m3_scalar(x[i], scale);
}

static void quantize_bf16(const uint16_t* x, float scale, float* out, int64_t n) {
  const __m256 s = _mm256_set1_ps(scale);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    _mm256_storeu_ps(out + i, quantize_e4m3_ps(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)), s));
  }
  for (; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof(f));
    out[i] = quantize_e4m3_scalar(f, scale);
  }
}

// max_i |x[i]| (amax_step's contract), eight lanes at a time.
static inline float amax_finish(__m256 m, __m256 nan_mask, const float* tail, const uint16_t* tail_bf16, int64_t n) {
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float amax = 0.f;
  bool nan = _mm256_movemask_ps(nan_mask) != 0;
  for (float v : lanes) amax_step(v, amax, nan);
  for (int64_t i = 0; i < n; ++i) amax_step(tail != nullptr ? tail[i] : bf16_bits_to_float(tail_bf16[i]), amax, nan);
  return nan ? __builtin_nanf("") : amax;
}

static float amax_f32(const float* x, int64_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 a = _mm256_and_ps(_mm256_loadu_ps(x + i), abs_mask);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    m = _mm256_max_ps(a, m);  // a NaN `a` leaves m as it was: `nan` records it
  }
  return amax_finish(m, nan, x + i, nullptr, n - i);
}

static float amax_bf16(const uint16_t* x, int64_t n) {
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    const __m256 a = _mm256_and_ps(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)), abs_mask);
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
    m = _mm256_max_ps(a, m);
  }
  return amax_finish(m, nan, nullptr, x + i, n - i);
}

#else  // portable scalar path: 256-entry lookup table, four partial sums

static void gemv_rows(const uint8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const float* x,
                      int64_t num_tokens, int64_t x_stride, float* y, int64_t y_stride, const float* lut) {
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * in;
    for (int64_t t = 0; t < num_tokens; ++t) {
      const float* xt = x + t * x_stride;
      float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
      int64_t i = 0;
      for (; i + 4 <= in; i += 4) {
        s0 += lut[row[i]] * xt[i];
        s1 += lut[row[i + 1]] * xt[i + 1];
        s2 += lut[row[i + 2]] * xt[i + 2];
        s3 += lut[row[i + 3]] * xt[i + 3];
      }
      for (; i < in; ++i) s0 += lut[row[i]] * xt[i];
      y[t * y_stride + r] = (s0 + s1) + (s2 + s3);
    }
  }
}

static void dequant_rows(const uint8_t* w, int64_t in, int64_t row_begin, int64_t row_end, float* dst,
                         const float* lut) {
  for (int64_t r = row_begin; r < row_end; ++r)
    for (int64_t i = 0; i < in; ++i) dst[(r - row_begin) * in + i] = lut[w[r * in + i]];
}


static void quantize_f32(const float* x, float scale, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = quantize_e4m3_scalar(x[i], scale);
}

static void quantize_bf16(const uint16_t* x, float scale, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof(f));
    out[i] = quantize_e4m3_scalar(f, scale);
  }
}


static void dequant_rows_bf16(const uint8_t* w, int64_t in, int64_t row_begin, int64_t row_end, uint16_t* dst,
                              int64_t dst_stride, const float* lut) {
  for (int64_t r = row_begin; r < row_end; ++r)
    for (int64_t i = 0; i < in; ++i) {
      uint32_t bits;
      __builtin_memcpy(&bits, &lut[w[r * in + i]], sizeof(bits));
      dst[(r - row_begin) * dst_stride + i] = static_cast<uint16_t>(bits >> 16);
    }
}

static float amax_f32(const float* x, int64_t n) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) amax_step(x[i], amax, nan);
  return nan ? __builtin_nanf("") : amax;
}

static float amax_bf16(const uint16_t* x, int64_t n) {
  float amax = 0.f;
  bool nan = false;
  for (int64_t i = 0; i < n; ++i) amax_step(bf16_bits_to_float(x[i]), amax, nan);
  return nan ? __builtin_nanf("") : amax;
}

#endif  // KILN_ISA == KILN_ISA_AVX2

#endif  // KILN_ISA == KILN_ISA_GENERIC || KILN_ISA == KILN_ISA_AVX2

#if KILN_ISA == KILN_ISA_AVX512_BF16
#include "fp8_bf16_gemm.h"
#elif KILN_ISA == KILN_ISA_AVX512_VBMI
#include "fp8_bf16_gemm.h"
#include "bf16_gemv.h"
#include "fp8_bf16_gemv.h"
#endif
