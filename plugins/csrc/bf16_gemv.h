// Generation-phase GEMV / small GEMM on CPUs with AVX512-BF16, shared by gemm.cpp (bfloat16 weights),
// fp8_linear.cpp (FP8 weights, its own row loader Fp8Rows) and int8_linear.cpp (int8 weights), the
// quantized ones converted to bfloat16 in registers; int4_linear.cpp has its own loop (int4_bf16_gemv.h)
// around this file's epilogue. Included by those ops' kernel headers in their KILN_ISA_AVX512_BF16 copy
// (fp8: KILN_ISA_AVX512_VBMI) of isa_variants.h, after fp8_bf16_gemm.h (reduce16).
//
// y[t, r] = sum_k x[t, k] * w[r, k] for a few tokens t: each 16-row block of w is read from memory once
// and multiplied with VDPBF16PS (pairwise bf16 products, exact in float32, accumulated in float32)
// against every token, in groups of 4 / 2 / 1 tokens while the block sits in L1/L2. Decode is bound by
// the bytes of weights read, so the weights are streamed once per call with software prefetch ahead.

// 32 consecutive weights of a row as bfloat16 pairs.
struct Bf16Weights {
  using elem_t = uint16_t;
  static inline __m512bh load(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
};

// int8 bytes -> bfloat16, exactly (|q| <= 128 needs at most 8 significant bits).
struct Int8Weights {
  using elem_t = int8_t;
  static inline __m512bh load(const int8_t* p) {
    const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
  }
};

// The weight rows a GEMV reads, kCols columns (32 or 64; k a multiple of it) at a time:
// load(r, i, out) writes columns [i, i + kCols) of row r as kCols / 32 vectors of bfloat16 pairs, in the
// loader's column order (the caller gives x the same order), address(r, i) is where they are stored (for
// prefetching) and kChunkBytes their size.
template <class W>
struct PlainRows {  // [rows, k] elements of W::elem_t, row-major, natural column order
  const typename W::elem_t* w;
  int64_t k;
  static constexpr int64_t kCols = 32;
  static constexpr int64_t kChunkBytes = 32 * sizeof(typename W::elem_t);
  inline void load(int64_t r, int64_t i, __m512bh* out) const { out[0] = W::load(w + r * k + i); }
  inline const void* address(int64_t r, int64_t i) const { return w + r * k + i; }
};

// What happens to a dot product: y[t, r] = sum * row_scale[r] + bias[r], or with per-token scales
// (fp8_rowwise_linear) sum * (token_scale[t] * row_scale[r]) + bias[r] -- each factor optional, in this order:
// the rounding steps of the ops' references -- stored as bfloat16 (round to nearest even) or float32 at
// out[t * out_stride + r]. Sixteen outputs at a time in vector registers.
struct GemvEpilogue {
  GemvEpilogue(void* out_, int64_t out_stride_, const float* bias_, const float* row_scale_ = nullptr,
               bool out_bf16_ = true, const float* token_scale_ = nullptr)
      : row_scale(row_scale_), bias(bias_), token_scale(token_scale_), out(out_), out_bf16(out_bf16_),
        out_stride(out_stride_) {}
  const float* row_scale;    // [rows] per-row factor, or null
  const float* bias;         // [rows], or null
  const float* token_scale;  // [T] per-token factor (needs row_scale), or null
  void* out;
  bool out_bf16;
  int64_t out_stride;

  // sums: lane n = t * NR + r holds the dot product of token t0 + t and row r0 + r.
  template <int NR>
  inline void store16(int64_t t0, int64_t r0, __m512 v) const {
    constexpr int NT = 16 / NR;
    constexpr int kLog2NR = __builtin_ctz(NR);
    static_assert((1 << kLog2NR) == NR, "NR is a power of two");
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i row_of_lane = _mm512_and_si512(lane, _mm512_set1_epi32(NR - 1));
    const __mmask16 row_mask = static_cast<__mmask16>((1u << NR) - 1u);
    if (row_scale != nullptr) {
      __m512 factor = _mm512_permutexvar_ps(row_of_lane, _mm512_maskz_loadu_ps(row_mask, row_scale + r0));
      if (token_scale != nullptr) {  // token_scale[t] * row_scale[r], one float32 product as the reference
        const __m512i token_of_lane = _mm512_srli_epi32(lane, kLog2NR);
        const __mmask16 token_mask = static_cast<__mmask16>((1u << NT) - 1u);
        factor = _mm512_mul_ps(_mm512_permutexvar_ps(token_of_lane, _mm512_maskz_loadu_ps(token_mask, token_scale + t0)),
                               factor);
      }
      v = _mm512_mul_ps(v, factor);
    }
    if (bias != nullptr)
      v = _mm512_add_ps(v, _mm512_permutexvar_ps(row_of_lane, _mm512_maskz_loadu_ps(row_mask, bias + r0)));
    if (out_bf16) {
      alignas(32) uint16_t y[16];
      _mm256_store_si256(reinterpret_cast<__m256i*>(y), (__m256i)_mm512_cvtneps_pbh(v));
      uint16_t* dst = static_cast<uint16_t*>(out);
      for (int t = 0; t < NT; ++t) __builtin_memcpy(dst + (t0 + t) * out_stride + r0, y + t * NR, NR * sizeof(uint16_t));
    } else {
      alignas(64) float y[16];
      _mm512_store_ps(y, v);
      float* dst = static_cast<float*>(out);
      for (int t = 0; t < NT; ++t) __builtin_memcpy(dst + (t0 + t) * out_stride + r0, y + t * NR, NR * sizeof(float));
    }
  }

  inline void store1(int64_t t, int64_t r, float sum) const {  // the rows past the last whole block
    float y = sum;
    if (token_scale != nullptr) y = y * (token_scale[t] * row_scale[r]);
    else if (row_scale != nullptr) y = y * row_scale[r];
    if (bias != nullptr) y = y + bias[r];
    if (out_bf16) {
      static_cast<uint16_t*>(out)[t * out_stride + r] = kiln::bf16_bits(y);  // bf16_bits.h
    } else {
      static_cast<float*>(out)[t * out_stride + r] = y;
    }
  }
};

constexpr int64_t kGemvBlockRows = 16;      // weight rows per block: 16 accumulators for 1x16, 2x8, 4x4
constexpr int64_t kGemvPrefetchBlocks = 2;  // how many blocks ahead the first token group prefetches
// Calls of up to this many tokens (batch-1 decode, a speculative step's verification) read each block's
// rows in order in their first token group (gemv_tile_rows_in_order); more tokens make the block's compute
// outweigh its bytes, and x's loads per row with them. AMD EPYC Zen 5 (2 vCPUs), SmolLM2's 269 MB of bf16
// weights cold on huge pages, alternating builds, three rounds: T = 2 7.5-7.7 against 9.6-10.3 ms, T = 4
// 5.7-9.8 against 10.2-11.2, T = 5 6.6-10.4 against 10.3-11.6, T = 8 8.2-12.5 against 11.1-12.4.
constexpr int64_t kGemvInOrderMaxTokens = 8;

// Lane n = the total of accumulator acc[n]'s 16 lanes (reduce16, then its order undone).
static inline __m512 reduce16_by_lane(const __m512* acc) {
  alignas(64) float reduced[16];  // reduce16: reduced[4 * (n % 4) + n / 4] = total of accumulator n
  reduce16(acc, reduced);
  const __m512i natural = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(natural, _mm512_load_ps(reduced));
}

// Lane t * NR + r of the result = dot(x_t, w_{r0 + r}) for NT tokens x NR rows (NT * NR == 16); x: NT rows
// of k bf16 bits (in the loader's column order), x_stride apart; k a multiple of L::kCols. The NR rows
// column chunk by column chunk, so that each x load serves NR rows: the tiles of later token groups read
// the block from L1/L2. pf_row (or -1): the first of NR rows of a later block, touched one cache line per
// row per 64 bytes so that DRAM streams ahead of the dot products.
template <class L, int NT, int NR>
static inline __m512 gemv_tile(const uint16_t* x, int64_t x_stride, const L& rows, int64_t r0, int64_t k,
                               int64_t pf_row) {
  static_assert(NT * NR == 16, "reduce16 sums exactly 16 accumulators");
  constexpr int V = static_cast<int>(L::kCols / 32);  // bf16 vectors per load
  __m512 acc[NT][NR];
  for (int t = 0; t < NT; ++t)
    for (int r = 0; r < NR; ++r) acc[t][r] = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += L::kCols) {
    __m512bh xv[NT][V];
    for (int t = 0; t < NT; ++t)
      for (int v = 0; v < V; ++v) xv[t][v] = (__m512bh)_mm512_loadu_si512(x + t * x_stride + i + 32 * v);
    if (pf_row >= 0 && (i / L::kCols * L::kChunkBytes) % 64 == 0)
      for (int r = 0; r < NR; ++r) _mm_prefetch(static_cast<const char*>(rows.address(pf_row + r, i)), KILN_WEIGHT_PREFETCH);
    for (int r = 0; r < NR; ++r) {
      __m512bh wv[V];
      rows.load(r0 + r, i, wv);
      for (int v = 0; v < V; ++v)
        for (int t = 0; t < NT; ++t) acc[t][r] = _mm512_dpbf16_ps(acc[t][r], xv[t][v], wv[v]);
    }
  }
  return reduce16_by_lane(&acc[0][0]);
}

// gemv_tile for a block that the first group of a call with few tokens reads from memory: the same sums
// (each accumulator over its columns in order, bit for bit), but the rows one after another, a single
// sequential stream per thread that the hardware prefetchers follow and the software prefetch runs
// KILN_WEIGHT_PREFETCH_BYTES ahead of (isa_variants.h), where NR rows interleaved chunk by chunk are NR
// short streams. x is loaded again for every row (from L1). prefetch_end: where the weights end (nothing
// past it is prefetched).
template <class L, int NT, int NR>
static inline __m512 gemv_tile_rows_in_order(const uint16_t* x, int64_t x_stride, const L& rows, int64_t r0,
                                             int64_t k, const char* prefetch_end) {
  static_assert(NT * NR == 16, "reduce16 sums exactly 16 accumulators");
  constexpr int V = static_cast<int>(L::kCols / 32);  // bf16 vectors per load
  __m512 acc[NT][NR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) {
    for (int t = 0; t < NT; ++t) acc[t][r] = _mm512_setzero_ps();
    for (int64_t i = 0; i < k; i += L::kCols) {
      if ((i / L::kCols * L::kChunkBytes) % 64 == 0) {
        const char* ahead = static_cast<const char*>(rows.address(r0 + r, i)) + KILN_WEIGHT_PREFETCH_BYTES;
        if (ahead < prefetch_end) _mm_prefetch(ahead, KILN_WEIGHT_PREFETCH);
      }
      __m512bh wv[V];
      rows.load(r0 + r, i, wv);
      for (int v = 0; v < V; ++v)
        for (int t = 0; t < NT; ++t)
          acc[t][r] = _mm512_dpbf16_ps(acc[t][r], (__m512bh)_mm512_loadu_si512(x + t * x_stride + i + 32 * v), wv[v]);
    }
  }
  return reduce16_by_lane(&acc[0][0]);
}

// For rows [r0, r1) (r1 - r0 a multiple of kGemvBlockRows) and every token t < num_tokens: y[t, r] by
// `epilogue` from dot(x_t, row r as loaded). Each block's first token group reads it from memory, the
// later ones from L1/L2.
template <class L>
static void gemv_rows(const uint16_t* x, int64_t num_tokens, int64_t x_stride, const L& rows, int64_t num_rows_total,
                      int64_t k, int64_t r0, int64_t r1, const GemvEpilogue& epilogue) {
  const char* const prefetch_end = static_cast<const char*>(rows.address(num_rows_total, 0));
  const bool in_order = num_tokens <= kGemvInOrderMaxTokens;
  for (int64_t r = r0; r < r1; r += kGemvBlockRows) {
    const int64_t ahead = r + kGemvPrefetchBlocks * kGemvBlockRows;
    const int64_t pf = ahead + kGemvBlockRows <= num_rows_total ? ahead : -1;
    int64_t t = 0;
    for (; t + 4 <= num_tokens; t += 4)
      for (int64_t sub = 0; sub < kGemvBlockRows; sub += 4)
        epilogue.store16<4>(t, r + sub, in_order && t == 0
            ? gemv_tile_rows_in_order<L, 4, 4>(x, x_stride, rows, r + sub, k, prefetch_end)
            : gemv_tile<L, 4, 4>(x + t * x_stride, x_stride, rows, r + sub, k, t == 0 && pf >= 0 ? pf + sub : -1));
    for (; t + 2 <= num_tokens; t += 2)
      for (int64_t sub = 0; sub < kGemvBlockRows; sub += 8)
        epilogue.store16<8>(t, r + sub, in_order && t == 0
            ? gemv_tile_rows_in_order<L, 2, 8>(x, x_stride, rows, r + sub, k, prefetch_end)
            : gemv_tile<L, 2, 8>(x + t * x_stride, x_stride, rows, r + sub, k, t == 0 && pf >= 0 ? pf + sub : -1));
    if (t < num_tokens)
      epilogue.store16<16>(t, r, t == 0
            ? gemv_tile_rows_in_order<L, 1, 16>(x, x_stride, rows, r, k, prefetch_end)
            : gemv_tile<L, 1, 16>(x + t * x_stride, x_stride, rows, r, k, -1));
  }
}

// Any row range [r0, r1): whole 16-row blocks through gemv_rows, the rest one row at a time.
template <class L>
static void gemv_any_rows(const uint16_t* x, int64_t num_tokens, int64_t x_stride, const L& rows,
                          int64_t num_rows_total, int64_t k, int64_t r0, int64_t r1, const GemvEpilogue& epilogue) {
  const int64_t full_end = r0 + (r1 - r0) / kGemvBlockRows * kGemvBlockRows;
  gemv_rows(x, num_tokens, x_stride, rows, num_rows_total, k, r0, full_end, epilogue);
  for (int64_t r = full_end; r < r1; ++r) {
    for (int64_t t = 0; t < num_tokens; ++t) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t i = 0; i < k; i += L::kCols) {
        __m512bh wv[L::kCols / 32];
        rows.load(r, i, wv);
        for (int64_t v = 0; v < L::kCols / 32; ++v)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(x + t * x_stride + i + 32 * v), wv[v]);
      }
      epilogue.store1(t, r, _mm512_reduce_add_ps(acc));
    }
  }
}
