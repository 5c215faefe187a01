// W8A8 GEMM of kilnlm::int8_sq_linear on AMX-INT8 tiles (Intel Sapphire Rapids and later), included by
// int8_kernels.h in its KILN_ISA_AMX_BF16 copy (isa_variants.h) and chosen at run time (cpu_has_amx_int8).
//
// TDPBSSD multiplies an A tile (16 rows of 64 int8) by a B tile (16 rows of 16 int8 quads) into a C tile
// (16 x 16 int32), four products summed into each int32 at a time. A is the weight itself -- 16 rows x 64
// columns of the plain [out, in] tensor, loaded with a row stride of in -- and B is x_q packed into quads
// by amx_bf16_pack (64 int8 columns are 64 bytes, as 32 bfloat16 pairs are: [T/16][in/64][16 quads][16
// tokens]), so a C tile is 16 weight rows x 16 tokens. A block of 32 weight rows meets 32 tokens at a time
// (4 C tiles, 2 A, 2 B), tokens in chunks of 256 whose packed x stays in L2 while the rows pass.
//
// Every product is exact in int32 and so is every sum (|x_q * w| <= 2^14: in_features up to 2^17), so the
// sums are those of the VNNI and VPMADDWD kernels, bit for bit, whatever the order.

// out[t, r] = float(sum) * (token_scale[t] * row_scale[r], or row_scale[r]) (+ bias[r]) in bfloat16 (rounded
// to nearest even, NaN as 0x7FC0: c10::BFloat16's conversion) or float32, the roundings of
// kiln::Epilogue::store in its order, 16 rows of one token at a time.
struct AmxInt8Epilogue {
  const float* row_scale;    // [out]
  const float* token_scale;  // [T] per-token scales, or null
  const float* bias;         // [out], or null
  void* out;
  int64_t out_stride;
  bool out_bf16;

  inline void store(int64_t t, int64_t r, __m512i sums, __mmask16 rows) const {
    __m512 factor = _mm512_maskz_loadu_ps(rows, row_scale + r);
    if (token_scale != nullptr) factor = _mm512_mul_ps(_mm512_set1_ps(token_scale[t]), factor);
    __m512 y = _mm512_mul_ps(_mm512_cvtepi32_ps(sums), factor);
    if (bias != nullptr) y = _mm512_add_ps(y, _mm512_maskz_loadu_ps(rows, bias + r));
    if (!out_bf16) return _mm512_mask_storeu_ps(static_cast<float*>(out) + t * out_stride + r, rows, y);
    const __m512i u = _mm512_castps_si512(y);
    __m512i h = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1)))),
        16);
    h = _mm512_mask_mov_epi32(h, _mm512_cmp_ps_mask(y, y, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
    _mm256_mask_storeu_epi16(static_cast<uint16_t*>(out) + t * out_stride + r, rows, _mm512_cvtepi32_epi16(h));
  }
};

constexpr int64_t kAmxInt8BlockRows = 32;      // weight rows per block: two 16-row A tiles
constexpr int64_t kAmxInt8Tokens = 16;         // tokens per B / C tile
constexpr int64_t kAmxInt8ChunkTokens = 256;   // tokens per pass over the rows

// Output rows r.. for the 32 rows of w (in apart) -- the first valid_rows of them -- and the tokens of the
// 16-token blocks [b_begin, b_end) below num_tokens, through `epilogue`.
static inline void amx_int8_block(const int8_t* w, int64_t in, const uint32_t* packed, int64_t b_begin, int64_t b_end,
                                  int64_t num_tokens, int64_t r, int64_t valid_rows, const AmxInt8Epilogue& epilogue) {
  const int64_t steps = in / 64;
  const int8_t* w1 = w + 16 * in;
  alignas(64) int32_t c[4][16][16];  // C tile q: rows 16 * (q / 2).., tokens of block b + q % 2
  for (int64_t b = b_begin; b < b_end; b += 2) {
    const bool two = b + 1 < b_end;
    const uint32_t* x0 = packed + b * steps * 256;
    const uint32_t* x1 = x0 + steps * 256;
    _tile_zero(0);
    _tile_zero(2);
    if (two) {
      _tile_zero(1);
      _tile_zero(3);
      for (int64_t i = 0; i < steps; ++i) {
        _tile_loadd(4, w + 64 * i, in);
        _tile_loadd(5, w1 + 64 * i, in);
        _tile_loadd(6, x0 + 256 * i, 64);
        _tile_loadd(7, x1 + 256 * i, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(1, 4, 7);
        _tile_dpbssd(2, 5, 6);
        _tile_dpbssd(3, 5, 7);
      }
      _tile_stored(1, c[1], 64);
      _tile_stored(3, c[3], 64);
    } else {
      for (int64_t i = 0; i < steps; ++i) {
        _tile_loadd(4, w + 64 * i, in);
        _tile_loadd(5, w1 + 64 * i, in);
        _tile_loadd(6, x0 + 256 * i, 64);
        _tile_dpbssd(0, 4, 6);
        _tile_dpbssd(2, 5, 6);
      }
    }
    _tile_stored(0, c[0], 64);
    _tile_stored(2, c[2], 64);
    for (int q = 0; q < 4; ++q) {
      if (!two && q % 2 == 1) continue;  // no second token block
      const int64_t t0 = (b + q % 2) * kAmxInt8Tokens, row0 = 16 * (q / 2);
      // (no std::min here: see isa_variants.h)
      const int64_t rows = valid_rows - row0 < 16 ? valid_rows - row0 : 16;
      const int64_t tokens = num_tokens - t0 < kAmxInt8Tokens ? num_tokens - t0 : kAmxInt8Tokens;
      if (rows <= 0 || tokens <= 0) continue;
      __m512 v[16];  // int32 bits, transposed as 32-bit lanes
      for (int i = 0; i < 16; ++i) v[i] = _mm512_load_ps(reinterpret_cast<const float*>(c[q][i]));
      transpose16x16(v);
      const __mmask16 mask = static_cast<__mmask16>((1u << rows) - 1u);
      for (int64_t t = 0; t < tokens; ++t) epilogue.store(t0 + t, r + row0, _mm512_castps_si512(v[t]), mask);
    }
  }
}

// out rows [row_begin, row_end) (row_begin a multiple of 32) for every token of packed x_q through
// `epilogue`, from the exact int32 sums over c of x_q[t, c] * w[r, c]; in % 64 == 0. tail: 32 * in bytes of
// scratch for the rows past the last whole 32-row block.
static void gemm_amx_int8_rows(const int8_t* w, int64_t in, int64_t row_begin, int64_t row_end, const uint32_t* packed,
                               int64_t num_tokens, int8_t* tail, const AmxInt8Epilogue& epilogue) {
  amx_configure_tiles();  // C tiles 0-3, A (weights) 4-5, B (x) 6-7, all 16 rows x 64 bytes
  const int64_t whole_end = row_begin + (row_end - row_begin) / kAmxInt8BlockRows * kAmxInt8BlockRows;
  if (whole_end < row_end) {
    __builtin_memcpy(tail, w + whole_end * in, static_cast<size_t>((row_end - whole_end) * in));
    __builtin_memset(tail + (row_end - whole_end) * in, 0, static_cast<size_t>((kAmxInt8BlockRows - (row_end - whole_end)) * in));
  }
  const int64_t num_blocks = (num_tokens + kAmxInt8Tokens - 1) / kAmxInt8Tokens;
  const int64_t chunk_blocks = kAmxInt8ChunkTokens / kAmxInt8Tokens;
  for (int64_t b0 = 0; b0 < num_blocks; b0 += chunk_blocks) {
    const int64_t b1 = b0 + chunk_blocks < num_blocks ? b0 + chunk_blocks : num_blocks;
    for (int64_t r = row_begin; r < whole_end; r += kAmxInt8BlockRows)
      amx_int8_block(w + r * in, in, packed, b0, b1, num_tokens, r, kAmxInt8BlockRows, epilogue);
    if (whole_end < row_end) amx_int8_block(tail, in, packed, b0, b1, num_tokens, whole_end, row_end - whole_end, epilogue);
  }
  _tile_release();
}
