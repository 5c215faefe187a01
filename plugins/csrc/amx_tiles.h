// What the AMX kernels share (bf16_amx_gemm.h, int8_amx_gemm.h, attention_kernels.h' AMX path): the tile
// configuration, a 16 x 16 transpose and the bf16 GEMM's weight prefetch. A kernel header of the AMX copy
// (isa_variants.h) includes it once in its namespace.

// Palette 1, all eight tiles 16 rows x 64 bytes.
inline void amx_configure_tiles() {
  struct alignas(64) {
    uint8_t palette_id = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {64, 64, 64, 64, 64, 64, 64, 64};
    uint8_t rows[16] = {16, 16, 16, 16, 16, 16, 16, 16};
  } config;
  _tile_loadconfig(&config);
}

// In-register transpose of a 16 x 16 matrix of 32-bit elements, v[i] its row i in and its column i out.
inline void transpose16x16(__m512 v[16]) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 2]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 1]), d = _mm512_castps_pd(t[4 * i + 3]);
    v[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
    v[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    v[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
    v[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
  }
  // v[4i + q], 128-bit lane l: rows 4i..4i+3, column 4l + q; gather the lanes
  for (int q = 0; q < 4; ++q) {
    const __m512 b0 = _mm512_shuffle_f32x4(v[q], v[4 + q], 0x88), b1 = _mm512_shuffle_f32x4(v[q], v[4 + q], 0xdd);
    const __m512 b2 = _mm512_shuffle_f32x4(v[8 + q], v[12 + q], 0x88), b3 = _mm512_shuffle_f32x4(v[8 + q], v[12 + q], 0xdd);
    t[q] = _mm512_shuffle_f32x4(b0, b2, 0x88);
    t[8 + q] = _mm512_shuffle_f32x4(b0, b2, 0xdd);
    t[4 + q] = _mm512_shuffle_f32x4(b1, b3, 0x88);
    t[12 + q] = _mm512_shuffle_f32x4(b1, b3, 0xdd);
  }
  for (int i = 0; i < 16; ++i) v[i] = t[i];
}

// The weight prefetch of the AMX bf16 GEMM (bf16_amx_gemm.h), whose A tiles are 16 rows x 64 bytes of a
// 32-row weight block (kAmxBlockRows; the block's rows one after another in memory, row_bytes apart) and
// which takes one 64-byte column step of both A tiles at a time:
//  - the next block into L2, spread evenly over every step the block takes (all its token pairs and k
//    chunks), in memory order (AmxNextBlockPrefetch): 32 lines a step where the block has one token pair,
//    8 where it has four;
//  - during a block's first token pair (the pass that reads its weights from memory; the later pairs find
//    a k chunk of them in L1), this block's 32 rows of step i + kAmxL1PrefetchSteps into L1
//    (amx_prefetch_rows_l1).
// Without the L1 prefetch, a layer's time grew with the tokens per step as if the weights' stream and the
// tiles' arithmetic did not overlap (bf16, cold 3072x576, two threads: 1 to 16 tokens ~215 us, 32 tokens
// 305-347, 64 tokens 446-505, against ~33 us of TDPBF16PS work per thread at 32 tokens); our reading is
// that each step's TILELOADDs waited on L2 while the previous step's tile products still held the same
// tile registers. On the 2-vCPU Xeon with AMX (family 6 model 207), cold weights of one layer, alternating
// in one process: 3072x576 at 32 tokens 315 -> 265-277 us, 576x1536 at 1 token 135 -> 109 us and at 32
// tokens 201 -> 159 (docs/performance.md has the engine's figures). Spreading the next block's prefetch
// over all of a block's steps, where it had been requested during the first pair's alone, leaves the
// weights' stream the whole block's time: the model's 120 cold bf16 layers at 128 tokens 57.6 -> 51.8 ms
// and at 256 tokens 100.6 -> 91.4 (medians of 30 alternations), 32 tokens unchanged. The int8 AMX GEMM
// (int8_amx_gemm.h) with the same prefetches ran within 5% of its time without them at 4-128 tokens (cold
// 3072x576 and 576x1536 int8_sq layers, the same Xeon), so it keeps the hardware prefetchers alone.
constexpr int64_t kAmxPrefetchRows = 32;
constexpr int64_t kAmxL1PrefetchSteps = 2;

// The next block's L2 prefetch over one block's steps (a block of steps_per_pair 64-byte column steps per
// token pair, num_pairs pairs): step() requests the next share of its kAmxPrefetchRows * steps_per_pair
// lines, nothing where next_block is null.
class AmxNextBlockPrefetch {
 public:
  AmxNextBlockPrefetch(const char* next_block, int64_t steps_per_pair, int64_t num_pairs)
      : next_(next_block),
        end_(next_block == nullptr ? 0 : kAmxPrefetchRows * steps_per_pair),
        per_step_((kAmxPrefetchRows + num_pairs - 1) / num_pairs) {}

  void step() {
    const int64_t end = line_ + per_step_ < end_ ? line_ + per_step_ : end_;
    for (; line_ < end; ++line_) _mm_prefetch(next_ + line_ * 64, KILN_WEIGHT_PREFETCH);
  }

 private:
  const char* next_;
  int64_t line_ = 0, end_, per_step_;
};

// The 64 bytes at column step i of the 32 rows of `block` (row_bytes apart) into L1.
inline void amx_prefetch_rows_l1(const void* block, int64_t row_bytes, int64_t i) {
  const char* p = static_cast<const char*>(block) + 64 * i;
  for (int64_t row = 0; row < kAmxPrefetchRows; ++row) _mm_prefetch(p + row * row_bytes, _MM_HINT_T0);
}
