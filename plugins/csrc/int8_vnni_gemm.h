// W8A8 GEMM of kilnlm::int8_sq_linear on CPUs with AVX512-VNNI (Intel Cascade Lake+, AMD Zen 4+),
// included by int8_kernels.h in its KILN_ISA_AVX512_VNNI copy (isa_variants.h) and chosen at run time.
//
// VPDPBUSD multiplies 64 unsigned by 64 signed bytes, four products summed into each int32 lane: one
// instruction per 64 multiply-adds (VPMADDWD needs a sign extension, a multiply and an add per 32). The
// activations are offset into u8 (x_q + 128) and the offset is taken back exactly per output row:
//
//   sum_c (x_q[c] + 128) * w[c] - 128 * sum_c w[c] = sum_c x_q[c] * w[c]      (int32, exact: |terms| <
//   2^15, so in_features up to 2^16 cannot overflow)
//
// The weight is read in place (no repacking): dot products of whole rows, NR rows x NT tokens at a time,
// over tiles of kVnniTileRows rows whose row sums are computed once per call.

constexpr int64_t kVnniTileRows = 64;

static inline __mmask64 column_mask(int64_t c, int64_t in) {
  return in - c >= 64 ? ~__mmask64{0} : ((__mmask64{1} << (in - c)) - 1);
}

// sums[r - r0] = sum_c w[r, c] for rows [r0, r1).
static void row_sums(const int8_t* w, int64_t in, int64_t r0, int64_t r1, int32_t* sums) {
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t r = r0; r < r1; ++r) {
    __m512i acc = _mm512_setzero_si512();
    for (int64_t c = 0; c < in; c += 64)
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_loadu_epi8(column_mask(c, in), w + r * in + c));
    sums[r - r0] = _mm512_reduce_add_epi32(acc);
  }
}

// Horizontal sums of 16 accumulators at once (a transpose-and-add tree instead of 16 reductions, the
// integer twin of reduce16 in fp8_bf16_gemm.h): out[4 * (n % 4) + n / 4] = sum of a[n]'s 16 lanes.
static inline void reduce16_epi32(const __m512i* a, int32_t* out) {
  __m512i x[8], y[4];
  for (int m = 0; m < 8; ++m)
    x[m] = _mm512_add_epi32(_mm512_shuffle_i32x4(a[2 * m], a[2 * m + 1], 0x44),
                            _mm512_shuffle_i32x4(a[2 * m], a[2 * m + 1], 0xEE));
  for (int p = 0; p < 4; ++p)
    y[p] = _mm512_add_epi32(_mm512_shuffle_i32x4(x[2 * p], x[2 * p + 1], 0x88),
                            _mm512_shuffle_i32x4(x[2 * p], x[2 * p + 1], 0xDD));
  const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(y[0], y[1]), _mm512_unpackhi_epi32(y[0], y[1]));
  const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(y[2], y[3]), _mm512_unpackhi_epi32(y[2], y[3]));
  _mm512_storeu_si512(out, _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23)));
}

// y[t, r] = sum_c x_q[t, c] * w[r, c] for NR rows and NT tokens. xu: NT rows of in bytes (x_q + 128),
// `xu_stride` apart; sums: the NR rows' column sums.
template <int NR, int NT>
static inline void vnni_block(const int8_t* w, int64_t in, const uint8_t* xu, int64_t xu_stride, const int32_t* sums,
                              int32_t* y, int64_t y_stride) {
  __m512i acc[NR][NT];
  for (int r = 0; r < NR; ++r)
    for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_setzero_si512();
  for (int64_t c = 0; c < in; c += 64) {
    const __mmask64 mask = column_mask(c, in);
    if ((c & 127) == 0) {
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (r + 4 * NR) * in + c), KILN_WEIGHT_PREFETCH);
    }
    __m512i xv[NT];
    for (int t = 0; t < NT; ++t) xv[t] = _mm512_maskz_loadu_epi8(mask, xu + t * xu_stride + c);
    for (int r = 0; r < NR; ++r) {
      const __m512i wv = _mm512_maskz_loadu_epi8(mask, w + r * in + c);
      for (int t = 0; t < NT; ++t) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], xv[t], wv);
    }
  }
  if constexpr (NR == 4 && NT == 4) {
    __m512i flat[16];  // a copy, so acc itself is never address-taken (and stays in registers)
    for (int n = 0; n < 16; ++n) flat[n] = acc[n / 4][n % 4];
    int32_t total[16];  // total[4 * t + r]
    reduce16_epi32(flat, total);
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < NR; ++r) y[t * y_stride + r] = total[4 * t + r] - 128 * sums[r];
  } else {
    for (int r = 0; r < NR; ++r)
      for (int t = 0; t < NT; ++t) y[t * y_stride + r] = _mm512_reduce_add_epi32(acc[r][t]) - 128 * sums[r];
  }
}

template <int NT>
static inline void vnni_rows(const int8_t* w, int64_t in, int64_t r0, int64_t r1, const uint8_t* xu, int64_t xu_stride,
                             const int32_t* sums, int32_t* y, int64_t y_stride) {
  constexpr int NR = 4;
  int64_t r = r0;
  for (; r + NR <= r1; r += NR) vnni_block<NR, NT>(w + r * in, in, xu, xu_stride, sums + (r - r0), y + r, y_stride);
  for (; r < r1; ++r) vnni_block<1, NT>(w + r * in, in, xu, xu_stride, sums + (r - r0), y + r, y_stride);
}

// y[t, r] = sum_c x_q[t, c] * w[r, c] (int32, exact) for rows [row_begin, row_end) and every token: tile by
// tile of kVnniTileRows rows, every token block passing over a tile while it is in cache.
static void gemm_vnni_rows(const int8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const uint8_t* xu,
                           int64_t num_tokens, int64_t xu_stride, int32_t* y, int64_t y_stride) {
  int32_t sums[kVnniTileRows];
  for (int64_t r0 = row_begin; r0 < row_end; r0 += kVnniTileRows) {
    const int64_t r1 = row_end - r0 < kVnniTileRows ? row_end : r0 + kVnniTileRows;
    row_sums(w, in, r0, r1, sums);
    int64_t t = 0;
    for (; t + 4 <= num_tokens; t += 4)
      vnni_rows<4>(w, in, r0, r1, xu + t * xu_stride, xu_stride, sums, y + t * y_stride, y_stride);
    if (num_tokens - t >= 2) {
      vnni_rows<2>(w, in, r0, r1, xu + t * xu_stride, xu_stride, sums, y + t * y_stride, y_stride);
      t += 2;
    }
    if (t < num_tokens) vnni_rows<1>(w, in, r0, r1, xu + t * xu_stride, xu_stride, sums, y + t * y_stride, y_stride);
  }
}
