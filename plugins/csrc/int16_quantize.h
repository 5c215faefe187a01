// Block floating point int16 activations (AVX2), for the generation GEMVs of int4_linear and int8_linear.
// Included by int4_kernels.h and int8_kernels.h in their KILN_ISA_AVX2 copy (isa_variants.h).
//
// Per token and block of `block` columns, x16 = round(x * 2^-e) (nearest even) with the power of two chosen
// so that the block's max |x| maps into [2^14, 2^15): 15 significant bits for the block's largest values
// (bfloat16 x has 8), an absolute error of at most 2^-16 max |x| per column.
//
//   x        [T, in] bfloat16 bits;  pqs [in] float32 multiplied in first, or null
//   row      [in] float32 scratch
//   x16      [T, in] int16: natural order, or with nibble_chunks each 64 columns as x16_c[16 k + i] =
//            x16[4 i + k] (int4_kernels.h, gemv_int16_rows)
//   x_scale  [T, in / block] 2^e;  x_sum [T, in / block] 2^e * sum of the block's x16
// block and in must be multiples of 64. Returns false, with nothing usable written, when a block holds inf
// or NaN (int16 cannot represent them: the caller takes its float32 kernel, which propagates them).

static inline __m256 int16q_widen_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

// The nibble_chunks order of one 64-column chunk, from its four vectors of natural-order x16 (q[h] holding
// columns 16h .. 16h+15): dst[16k + i] = x16[4i + k]. Within each 128-bit lane PSHUFB gathers the columns of
// one nibble position k into dword k, VPERMD pairs the two lanes' dwords per k (qword k then holds columns
// 4i + k of four consecutive i), and a 4 x 4 transpose of qwords puts each k's sixteen columns together:
// 16 shuffles against 64 scalar moves.
static inline void int16q_store_nibble_chunk(const __m256i* q, int16_t* dst) {
  const __m256i by_k = _mm256_setr_epi8(0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15,
                                        0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15);
  const __m256i pair_lanes = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i v[4];
  for (int h = 0; h < 4; ++h) v[h] = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(q[h], by_k), pair_lanes);
  const __m256i t0 = _mm256_unpacklo_epi64(v[0], v[1]), t1 = _mm256_unpackhi_epi64(v[0], v[1]);
  const __m256i t2 = _mm256_unpacklo_epi64(v[2], v[3]), t3 = _mm256_unpackhi_epi64(v[2], v[3]);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permute2x128_si256(t0, t2, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16), _mm256_permute2x128_si256(t1, t3, 0x20));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32), _mm256_permute2x128_si256(t0, t2, 0x31));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 48), _mm256_permute2x128_si256(t1, t3, 0x31));
}

static bool int16_quantize(const uint16_t* x, const float* pqs, int64_t num_tokens, int64_t in, int64_t block,
                           bool nibble_chunks, float* row, int16_t* x16, float* x_scale, float* x_sum) {
  const int64_t num_blocks = in / block;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256 infinity = _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000));
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t c0 = b * block;
      __m256 max_v = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
      for (int64_t c = c0; c < c0 + block; c += 8) {
        __m256 v = int16q_widen_bf16x8(x + t * in + c);
        if (pqs != nullptr) v = _mm256_mul_ps(v, _mm256_loadu_ps(pqs + c));
        _mm256_storeu_ps(row + c, v);
        const __m256 a = _mm256_and_ps(v, abs_mask);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, infinity, _CMP_NLT_UQ));  // inf, or NaN (unordered)
        max_v = _mm256_max_ps(max_v, a);
      }
      if (_mm256_movemask_ps(bad) != 0) return false;
      __m128 m = _mm_max_ps(_mm256_castps256_ps128(max_v), _mm256_extractf128_ps(max_v, 1));
      m = _mm_max_ps(m, _mm_movehl_ps(m, m));
      m = _mm_max_ss(m, _mm_movehdup_ps(m));
      const float max_abs = _mm_cvtss_f32(m);
      // max_abs = f * 2^exponent with f in [0.5, 1): max_abs * 2^(15 - exponent) < 2^15
      int exponent = 0;
      if (max_abs > 0.f) {
        uint32_t bits;
        __builtin_memcpy(&bits, &max_abs, sizeof(bits));
        exponent = bits >= 0x00800000u ? static_cast<int>(bits >> 23) - 126
                                        : static_cast<int>(32 - __builtin_clz(bits)) - 149;  // subnormal
      }
      // 2^e stays a float32 (subnormal at worst): blocks below 2^-134 keep fewer bits
      const int e = max_abs > 0.f ? (exponent - 15 < -149 ? -149 : exponent - 15) : 0;
      const auto pow2 = [](int k) {  // 2^k as float32 for k in [-149, 127]
        float f;
        const uint32_t bits = k >= -126 ? static_cast<uint32_t>(k + 127) << 23 : 1u << (k + 149);
        __builtin_memcpy(&f, &bits, sizeof(f));
        return f;
      };
      // 2^-e exceeds float32's range for tiny blocks (e < -127): scale in two exact steps
      const float inv_hi = pow2(-e > 127 ? 127 : -e), inv_lo = pow2(-e > 127 ? -e - 127 : 0);
      const __m256 s_hi = _mm256_set1_ps(inv_hi), s_lo = _mm256_set1_ps(inv_lo);
      __m256i sum_v = _mm256_setzero_si256();
      int16_t* dst = x16 + t * in;
      for (int64_t c = c0; c < c0 + block; c += 64) {
        __m256i chunk[4];
        for (int h = 0; h < 4; ++h) {
          const float* src = row + c + 16 * h;
          const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src), s_hi), s_lo));
          const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(src + 8), s_hi), s_lo));
          // PACKSSDW saturates a rounded 2^15 to 32767 and interleaves 128-bit lanes: restore the order
          const __m256i q = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
          sum_v = _mm256_add_epi32(sum_v, _mm256_madd_epi16(q, ones));
          if (nibble_chunks) chunk[h] = q;
          else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c + 16 * h), q);
        }
        if (nibble_chunks) int16q_store_nibble_chunk(chunk, dst + c);
      }
      __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum_v), _mm256_extracti128_si256(sum_v, 1));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
      s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
      const float scale = pow2(e);  // e in [-149, 113]
      x_scale[t * num_blocks + b] = scale;
      x_sum[t * num_blocks + b] = static_cast<float>(_mm_cvtsi128_si32(s)) * scale;
    }
  }
  return true;
}
