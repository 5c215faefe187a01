// Packed INT4 weight kernels of kilnlm::int4_linear, compiled per ISA by isa_variants.h (see there for
// the rules a kernel header follows): the float32 GEMV and tile dequantization as portable scalar,
// AVX2+FMA and AVX-512 versions, the fastest the CPU has chosen at run time; AVX2's block floating point
// int16 GEMV (gemv_int16_rows, int16_quantize.h; its AVX512-VNNI copy fuses each multiply and add); and
// the AVX512-BF16 GEMV (int4_bf16_gemv.h) with the context phase's bfloat16 tiles (bf16_tile.h,
// fp8_bf16_gemm.h; straight from the nibbles in chunk64 order where the shapes allow, dequant_rows_bf16
// below).

// The zero point of element i of a [rows, num_groups] table (0 without one).
static inline int zero_at(const int8_t* zeros, int64_t i) { return zeros != nullptr ? zeros[i] : 0; }

#if KILN_ISA == KILN_ISA_AVX512 || KILN_ISA == KILN_ISA_AVX512_BF16
// Per row, one 16-entry float table ([0..7, -8..-1] - zero) * scale: VPERMPS looks a nibble up directly
// (it reads only the low 4 bits of each index), so decoding 32 weights is one zero-extension, one shift and
// two permutes, and the group's scale and zero point cost one subtract and one multiply per row and group.
static inline __m512 scaled_table(float scale, int zero) {
  const __m512 base = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1);
  return _mm512_mul_ps(_mm512_sub_ps(base, _mm512_set1_ps(static_cast<float>(zero))), _mm512_set1_ps(scale));
}
#endif

#if KILN_ISA == KILN_ISA_AVX2 || KILN_ISA == KILN_ISA_AVX512_VNNI
static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The columns of one chunk of the AVX2 chunk kernel and of the int16 GEMV: 32 bytes of packed weights.
constexpr int64_t kChunkCols = 64;
#endif

#if KILN_ISA == KILN_ISA_GENERIC || KILN_ISA == KILN_ISA_AVX2 || KILN_ISA == KILN_ISA_AVX512

// Layout (the schema's): weight row o is `in / 2` bytes, byte j holding column 2j in its low nibble and
// column 2j+1 in its high nibble, each a two's-complement value q in [-8, 7]; the weight is
// w[o, c] = (q[o, c] - zero[o, g]) * scale[o, g], g = c / group_size (q - zero exact, the product rounded
// once in float32, as the reference dequantizes; zero = 0 for symmetric weights).
//
// Vector paths consume x in a *block-permuted* order so that the nibbles never need re-interleaving:
// inside each group, every full block of 32 columns (16 bytes) is stored as its 16 even columns then its
// 16 odd columns; the group's remaining columns (group_size % 32, an even count) keep their order.
//
//   columns  c+0 c+1 c+2 c+3 ... c+30 c+31      bytes b0 = (c+1 | c+0), b1 = (c+3 | c+2), ...
//   x_perm   x[c+0] x[c+2] ... x[c+30] | x[c+1] x[c+3] ... x[c+31]
//            (low nibbles of b0..b15)    (high nibbles of b0..b15)
//
// Arguments shared by the functions below:
//   w       [out, in / 2] uint8, row-major;  scales [out, num_groups] float32, row-major (gemv_int16_rows
//           also float16 bits, read natively; int4_linear.cpp widens float16 scales for the others);
//   zeros   [out, num_groups] int8 (asymmetric groups' zero points), row-major, or null (all zero)
//   x       [num_tokens, in] float32 rows `x_stride` apart (natural order for the scalar path, block-
//           permuted for the vector paths; pre_quant_scale already applied)
//   y       [num_tokens, *] float32 rows `y_stride` apart; row r's dot product goes to column r

static inline int int4_at(const uint8_t* row, int64_t col) {
  const int nibble = (col & 1) ? (row[col >> 1] >> 4) : (row[col >> 1] & 0xF);
  return (nibble ^ 8) - 8;  // two's complement 4-bit -> [-8, 7]
}

// Scalar dot product of columns [c0, c1) (all inside group g) of one row with natural-order x.
static inline float dot_group_tail(const uint8_t* row, float scale, int zero, const float* x, int64_t c0, int64_t c1) {
  float s = 0.f;
  for (int64_t c = c0; c < c1; ++c) s += static_cast<float>(int4_at(row, c) - zero) * scale * x[c];
  return s;
}

#if KILN_ISA == KILN_ISA_AVX512  // ---------------------------------------------------------------- AVX-512

// NR rows x NT tokens micro-kernel over the whole row: every decoded weight vector is used NT times.
template <int NR, int NT>
static inline void gemv_block(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros,
                              int64_t group_size, const float* x, int64_t x_stride, float* y, int64_t y_stride) {
  const int64_t row_bytes = in / 2, num_groups = in / group_size;
  const int64_t num_blocks = group_size / 32;
  __m512 acc[NR][NT][2];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
  float tail[NR][NT] = {};
  for (int64_t g = 0; g < num_groups; ++g) {
    __m512 table[NR];
    for (int r = 0; r < NR; ++r) table[r] = scaled_table(scales[r * num_groups + g], zero_at(zeros, r * num_groups + g));
    const int64_t c0 = g * group_size;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t c = c0 + 32 * b;
      if ((c & 127) == 0) {
        // Prefetch the rows 4*NR ahead (the next blocks of this thread): the generation phase streams
        // weights from DRAM and the hardware prefetcher alone leaves bandwidth unused.
        for (int r = 0; r < NR; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + (r + 4 * NR) * row_bytes + c / 2), KILN_WEIGHT_PREFETCH);
      }
      __m512 xv[NT][2];
      for (int t = 0; t < NT; ++t) {
        xv[t][0] = _mm512_loadu_ps(x + t * x_stride + c);
        xv[t][1] = _mm512_loadu_ps(x + t * x_stride + c + 16);
      }
      for (int r = 0; r < NR; ++r) {
        const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * row_bytes + c / 2)));
        const __m512 even = _mm512_permutexvar_ps(d, table[r]);
        const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table[r]);
        for (int t = 0; t < NT; ++t) {
          acc[r][t][0] = _mm512_fmadd_ps(even, xv[t][0], acc[r][t][0]);
          acc[r][t][1] = _mm512_fmadd_ps(odd, xv[t][1], acc[r][t][1]);
        }
      }
    }
    if (num_blocks * 32 < group_size) {
      for (int r = 0; r < NR; ++r)
        for (int t = 0; t < NT; ++t)
          tail[r][t] += dot_group_tail(w + r * row_bytes, scales[r * num_groups + g], zero_at(zeros, r * num_groups + g),
                                       x + t * x_stride, c0 + num_blocks * 32, c0 + group_size);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t)
      y[t * y_stride + r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][t][0], acc[r][t][1])) + tail[r][t];
}

template <int NT>
struct RowsPerBlock { static constexpr int value = NT == 4 ? 2 : 4; };

// Natural-order dequantization of one group's full 32-column blocks (the tail is scalar).
static inline void dequant_blocks(const uint8_t* row, float scale, int zero, int64_t c0, int64_t num_blocks, float* out) {
  const __m512 table = scaled_table(scale, zero);
  const __m512i lo_idx = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i hi_idx = _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t c = c0 + 32 * b;
    const __m512i d = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2)));
    const __m512 even = _mm512_permutexvar_ps(d, table);
    const __m512 odd = _mm512_permutexvar_ps(_mm512_srli_epi32(d, 4), table);
    _mm512_storeu_ps(out + c, _mm512_permutex2var_ps(even, lo_idx, odd));
    _mm512_storeu_ps(out + c + 16, _mm512_permutex2var_ps(even, hi_idx, odd));
  }
}

#elif KILN_ISA == KILN_ISA_AVX2  // ------------------------------------------------------------ AVX2 + FMA

// Whether q - zero fits the PSHUFB tables' bytes for every q in [-8, 7]: zero points in [-120, 120].
static inline bool zero_fits_byte_table(int zero) { return zero >= -120 && zero <= 120; }

// The PSHUFB table of one group: entry n (a nibble) holds q - zero, q = [0..7, -8..-1][n], as int8. Only
// for zero points that zero_fits_byte_table.
static inline __m128i byte_table(int zero) {
  return _mm_sub_epi8(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4, -3, -2, -1),
                      _mm_set1_epi8(static_cast<char>(zero)));
}

// NR rows x NT tokens micro-kernel. Nibbles are decoded to q - zero with one PSHUFB table lookup (the
// group's table: [0..7, -8..-1] - zero, in [-15, 15]), widened to int32, converted and multiplied by the
// group scale (w = (q - zero) * scale exactly as the reference), then FMA'd. A zero point beyond +-120
// looks q up and subtracts the zero point after the widening.
template <int NR, int NT>
static inline void gemv_block(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros,
                              int64_t group_size, const float* x, int64_t x_stride, float* y, int64_t y_stride) {
  const int64_t row_bytes = in / 2, num_groups = in / group_size;
  const int64_t num_blocks = group_size / 32;
  const __m128i low4 = _mm_set1_epi8(0x0F);
  __m256 acc[NR][NT][2];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
  float tail[NR][NT] = {};
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t c0 = g * group_size;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t c = c0 + 32 * b;
      if ((c & 127) == 0) {
        for (int r = 0; r < NR; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + r * row_bytes + c / 2) + KILN_WEIGHT_PREFETCH_BYTES, KILN_WEIGHT_PREFETCH);
      }
      for (int r = 0; r < NR; ++r) {
        const __m256 scale = _mm256_set1_ps(scales[r * num_groups + g]);
        const int zero = zero_at(zeros, r * num_groups + g);
        const int table_zero = zero_fits_byte_table(zero) ? zero : 0;
        const __m128i lut = byte_table(table_zero);
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * row_bytes + c / 2));
        const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(bytes, low4));
        const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
        __m256i qz[4] = {_mm256_cvtepi8_epi32(lo), _mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)),
                         _mm256_cvtepi8_epi32(hi), _mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))};
        if (table_zero != zero) {
          for (__m256i& v : qz) v = _mm256_sub_epi32(v, _mm256_set1_epi32(zero));
        }
        __m256 wv[4];
        for (int i = 0; i < 4; ++i) wv[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(qz[i]), scale);
        for (int t = 0; t < NT; ++t) {
          const float* xt = x + t * x_stride + c;
          acc[r][t][0] = _mm256_fmadd_ps(wv[0], _mm256_loadu_ps(xt), acc[r][t][0]);
          acc[r][t][1] = _mm256_fmadd_ps(wv[1], _mm256_loadu_ps(xt + 8), acc[r][t][1]);
          acc[r][t][0] = _mm256_fmadd_ps(wv[2], _mm256_loadu_ps(xt + 16), acc[r][t][0]);
          acc[r][t][1] = _mm256_fmadd_ps(wv[3], _mm256_loadu_ps(xt + 24), acc[r][t][1]);
        }
      }
    }
    if (num_blocks * 32 < group_size) {
      for (int r = 0; r < NR; ++r)
        for (int t = 0; t < NT; ++t)
          tail[r][t] += dot_group_tail(w + r * row_bytes, scales[r * num_groups + g], zero_at(zeros, r * num_groups + g),
                                       x + t * x_stride, c0 + num_blocks * 32, c0 + group_size);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * y_stride + r] = hsum8(_mm256_add_ps(acc[r][t][0], acc[r][t][1])) + tail[r][t];
}

template <int NT>
struct RowsPerBlock { static constexpr int value = NT == 1 ? 4 : (NT == 2 ? 2 : 1); };

// dst[0:8] = the low 8 bytes of q (int8) times scale, in float32.
static inline void store_scaled8(__m128i q, __m256 scale, float* dst) {
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale));
}

// 32 columns a block in natural order: each byte's low and high nibbles interleaved back into column order
// (PUNPCKLBW / PUNPCKHBW), looked up as q - zero in the group's table (PSHUFB, as gemv_block), widened,
// converted and multiplied by the scale: (q - zero) * scale, the scalar loop's value. A zero point beyond
// +-120, whose q - zero would not fit a byte, takes the scalar loop.
static inline void dequant_blocks(const uint8_t* row, float scale, int zero, int64_t c0, int64_t num_blocks, float* out) {
  if (!zero_fits_byte_table(zero)) {
    for (int64_t c = c0; c < c0 + 32 * num_blocks; ++c) out[c] = static_cast<float>(int4_at(row, c) - zero) * scale;
    return;
  }
  const __m128i lut = byte_table(zero);
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256 s = _mm256_set1_ps(scale);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t c = c0 + 32 * b;
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c / 2));
    const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m128i first = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));   // columns c .. c + 15
    const __m128i second = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));  // c + 16 .. c + 31
    store_scaled8(first, s, out + c);
    store_scaled8(_mm_srli_si128(first, 8), s, out + c + 8);
    store_scaled8(second, s, out + c + 16);
    store_scaled8(_mm_srli_si128(second, 8), s, out + c + 24);
  }
}

// The generation-phase kernel for group_size % 32 == 0 and in % 64 == 0, without shuffles: the one above
// spends eight shuffles (two PSHUFB, four widenings, two byte shifts) per 32 weights, and on AVX2 those
// ports bound it (~7 GB/s on SmolLM2's layers, where int8_linear streams ~20).
//
// A chunk is 64 columns = 32 bytes = eight 32-bit words; word i holds columns 8i .. 8i+7, column 8i + k in
// bits [4k, 4k + 4). Shifting the eight words left by 28 - 4k and arithmetically right by 28 gives the
// signed q of columns 8i + k (i = 0..7) in the eight int32 lanes, so x is read in *chunk order*:
//
//   x_chunk[64 j + 8 k + i] = x[64 j + 8 i + k]      (i, k in 0..7)
//
// Each 32-column half of a chunk lies in one group (group_size % 32 == 0): the lanes sum (q - zero) * x
// exactly in integers-then-float32 over a group (one chunk when group_size % 64 != 0) and the group's scale
// multiplies the partial sums once.
static inline bool chunk_kernel_applies(int64_t in, int64_t group_size) {
  return group_size % 32 == 0 && in % kChunkCols == 0;
}

template <int NR, int NT, bool kZeroPoint>
static inline void gemv_chunk_block(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros,
                                    int64_t group_size, const float* x, int64_t x_stride, float* y, int64_t y_stride) {
  const int64_t row_bytes = in / 2, num_groups = in / group_size, num_chunks = in / kChunkCols;
  const int64_t span = group_size % kChunkCols == 0 ? group_size / kChunkCols : 1;  // chunks per scale
  __m256 total[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) total[r][t] = _mm256_setzero_ps();
  for (int64_t j0 = 0; j0 < num_chunks; j0 += span) {
    const int64_t g0 = j0 * kChunkCols / group_size, g1 = (j0 * kChunkCols + 32) / group_size;
    __m256i zero[NR];
    if (kZeroPoint) {
      for (int r = 0; r < NR; ++r)
        zero[r] = _mm256_setr_m128i(_mm_set1_epi32(zeros[r * num_groups + g0]), _mm_set1_epi32(zeros[r * num_groups + g1]));
    }
    __m256 acc[NR][NT][2];
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) acc[r][t][0] = acc[r][t][1] = _mm256_setzero_ps();
    for (int64_t j = j0; j < j0 + span; ++j) {
      if ((j & 1) == 0) {
        // one 64-byte line per two chunks, KILN_WEIGHT_PREFETCH_BYTES ahead in this thread's rows
        for (int r = 0; r < NR; ++r)
          _mm_prefetch(reinterpret_cast<const char*>(w + r * row_bytes + j * 32) + KILN_WEIGHT_PREFETCH_BYTES, KILN_WEIGHT_PREFETCH);
      }
      const float* xj = x + j * kChunkCols;
      for (int r = 0; r < NR; ++r) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * row_bytes + j * 32));
#pragma GCC unroll 8
        for (int k = 0; k < 8; ++k) {
          __m256i q = _mm256_srai_epi32(k == 7 ? v : _mm256_slli_epi32(v, 28 - 4 * k), 28);
          if (kZeroPoint) q = _mm256_sub_epi32(q, zero[r]);
          const __m256 wv = _mm256_cvtepi32_ps(q);
          for (int t = 0; t < NT; ++t)
            acc[r][t][k & 1] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xj + t * x_stride + 8 * k), acc[r][t][k & 1]);
        }
      }
    }
    for (int r = 0; r < NR; ++r) {
      const __m256 scale = _mm256_setr_m128(_mm_set1_ps(scales[r * num_groups + g0]), _mm_set1_ps(scales[r * num_groups + g1]));
      for (int t = 0; t < NT; ++t)
        total[r][t] = _mm256_fmadd_ps(_mm256_add_ps(acc[r][t][0], acc[r][t][1]), scale, total[r][t]);
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) y[t * y_stride + r] = hsum8(total[r][t]);
}

template <int NT, bool kZeroPoint>
static inline void gemv_chunk_rows_nt(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros,
                                      int64_t group_size, int64_t row_begin, int64_t row_end, const float* x,
                                      int64_t x_stride, float* y, int64_t y_stride) {
  constexpr int NR = 4 / NT;
  const int64_t row_bytes = in / 2, num_groups = in / group_size;
  const int8_t* z = kZeroPoint ? zeros : nullptr;
  int64_t r = row_begin;
  for (; r + NR <= row_end; r += NR)
    gemv_chunk_block<NR, NT, kZeroPoint>(w + r * row_bytes, in, scales + r * num_groups,
                                         kZeroPoint ? z + r * num_groups : nullptr, group_size, x, x_stride, y + r, y_stride);
  for (; r < row_end; ++r)
    gemv_chunk_block<1, NT, kZeroPoint>(w + r * row_bytes, in, scales + r * num_groups,
                                        kZeroPoint ? z + r * num_groups : nullptr, group_size, x, x_stride, y + r, y_stride);
}

template <bool kZeroPoint>
static void gemv_chunk_rows_zp(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros,
                               int64_t group_size, int64_t row_begin, int64_t row_end, const float* x,
                               int64_t num_tokens, int64_t x_stride, float* y, int64_t y_stride) {
  int64_t t = 0;
  for (; t + 4 <= num_tokens; t += 4)
    gemv_chunk_rows_nt<4, kZeroPoint>(w, in, scales, zeros, group_size, row_begin, row_end, x + t * x_stride, x_stride,
                                      y + t * y_stride, y_stride);
  if (num_tokens - t >= 2) {
    gemv_chunk_rows_nt<2, kZeroPoint>(w, in, scales, zeros, group_size, row_begin, row_end, x + t * x_stride, x_stride,
                                      y + t * y_stride, y_stride);
    t += 2;
  }
  if (t < num_tokens)
    gemv_chunk_rows_nt<1, kZeroPoint>(w, in, scales, zeros, group_size, row_begin, row_end, x + t * x_stride, x_stride,
                                      y + t * y_stride, y_stride);
}

// y[t, r] for rows [row_begin, row_end) and every token; x in chunk order (chunk_kernel_applies).
static void gemv_chunk_rows(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros, int64_t group_size,
                            int64_t row_begin, int64_t row_end, const float* x, int64_t num_tokens, int64_t x_stride,
                            float* y, int64_t y_stride) {
  if (zeros != nullptr) gemv_chunk_rows_zp<true>(w, in, scales, zeros, group_size, row_begin, row_end, x, num_tokens, x_stride, y, y_stride);
  else gemv_chunk_rows_zp<false>(w, in, scales, zeros, group_size, row_begin, row_end, x, num_tokens, x_stride, y, y_stride);
}

#endif

#if KILN_ISA == KILN_ISA_GENERIC  // ---------------------------------------------------------------- portable scalar

// y[t, r] for rows [row_begin, row_end) and every token; natural-order x; any group size.
static void gemv_rows(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros, int64_t group_size,
                      int64_t row_begin, int64_t row_end, const float* x, int64_t num_tokens, int64_t x_stride, float* y,
                      int64_t y_stride) {
  const int64_t row_bytes = in / 2, num_groups = in / group_size;
  for (int64_t r = row_begin; r < row_end; ++r) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      float s = 0.f;
      for (int64_t g = 0; g < num_groups; ++g)
        s += dot_group_tail(w + r * row_bytes, scales[r * num_groups + g], zero_at(zeros, r * num_groups + g),
                            x + t * x_stride, g * group_size, (g + 1) * group_size);
      y[t * y_stride + r] = s;
    }
  }
}

#else

template <int NT>
static inline void gemv_rows_nt(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros,
                                int64_t group_size, int64_t row_begin, int64_t row_end, const float* x, int64_t x_stride,
                                float* y, int64_t y_stride) {
  constexpr int NR = RowsPerBlock<NT>::value;
  const int64_t row_bytes = in / 2, num_groups = in / group_size;
  const auto zeros_of = [&](int64_t r) { return zeros != nullptr ? zeros + r * num_groups : nullptr; };
  int64_t r = row_begin;
  for (; r + NR <= row_end; r += NR)
    gemv_block<NR, NT>(w + r * row_bytes, in, scales + r * num_groups, zeros_of(r), group_size, x, x_stride, y + r,
                       y_stride);
  for (; r < row_end; ++r)
    gemv_block<1, NT>(w + r * row_bytes, in, scales + r * num_groups, zeros_of(r), group_size, x, x_stride, y + r,
                      y_stride);
}

// y[t, r] for rows [row_begin, row_end) and every token; block-permuted x; group_size even.
static void gemv_rows(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros, int64_t group_size,
                      int64_t row_begin, int64_t row_end, const float* x, int64_t num_tokens, int64_t x_stride, float* y,
                      int64_t y_stride) {
  int64_t t = 0;
  for (; t + 4 <= num_tokens; t += 4)
    gemv_rows_nt<4>(w, in, scales, zeros, group_size, row_begin, row_end, x + t * x_stride, x_stride, y + t * y_stride, y_stride);
  if (num_tokens - t >= 2) {
    gemv_rows_nt<2>(w, in, scales, zeros, group_size, row_begin, row_end, x + t * x_stride, x_stride, y + t * y_stride, y_stride);
    t += 2;
  }
  if (t < num_tokens)
    gemv_rows_nt<1>(w, in, scales, zeros, group_size, row_begin, row_end, x + t * x_stride, x_stride, y + t * y_stride, y_stride);
}

#endif

// Natural-order float32 dequantization of rows [row_begin, row_end) into dst [rows, in]:
// dst[r, c] = (q[r, c] - zero[r, g]) * scale[r, g], exactly the reference's dequantized weight.
static void dequant_rows(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros, int64_t group_size,
                         int64_t row_begin, int64_t row_end, float* dst) {
  const int64_t row_bytes = in / 2, num_groups = in / group_size;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * row_bytes;
    float* out = dst + (r - row_begin) * in;
    for (int64_t g = 0; g < num_groups; ++g) {
      const float scale = scales[r * num_groups + g];
      const int zero = zero_at(zeros, r * num_groups + g);
      const int64_t c0 = g * group_size;
      int64_t num_blocks = 0;
#if KILN_ISA != KILN_ISA_GENERIC
      num_blocks = group_size % 2 == 0 ? group_size / 32 : 0;
      dequant_blocks(row, scale, zero, c0, num_blocks, out);
#endif
      for (int64_t c = c0 + 32 * num_blocks; c < c0 + group_size; ++c)
        out[c] = static_cast<float>(int4_at(row, c) - zero) * scale;
    }
  }
}

#endif  // KILN_ISA == KILN_ISA_GENERIC || KILN_ISA == KILN_ISA_AVX2 || KILN_ISA == KILN_ISA_AVX512

#if KILN_ISA == KILN_ISA_AVX2 || KILN_ISA == KILN_ISA_AVX512_VNNI  // ---------------- int16 GEMV (bfloat16 x)

// bfloat16 x (the engine's activations): the same chunks read as sixteen 16-bit words, word i holding
// columns 4i .. 4i+3, column 4i + k in bits [4k, 4k + 4). XOR 0x8888 turns every two's-complement nibble q
// into u = q + 8 in [0, 15]; one AND (k = 0), a logical shift and an AND (k = 1, 2) or one shift (k = 3)
// give u of one nibble position in sixteen 16-bit lanes, and VPMADDWD multiplies them with int16 x: 64
// weights cost seven decode instructions (three of them shifts) and four multiplies. The offset comes off
// once per row and group with the zero point: sum (q - zero) x = sum u x - (zero + 8) sum x.
//
// x is block floating point: per token and group, x16 = round(x * 2^-e) with the power of two chosen so
// that max |x| of the group maps into [2^14, 2^15): 15 significant bits for the group's largest values
// (bfloat16 x has 8), an absolute error of at most 2^-16 max |x| per column. Products and sums are exact in
// int32 within a group (u x16 sums at most 15 * 32767 * 8 per lane per chunk, groups of at most
// kMaxInt16GroupCols columns); the group's scale times 2^e then multiplies the group's sums once, and
// (zero + 8) * scale * (2^e * sum of x16) comes off each group, eight groups per vector.
//   x16      [T, in] int16, row-major with `x_stride`, in chunk16 order: x16_c[64 j + 16 k + i] = x16[64 j + 4 i + k]
//   x_scale  [T, num_groups] float32 2^e;   x_sum [T, num_groups] float32 2^e * sum of the group's x16
//
// Rows are computed one at a time, each group's chunks decoded once and multiplied with every token. Four
// rows interleaved (the float32 kernel's layout, and this one's before) kept more vectors live than AVX2's
// sixteen registers and spilled them: one row at a time is ~9% faster on a cache-resident 3072x576 weight
// and ~14% on SmolLM2's int4 weights streamed from memory by two threads (3.8 against 4.4 ms).
constexpr int64_t kMaxInt16GroupCols = 32768;

// A group scale from float32 or from float16 bits (F16C): one, or eight consecutive groups'.
static inline float scale_at(const float* s, int64_t i) { return s[i]; }
static inline float scale_at(const uint16_t* s, int64_t i) { return _cvtsh_ss(s[i]); }
static inline __m256 load8_scales(const float* s) { return _mm256_loadu_ps(s); }
static inline __m256 load8_scales(const uint16_t* s) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s)));
}

static inline bool int16_kernel_applies(int64_t in, int64_t group_size) {
  return group_size % kChunkCols == 0 && group_size <= kMaxInt16GroupCols && in % kChunkCols == 0;
}

// One 64-column chunk (32 bytes of w) against NT tokens' x16 chunks (x_stride apart): acc[t] = (kFirst ? 0 :
// acc[t]) + the eight int32 lane sums of u * x16.
template <int NT, bool kFirst>
static inline void int16_chunk(const uint8_t* w, const int16_t* x, int64_t x_stride, __m256i* acc) {
  const __m256i flip = _mm256_set1_epi16(static_cast<int16_t>(0x8888)), low4 = _mm256_set1_epi16(0x000F);
  const __m256i u = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), flip);
  const __m256i u0 = _mm256_and_si256(u, low4);
  const __m256i u1 = _mm256_and_si256(_mm256_srli_epi16(u, 4), low4);
  const __m256i u2 = _mm256_and_si256(_mm256_srli_epi16(u, 8), low4);
  const __m256i u3 = _mm256_srli_epi16(u, 12);
  for (int t = 0; t < NT; ++t) {
    const __m256i* xt = reinterpret_cast<const __m256i*>(x + t * x_stride);
#if KILN_ISA == KILN_ISA_AVX512_VNNI
    // VPDPWSSD: VPMADDWD and the add in one instruction, two chains per token; the same int32 sums
    const __m256i a = kFirst ? _mm256_madd_epi16(u0, _mm256_loadu_si256(xt))
                             : _mm256_dpwssd_epi32(acc[t], u0, _mm256_loadu_si256(xt));
    const __m256i b = _mm256_madd_epi16(u2, _mm256_loadu_si256(xt + 2));
    acc[t] = _mm256_add_epi32(_mm256_dpwssd_epi32(a, u1, _mm256_loadu_si256(xt + 1)),
                              _mm256_dpwssd_epi32(b, u3, _mm256_loadu_si256(xt + 3)));
#else
    const __m256i p01 = _mm256_add_epi32(_mm256_madd_epi16(u0, _mm256_loadu_si256(xt)),
                                         _mm256_madd_epi16(u1, _mm256_loadu_si256(xt + 1)));
    const __m256i p23 = _mm256_add_epi32(_mm256_madd_epi16(u2, _mm256_loadu_si256(xt + 2)),
                                         _mm256_madd_epi16(u3, _mm256_loadu_si256(xt + 3)));
    acc[t] = kFirst ? _mm256_add_epi32(p01, p23) : _mm256_add_epi32(acc[t], _mm256_add_epi32(p01, p23));
#endif
  }
}

#if KILN_ISA == KILN_ISA_AVX512_VNNI
// The VNNI copy's 512-bit loop for group sizes 64 and 128 (int16_pairs_chunks): one 64-byte line of w,
// two chunks, per iteration, where the 256-bit loop takes one chunk. Its x is laid out once per call by
// int16_pair_chunks so that each nibble position's 32 columns of the two chunks are one 512-bit load:
//   x2[128 p + 32 k + 16 h + i] = x16_c[64 (2p + h) + 16 k + i]   (chunks 2p and 2p + 1, the pair p)
// and an odd last chunk keeps its place and order (the 256-bit loop takes it). Each 256-bit half of the
// line's int32 sums is the 256-bit loop's sum of that chunk, lane for lane (exact int32 either way), and
// the halves are converted and scaled in the same order, so the two copies' outputs are bitwise equal.
// Counted from the source, per 128 weights at one token: ~20 instructions against ~36.
static inline bool int16_pairs_chunks(int64_t group_size) {
  return group_size == kChunkCols || group_size == 2 * kChunkCols;
}

// dst [T, in] (row stride in) = x16 [T, in] (row stride x_stride, nibble_chunks order) in the pairs' order.
static void int16_pair_chunks(const int16_t* x16, int64_t num_tokens, int64_t in, int64_t x_stride, int16_t* dst) {
  const int64_t num_chunks = in / kChunkCols;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int16_t* src = x16 + t * x_stride;
    int16_t* d = dst + t * in;
    int64_t c = 0;
    for (; c + 2 <= num_chunks; c += 2)
      for (int k = 0; k < 4; ++k) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + c * kChunkCols + 16 * k));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + (c + 1) * kChunkCols + 16 * k));
        _mm512_storeu_si512(d + c * kChunkCols + 32 * k, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
      }
    for (int64_t j = c * kChunkCols; j < num_chunks * kChunkCols; j += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + j),
                          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j)));
  }
}

// One 64-byte line (chunks 2p, 2p + 1) against NT tokens' x2 pairs (x_stride apart): acc[t] = the sixteen
// int32 lane sums of u * x16, chunk 2p's eight in the low half.
template <int NT>
static inline void int16_line(const uint8_t* w, const int16_t* x, int64_t x_stride, __m512i* acc) {
  const __m512i flip = _mm512_set1_epi16(static_cast<int16_t>(0x8888)), low4 = _mm512_set1_epi16(0x000F);
  const __m512i u = _mm512_xor_si512(_mm512_loadu_si512(w), flip);
  const __m512i u0 = _mm512_and_si512(u, low4);
  const __m512i u1 = _mm512_and_si512(_mm512_srli_epi16(u, 4), low4);
  const __m512i u2 = _mm512_and_si512(_mm512_srli_epi16(u, 8), low4);
  const __m512i u3 = _mm512_srli_epi16(u, 12);
  for (int t = 0; t < NT; ++t) {
    const int16_t* xt = x + t * x_stride;
    const __m512i a = _mm512_madd_epi16(u0, _mm512_loadu_si512(xt));
    const __m512i b = _mm512_madd_epi16(u2, _mm512_loadu_si512(xt + 64));
    acc[t] = _mm512_add_epi32(_mm512_dpwssd_epi32(a, u1, _mm512_loadu_si512(xt + 32)),
                              _mm512_dpwssd_epi32(b, u3, _mm512_loadu_si512(xt + 96)));
  }
}
#endif

// One row's y[t] for NT tokens. kSpan: the chunks per group when known at compile time (1: group 64, 2:
// group 128), else 0; a run-time count of one chunk cost ~15% on SmolLM2's group-64 layers.
// group_scale: [NT, num_groups] scratch.
//
// At ~25 GB/s (two threads) this loop is as much bound by its instruction count as by the memory: ~30 per
// 64 weights at group size 64, of which the per-group scaling and loop were a third. So each group's scale
// and the token's x_scale are multiplied once per row (group_scale; exact, x_scale being a power of two,
// and the same single rounding of sum * x_scale * scale + total as before), and group-64 rows go two groups
// per iteration, with one prefetch for the two chunks' 64 bytes. The zero points' offsets are summed in
// the same pass over the row's scales.
template <int NT, bool kZeroPoint, int kSpan, typename Scale>
static inline void gemv_int16_row(const uint8_t* row, int64_t in, const Scale* scales, const int8_t* zeros,
                                  int64_t group_size, const int16_t* x, int64_t x_stride, const float* x_scale,
                                  const float* x_sum, float* group_scale, float* y, int64_t y_stride) {
  const int64_t num_groups = in / group_size, span = kSpan != 0 ? kSpan : group_size / kChunkCols;
  // group_scale[t, g] = scale[g] * x_scale[t, g], and total[t] starts from the offsets' share,
  // -sum_g (zero[g] + 8) * scale[g] * x_sum[t, g] (eight groups per vector, the rest in tail[t])
  const __m256 eight = _mm256_set1_ps(8.f);
  __m256 total[NT];
  float tail[NT];
  for (int t = 0; t < NT; ++t) {
    total[t] = _mm256_setzero_ps();
    tail[t] = 0.f;
  }
  int64_t g = 0;
  for (; g + 8 <= num_groups; g += 8) {
    const __m256 scale = load8_scales(scales + g);
    __m256 offset = eight;
    if (kZeroPoint)
      offset = _mm256_add_ps(offset, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                                         _mm_loadl_epi64(reinterpret_cast<const __m128i*>(zeros + g)))));
    const __m256 offset_scale = _mm256_mul_ps(offset, scale);
    for (int t = 0; t < NT; ++t) {
      _mm256_storeu_ps(group_scale + t * num_groups + g, _mm256_mul_ps(scale, _mm256_loadu_ps(x_scale + t * num_groups + g)));
      total[t] = _mm256_fnmadd_ps(offset_scale, _mm256_loadu_ps(x_sum + t * num_groups + g), total[t]);
    }
  }
  for (; g < num_groups; ++g) {
    const float scale = scale_at(scales, g), offset_scale = (static_cast<float>(kZeroPoint ? zeros[g] : 0) + 8.f) * scale;
    for (int t = 0; t < NT; ++t) {
      group_scale[t * num_groups + g] = scale * x_scale[t * num_groups + g];
      tail[t] -= offset_scale * x_sum[t * num_groups + g];
    }
  }
  // KILN_WEIGHT_PREFETCH_BYTES ahead in this thread's rows; every chunk (group-64 rows: every two)
  // prefetches, as the parity test that would halve them cost more than the duplicate hints (measured: ~7%
  // on a cache-resident 3072x576 weight)
  const int64_t prefetch_ahead = KILN_WEIGHT_PREFETCH_BYTES;
  const auto scale_group = [&](const __m256i* acc, int64_t group) {
    for (int t = 0; t < NT; ++t)
      total[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), _mm256_broadcast_ss(group_scale + t * num_groups + group),
                                 total[t]);
  };
  g = 0;
#if KILN_ISA == KILN_ISA_AVX512_VNNI
  if (kSpan == 1 || kSpan == 2) {  // x in int16_pair_chunks' order
    const int64_t num_lines = in / (2 * kChunkCols);
    for (int64_t l = 0; l < num_lines; ++l) {
      _mm_prefetch(reinterpret_cast<const char*>(row + prefetch_ahead + l * 64), KILN_WEIGHT_PREFETCH);
      __m512i acc[NT];
      int16_line<NT>(row + l * 64, x + l * 2 * kChunkCols, x_stride, acc);
      for (int t = 0; t < NT; ++t) {
        const float* scale = group_scale + t * num_groups;
        if (kSpan == 1) {  // two groups: the low half's, then the high half's
          const __m512 sums = _mm512_cvtepi32_ps(acc[t]);
          total[t] = _mm256_fmadd_ps(_mm512_castps512_ps256(sums), _mm256_broadcast_ss(scale + 2 * l), total[t]);
          total[t] = _mm256_fmadd_ps(_mm512_extractf32x8_ps(sums, 1), _mm256_broadcast_ss(scale + 2 * l + 1), total[t]);
        } else {  // one group: its two chunks' int32 sums added first, as the 256-bit loop accumulates them
          const __m256i sums = _mm256_add_epi32(_mm512_castsi512_si256(acc[t]), _mm512_extracti64x4_epi64(acc[t], 1));
          total[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_broadcast_ss(scale + l), total[t]);
        }
      }
    }
    g = kSpan == 1 ? 2 * num_lines : num_lines;
  }
#else
  if (kSpan == 1) {  // a 64-byte line holds two groups' chunks
    for (; g + 2 <= num_groups; g += 2) {
      _mm_prefetch(reinterpret_cast<const char*>(row + prefetch_ahead + g * 32), KILN_WEIGHT_PREFETCH);
      __m256i acc0[NT], acc1[NT];
      int16_chunk<NT, true>(row + g * 32, x + g * kChunkCols, x_stride, acc0);
      int16_chunk<NT, true>(row + (g + 1) * 32, x + (g + 1) * kChunkCols, x_stride, acc1);
      scale_group(acc0, g);
      scale_group(acc1, g + 1);
    }
  }
#endif
  for (; g < num_groups; ++g) {
    __m256i acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_si256();
    for (int64_t j = g * span; j < (g + 1) * span; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(row + prefetch_ahead + j * 32), KILN_WEIGHT_PREFETCH);
      int16_chunk<NT, false>(row + j * 32, x + j * kChunkCols, x_stride, acc);
    }
    scale_group(acc, g);
  }
  for (int t = 0; t < NT; ++t) y[t * y_stride] = hsum8(total[t]) + tail[t];
}

// The weight and activation views it reads, Int4Weight and Int16Tokens, are int4_linear.cpp's: one pair of
// types for both ISA copies.

// Rows [row_begin, row_end) for NT tokens (x: tokens' first token). Not inlined into its caller: compiled
// together, the three token counts' loops made GCC keep the one-token loop's scale pointer on the stack, a
// store-to-load chain per group (3072x576 through the op, one thread: 116.8 us against 106.2 once this was
// its own function). The views are unpacked into locals first.
template <int NT, bool kZeroPoint, int kSpan, typename Scale>
__attribute__((noinline)) static void gemv_int16_rows_nt(const Int4Weight<Scale> weight, int64_t row_begin,
                                                         int64_t row_end, const Int16Tokens x, float* group_scale,
                                                         float* y, int64_t y_stride) {
  const uint8_t* w = weight.w;
  const Scale* scales = weight.scales;
  const int8_t* zeros = weight.zeros;
  const int64_t in = weight.in, group_size = weight.group_size;
  const int16_t* x16 = x.x16;
  const int64_t x_stride = x.stride;
  const float *x_scale = x.x_scale, *x_sum = x.x_sum;
  const int64_t row_bytes = in / 2, num_groups = in / group_size;
  for (int64_t r = row_begin; r < row_end; ++r)
    gemv_int16_row<NT, kZeroPoint, kSpan, Scale>(w + r * row_bytes, in, scales + r * num_groups,
                                   kZeroPoint ? zeros + r * num_groups : nullptr, group_size, x16, x_stride, x_scale,
                                   x_sum, group_scale, y + r, y_stride);
}

template <bool kZeroPoint, typename Scale>
static void gemv_int16_rows_zp(const Int4Weight<Scale>& weight, int64_t row_begin, int64_t row_end,
                               const Int16Tokens& x, float* group_scale, float* y, int64_t y_stride) {
  const int64_t num_groups = weight.in / weight.group_size, group_size = weight.group_size;
  int64_t t = 0;
  const auto run = [&](auto nt) {
    constexpr int NT = decltype(nt)::value;
    const auto rows = group_size == kChunkCols       ? gemv_int16_rows_nt<NT, kZeroPoint, 1, Scale>
                      : group_size == 2 * kChunkCols ? gemv_int16_rows_nt<NT, kZeroPoint, 2, Scale>
                                                     : gemv_int16_rows_nt<NT, kZeroPoint, 0, Scale>;
    const Int16Tokens tokens{x.x16 + t * x.stride, x.stride, x.x_scale + t * num_groups, x.x_sum + t * num_groups, NT};
    rows(weight, row_begin, row_end, tokens, group_scale, y + t * y_stride, y_stride);
    t += NT;
  };
  while (t + 4 <= x.num_tokens) run(std::integral_constant<int, 4>{});
  if (x.num_tokens - t >= 2) run(std::integral_constant<int, 2>{});
  if (t < x.num_tokens) run(std::integral_constant<int, 1>{});
}

// y[t, r] for rows [row_begin, row_end) and every token of x (int16_kernel_applies); y's rows y_stride
// apart. group_scale: the calling thread's scratch of 4 * num_groups floats.
template <typename Scale>
static void gemv_int16_rows(const Int4Weight<Scale>& weight, int64_t row_begin, int64_t row_end, const Int16Tokens& x,
                            float* group_scale, float* y, int64_t y_stride) {
  if (weight.zeros != nullptr) gemv_int16_rows_zp<true, Scale>(weight, row_begin, row_end, x, group_scale, y, y_stride);
  else gemv_int16_rows_zp<false, Scale>(weight, row_begin, row_end, x, group_scale, y, y_stride);
}

#endif

#if KILN_ISA == KILN_ISA_AVX2
#include "int16_quantize.h"

void widen_half(const uint16_t* src, int64_t n, float* dst) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(dst + i, load8_scales(src + i));
  for (; i < n; ++i) dst[i] = scale_at(src, i);
}
#elif KILN_ISA == KILN_ISA_AVX512_BF16
#include "fp8_bf16_gemm.h"
#include "bf16_tile.h"
#include "bf16_gemv.h"
#include "int4_bf16_gemv.h"

// Generation phase, bfloat16 x: y[t, o] (+ bias[o]) for rows [r0, r1) through int4_bf16_gemv.h; out's rows
// are out_stride apart.
void gemv_int4_rows(const Int4GemvArgs& args, int64_t num_tokens, const float* bias, uint16_t* out,
                    int64_t out_stride, int64_t r0, int64_t r1) {
  const GemvEpilogue epilogue(out, out_stride, bias);
  if (args.zeros != nullptr) int4_gemv_rows<true>(args, num_tokens, r0, r1, epilogue);
  else int4_gemv_rows<false>(args, num_tokens, r0, r1, epilogue);
}

// The context phase's bfloat16 tiles, straight from the packed rows, where in % 64 == 0 and
// group_size % 64 == 0 (chunk64_applies): columns in *chunk64 order*, each 64-column chunk (32 bytes of a
// row) as its 32 even columns (the bytes' low nibbles) then its 32 odd ones (the high nibbles):
//
//   chunk64[64 j + i] = col[64 j + 2 i],  chunk64[64 j + 32 + i] = col[64 j + 2 i + 1]     (i in 0..31)
//
// x goes into the same order (to_bf16_chunk64), so a tile's dot products are the natural ones summed in
// that order. Per row and group, the 16 values (q - zero) * scale (float32, rounded to nearest even once,
// as a bf16 checkpoint's weights are) make a bfloat16 table, twice over in 32 words; VPERMW reads its
// index's low 5 bits, so a byte widened to a 16-bit word looks its low nibble up directly (bit 4 picks
// the table's copy) and the word shifted right by 4 its high nibble: 64 weights are one widening, one
// shift and two lookups (on an Intel Xeon with AMX, 2-3x faster than converting dequant_rows' float32).
static bool chunk64_applies(int64_t in, int64_t group_size) { return in % 64 == 0 && group_size % 64 == 0; }

// Rows [row_begin, row_end) into dst [rows, in] bfloat16 bits in chunk64 order (chunk64_applies).
static void dequant_rows_bf16(const uint8_t* w, int64_t in, const float* scales, const int8_t* zeros,
                              int64_t group_size, int64_t row_begin, int64_t row_end, uint16_t* dst) {
  const int64_t row_bytes = in / 2, num_groups = in / group_size, num_chunks = group_size / 64;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const uint8_t* row = w + r * row_bytes;
    uint16_t* out = dst + (r - row_begin) * in;
    for (int64_t g = 0; g < num_groups; ++g) {
      const __m256i table16 = (__m256i)_mm512_cvtneps_pbh(scaled_table(scales[r * num_groups + g], zero_at(zeros, r * num_groups + g)));
      const __m512i table = _mm512_broadcast_i64x4(table16);
      for (int64_t j = 0; j < num_chunks; ++j) {
        const int64_t c = g * group_size + 64 * j;
        const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c / 2)));
        _mm512_storeu_si512(out + c, _mm512_permutexvar_epi16(bytes, table));
        _mm512_storeu_si512(out + c + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(bytes, 4), table));
      }
    }
  }
}

// The 16 values q - zero of a nibble (q its two's complement) in float32 (exact), for every int8 zero point:
// zero_tables().values[zero + 128] (16 KiB, made once), so that a group's table is one load and one multiply.
struct ZeroTables {
  alignas(64) float values[256][16];
  ZeroTables() {
    for (int z = -128; z < 128; ++z)
      for (int i = 0; i < 16; ++i) values[z + 128][i] = static_cast<float>(((i ^ 8) - 8) - z);
  }
};
static const ZeroTables& zero_tables() {
  static const ZeroTables tables;
  return tables;
}

// Rows [0, rows) (rows <= 32) of w (rows row_bytes apart; scales [rows, num_groups] float32, zeros
// [rows, num_groups] int8 or null) and columns [c0, c1) (multiples of 64) as AMX A tiles, as amx_bf16.h's
// AmxWeightSource fills them: dst [(c1 - c0) / 32][32][32] bfloat16 bits, 64-byte aligned, the 64-column
// chunk at c in steps (c - c0) / 32 (its even columns) and the next (its odd ones) -- each row's columns in
// dequant_rows_bf16's chunk64 order, with its values (the same bits) -- and rows `rows` to 31 zero. Rows go
// in pairs: one VCVTNE2PS2BF16 (~2.5 cycles on an Intel Xeon with AMX, the costliest step) rounds both
// rows' group tables, the first's in words 0-15 and the second's in 16-31, and bit 4 of the lookups' index
// picks the row (a byte's high nibble, shifted down, has it clear; the low nibble gets it cleared or set,
// the second row's high nibble set).
static void dequant_amx_steps(const uint8_t* w, int64_t row_bytes, const float* scales, const int8_t* zeros,
                              int64_t num_groups, int64_t group_size, int64_t rows, int64_t c0, int64_t c1,
                              uint16_t* dst) {
  constexpr int64_t kStep = 32 * 32;  // bfloat16 elements of one step's 32 rows
  const __m512i low4 = _mm512_set1_epi16(0x0F), second = _mm512_set1_epi16(0x10);
  const ZeroTables& tables = zero_tables();
  const auto table_of = [&](int64_t r, int64_t g) {  // (q - zero) * scale in float32, nibble by nibble
    const int64_t i = r * num_groups + g;
    return _mm512_mul_ps(_mm512_load_ps(tables.values[zero_at(zeros, i) + 128]), _mm512_set1_ps(scales[i]));
  };
  for (int64_t r = 0; r < rows; r += 2) {
    // an odd count's last row pairs with itself; its partner's stores land in row `rows`, zeroed below
    const int64_t r1 = r + 1 < rows ? r + 1 : r;
    const uint8_t* row0 = w + r * row_bytes;
    const uint8_t* row1 = w + r1 * row_bytes;
    uint16_t* out = dst + r * 32;
    int64_t g = c0 / group_size, group_end = (g + 1) * group_size;
    __m512i table = (__m512i)_mm512_cvtne2ps_pbh(table_of(r1, g), table_of(r, g));
    for (int64_t c = c0; c < c1; c += 64, out += 2 * kStep) {
      if (c == group_end) {  // group_size % 64 == 0: a chunk never straddles two groups
        ++g;
        group_end += group_size;
        table = (__m512i)_mm512_cvtne2ps_pbh(table_of(r1, g), table_of(r, g));
      }
      const __m512i b0 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row0 + c / 2)));
      const __m512i b1 = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row1 + c / 2)));
      _mm512_store_si512(out, _mm512_permutexvar_epi16(_mm512_and_si512(b0, low4), table));
      _mm512_store_si512(out + kStep, _mm512_permutexvar_epi16(_mm512_srli_epi16(b0, 4), table));
      // (b1 & 0x0F) | 0x10
      _mm512_store_si512(out + 32, _mm512_permutexvar_epi16(_mm512_ternarylogic_epi32(b1, low4, second, 0xEA), table));
      _mm512_store_si512(out + kStep + 32,
                         _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(b1, 4), second), table));
    }
  }
  for (int64_t step = 0; step < (c1 - c0) / 32; ++step)
    for (int64_t z = rows; z < 32; ++z) _mm512_store_si512(dst + step * kStep + z * 32, _mm512_setzero_si512());
}

// x [n] float32 (n % 64 == 0) as bfloat16 bits in chunk64 order into dst [n], rounded to nearest even.
static void to_bf16_chunk64(const float* src, int64_t n, uint16_t* dst) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1));
  for (int64_t c = 0; c < n; c += 64) {
    const __m512 v0 = _mm512_loadu_ps(src + c), v1 = _mm512_loadu_ps(src + c + 16);
    const __m512 v2 = _mm512_loadu_ps(src + c + 32), v3 = _mm512_loadu_ps(src + c + 48);
    // VCVTNE2PS2BF16 (a, b): b's 16 values in words 0..15, a's in 16..31
    _mm512_storeu_si512(dst + c, (__m512i)_mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(v2, even, v3),
                                                              _mm512_permutex2var_ps(v0, even, v1)));
    _mm512_storeu_si512(dst + c + 32, (__m512i)_mm512_cvtne2ps_pbh(_mm512_permutex2var_ps(v2, odd, v3),
                                                                   _mm512_permutex2var_ps(v0, odd, v1)));
  }
}
#endif
