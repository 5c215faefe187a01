// bfloat16 GEMM on AMX tiles (Intel Sapphire Rapids and later), y [T, n] = x [T, k] @ w [n, k].T, for
// every token count T: the AMX copy of gemm_kernels.h (isa_variants.h), after bf16_gemv.h (GemvEpilogue).
//
// TDPBF16PS multiplies an A tile (16 rows of 32 bfloat16) by a B tile (16 rows of 16 bfloat16 pairs) into
// a C tile (16 x 16 float32), each product exact in float32 and added to C in k order. Here A is the
// weight itself -- 16 rows x 32 columns of the plain [n, k] tensor, loaded with a row stride of k, so the
// weights need no repacking and the tied LM head keeps sharing the embedding's tensor -- and B is x
// transposed into bfloat16 pairs (amx_pack_x, [T/16][k/32][16 pairs][16 tokens]), so a C tile is 16
// weight rows x 16 tokens, transposed back on the way out. A block of 32 weight rows is multiplied against
// 32 tokens at a time (4 C tiles, 2 A, 2 B: each loaded tile feeds two TDPBF16PS). Tokens go in chunks
// of 256, whose packed x stays in L2 while a thread's rows pass; within a chunk a block's rows go in k
// chunks that stay in L1 for every token pair (a GEMM's usual cache blocking; on a 2-core Xeon with AMX,
// 3072x576 at 2048 tokens went from 1.1 to ~2 TFLOP/s of the cores' 6.4).
//
// Every (token, row) is one float32 chain over k in 32-column steps whatever the token count and whatever
// tile the token or the row lands in, so a row's result is the same bits alone or in a batch of any size
// (batch invariance; speculative verification sums as plain decoding does). Rows past the last whole
// 32-row block are copied into a zero-padded block first, so they take the same arithmetic too.

constexpr int64_t kAmxBlockRows = 32;  // weight rows per block: two 16-row A tiles
constexpr int64_t kAmxTokens = 16;     // tokens per B / C tile

// uint32 elements of amx_pack_x's output for num_tokens tokens of k columns (k a multiple of 32).
inline int64_t amx_packed_x_size(int64_t num_tokens, int64_t k) {
  return (num_tokens + kAmxTokens - 1) / kAmxTokens * kAmxTokens * (k / 2);
}

// packed[b][i][p][t] = bfloat16 pair (x[16b + t, 32i + 2p], x[16b + t, 32i + 2p + 1]) as uint32, zero for
// the tokens past num_tokens: B tile (b, i) is the 1 KiB at packed + (b * k / 32 + i) * 256. Token blocks
// [b0, b1) of the (num_tokens + 15) / 16.
void amx_pack_x(const uint16_t* x, int64_t num_tokens, int64_t x_stride, int64_t k, uint32_t* packed, int64_t b0,
                int64_t b1) {
  const int64_t steps = k / 32;
  for (int64_t b = b0; b < b1; ++b)
    for (int64_t i = 0; i < steps; ++i) {
      __m512 v[16];
      for (int64_t t = 0; t < kAmxTokens; ++t) {
        const int64_t token = b * kAmxTokens + t;
        v[t] = token < num_tokens ? _mm512_loadu_ps(x + token * x_stride + 32 * i) : _mm512_setzero_ps();
      }
      transpose16x16(v);
      float* tile = reinterpret_cast<float*>(packed + (b * steps + i) * 256);
      for (int p = 0; p < 16; ++p) _mm512_storeu_ps(tile + 16 * p, v[p]);
    }
}

// 16-bit lanes 2j and 2j + 1 <- lanes j and 16 + j: two rows of 16 bfloat16 interleaved into pairs.
alignas(64) constexpr uint16_t kAmxPairLanes[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                    8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// The bfloat16 outputs of all 32 rows r.. of a block for `tokens` (5-16) tokens from t0: C tiles lo (rows
// 0-15) and hi (rows 16-31) of one 16-token block. Each C row (one output row, a vector over the tokens)
// takes its row_scale (times token_scale), then its bias, as GemvEpilogue::store16 applies them, and rows
// 2i and 2i + 1 become one vector of bfloat16 pairs, so that a single 16 x 16 transpose of 32-bit lanes
// turns the block into each token's 32 outputs, one 64-byte store apiece, where store16 takes a transpose per
// C tile and a conversion and a store per token and tile: half the shuffles. (The whole epilogue left out,
// a 3072 x 576 layer ran 23-30% faster at 128-256 tokens; this change gained 3-8% of it.) The same bits.
inline void amx_store_block_bf16(const float (*lo)[16], const float (*hi)[16], int64_t t0, int64_t tokens, int64_t r,
                                 const GemvEpilogue& epilogue) {
  const __mmask16 token_mask = static_cast<__mmask16>((1u << tokens) - 1u);
  const bool token_scaled = epilogue.token_scale != nullptr;
  const __m512 token_scale =
      token_scaled ? _mm512_maskz_loadu_ps(token_mask, epilogue.token_scale + t0) : _mm512_setzero_ps();
  const __m512i pair_lanes = _mm512_load_si512(kAmxPairLanes);
  __m512 pairs[16];
  for (int i = 0; i < 16; ++i) {
    __m512 v[2];
    for (int u = 0; u < 2; ++u) {
      const int row = 2 * i + u;
      __m512 x = _mm512_load_ps(row < 16 ? lo[row] : hi[row - 16]);
      if (epilogue.row_scale != nullptr) {
        const __m512 factor = _mm512_set1_ps(epilogue.row_scale[r + row]);
        x = _mm512_mul_ps(x, token_scaled ? _mm512_mul_ps(token_scale, factor) : factor);
      }
      if (epilogue.bias != nullptr) x = _mm512_add_ps(x, _mm512_set1_ps(epilogue.bias[r + row]));
      v[u] = x;
    }
    const __m512i both = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(v[1], v[0]));  // row 2i, then 2i + 1
    pairs[i] = _mm512_castsi512_ps(_mm512_permutexvar_epi16(pair_lanes, both));
  }
  transpose16x16(pairs);
  uint16_t* out = static_cast<uint16_t*>(epilogue.out);
  for (int64_t t = 0; t < tokens; ++t)
    _mm512_storeu_si512(out + (t0 + t) * epilogue.out_stride + r, _mm512_castps_si512(pairs[t]));
}

// A 32-row block's four C tiles c (amx_block's) out through `epilogue`: rows r.. (valid_rows of them),
// tokens of the 16-token blocks b and b + 1 below num_tokens.
inline void amx_store_block(const float (*c)[16][16], int64_t b, int64_t num_tokens, int64_t r, int64_t valid_rows,
                            const GemvEpilogue& epilogue) {
  const bool paired = valid_rows == kAmxBlockRows && epilogue.out_bf16;  // a whole block of bf16 outputs
  if (paired) {
    for (int q = 0; q < 2; ++q) {
      const int64_t t0 = (b + q) * kAmxTokens;
      const int64_t tokens = num_tokens - t0 < kAmxTokens ? num_tokens - t0 : kAmxTokens;
      if (tokens > 4) amx_store_block_bf16(c[q], c[q + 2], t0, tokens, r, epilogue);
    }
  }
  for (int q = 0; q < 4; ++q) {
    const int64_t t0 = (b + q % 2) * kAmxTokens, row0 = 16 * (q / 2);
    // (no std::min here: see isa_variants.h)
    const int64_t rows = valid_rows - row0 < 16 ? valid_rows - row0 : 16;
    const int64_t tokens = num_tokens - t0 < kAmxTokens ? num_tokens - t0 : kAmxTokens;
    if (rows <= 0 || tokens <= 0) continue;
    if (paired && tokens > 4) continue;  // amx_store_block_bf16's
    __m512 v[16];
    if (tokens <= 4) {  // a few tokens (decode): each one's column of C alone
      const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(16));
      for (int64_t t = 0; t < tokens; ++t) v[t] = _mm512_i32gather_ps(column, &c[q][0][t], 4);
    } else {
      for (int i = 0; i < 16; ++i) v[i] = _mm512_load_ps(c[q][i]);
      transpose16x16(v);
    }
    for (int64_t t = 0; t < tokens; ++t) {
      if (rows == 16) {
        epilogue.store16<16>(t0 + t, r + row0, v[t]);
      } else {
        alignas(64) float sums[16];
        _mm512_store_ps(sums, v[t]);
        for (int64_t i = 0; i < rows; ++i) epilogue.store1(t0 + t, r + row0 + i, sums[i]);
      }
    }
  }
}

// Tokens per pass over the weights: their packed x (k = 1536: 768 KiB) stays in L2 while a thread's rows
// stream past it. At 2048 tokens one pass over all of them ran 3072x576 at 1.1 TFLOP/s, from L3.
constexpr int64_t kAmxChunkTokens = 256;
// 32-column steps per k chunk when a block has several token pairs: the block's 32 weight rows of one
// chunk (k = 576: three chunks of 6 steps, 12 KiB) stay in L1 for every pair, whose C tiles go to memory
// between chunks. Summing in k order through float32 C tiles, this changes no bit.
constexpr int64_t kAmxChunkSteps = 6;

// A token pair's C tiles 0-3 (tiles 1 and 3 only with its second block, `two`): from zero for a block's first
// k chunk, else back from c, where the last chunk left them.
inline void amx_begin_pair(float (*c)[16][16], bool from_zero, bool two) {
  if (from_zero) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    return;
  }
  _tile_loadd(0, c[0], 64);
  _tile_loadd(2, c[2], 64);
  if (two) {
    _tile_loadd(1, c[1], 64);
    _tile_loadd(3, c[3], 64);
  }
}

inline void amx_end_pair(float (*c)[16][16], bool two) {
  _tile_stored(0, c[0], 64);
  _tile_stored(2, c[2], 64);
  if (two) {
    _tile_stored(1, c[1], 64);
    _tile_stored(3, c[3], 64);
  }
}

// 32-column steps [i0, i1) of a 32-row block into a token pair's C tiles: step i's A tiles (rows 0-15 and
// 16-31) at a + (i - i0) * a_step and a_half elements further, rows a_stride bytes apart, against the B tiles
// of the pair's token blocks b0 (and b1 with kTwo); before(i) runs ahead of step i's loads.
template <bool kTwo, typename Before>
inline void amx_pair_steps(const uint16_t* a, int64_t a_step, int64_t a_half, int64_t a_stride, const uint32_t* b0,
                           const uint32_t* b1, int64_t i0, int64_t i1, const Before& before) {
  for (int64_t i = i0; i < i1; ++i, a += a_step) {
    before(i);
    _tile_loadd(4, a, a_stride);
    _tile_loadd(5, a + a_half, a_stride);
    _tile_loadd(6, b0 + 256 * i, 64);
    if (kTwo) _tile_loadd(7, b1 + 256 * i, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (kTwo) _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    if (kTwo) _tile_dpbf16ps(3, 5, 7);
  }
}

// One 32-row block of weights w (rows k apart) against tokens [t_begin, t_end) of packed x (t_begin a
// multiple of 32, t_end - t_begin <= kAmxChunkTokens): y rows r..r + valid_rows through `epilogue`.
// next_block: the next 32 rows of w (usually the ones the thread reads next), or null; every step prefetches
// a share of it into L2, and the first token pair's steps this block's next steps into L1 (amx_tiles.h).
inline void amx_block(const uint16_t* w, int64_t k, const uint32_t* packed_x, int64_t t_begin, int64_t t_end,
                      int64_t r, int64_t valid_rows, const GemvEpilogue& epilogue, const char* next_block) {
  const int64_t steps = k / 32, stride = k * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t b_begin = t_begin / kAmxTokens, b_end = (t_end + kAmxTokens - 1) / kAmxTokens;
  const int64_t num_chunks = b_end - b_begin > 2 ? (steps + kAmxChunkSteps - 1) / kAmxChunkSteps : 1;
  const int64_t chunk_steps = (steps + num_chunks - 1) / num_chunks;
  // C tiles of each token pair; C tile q: rows 16 * (q / 2).., tokens of block b + q % 2
  alignas(64) float c_all[kAmxChunkTokens / (2 * kAmxTokens)][4][16][16];
  AmxNextBlockPrefetch prefetch(next_block, steps, (b_end - b_begin + 1) / 2);
  for (int64_t i0 = 0; i0 < steps; i0 += chunk_steps) {
    const int64_t i1 = i0 + chunk_steps < steps ? i0 + chunk_steps : steps;
    for (int64_t b = b_begin; b < b_end; b += 2) {
      const bool two = b + 1 < b_end;
      const bool first_pair = b == b_begin;
      const int64_t l1_end = first_pair ? steps - kAmxL1PrefetchSteps : 0;  // steps that pull a later one into L1
      float(*c)[16][16] = c_all[(b - b_begin) / 2];
      const uint32_t* b0 = packed_x + b * steps * 256;
      const uint32_t* b1 = b0 + steps * 256;
      amx_begin_pair(c, i0 == 0, two);
      const auto before = [&](int64_t i) {
        prefetch.step();
        if (i < l1_end) amx_prefetch_rows_l1(w, 2 * k, i + kAmxL1PrefetchSteps);
      };
      if (two) amx_pair_steps<true>(w + 32 * i0, 32, 16 * k, stride, b0, b1, i0, i1, before);
      else amx_pair_steps<false>(w + 32 * i0, 32, 16 * k, stride, b0, b1, i0, i1, before);
      amx_end_pair(c, two);
      if (i1 == steps) amx_store_block(c, b, t_end, r, valid_rows, epilogue);
    }
  }
}

// y rows [r0, r1) of w [n, k] (r0 a multiple of 32; k a multiple of 32) against every token of packed x
// (amx_pack_x), through `epilogue`, kAmxChunkTokens tokens at a time. tail_block: 32 * k bfloat16 of
// scratch for the rows past the last whole block (r1 == n, n % 32 != 0), or null where w's rows are
// there, zero, up to the next multiple of 32. The next block is prefetched past r1 too, up to n's last
// whole block: a thread's next chunk of rows (row_blocks.h) usually follows this one.
void amx_gemm_rows(const uint32_t* packed_x, int64_t num_tokens, const uint16_t* w, int64_t n, int64_t k, int64_t r0,
                   int64_t r1, uint16_t* tail_block, const GemvEpilogue& epilogue) {
  amx_configure_tiles();  // C tiles 0-3, A (weights) 4-5, B (x) 6-7
  const int64_t whole_end = r0 + (r1 - r0) / kAmxBlockRows * kAmxBlockRows;
  const uint16_t* tail = w + whole_end * k;
  if (whole_end < r1 && tail_block != nullptr) {
    __builtin_memcpy(tail_block, tail, static_cast<size_t>((r1 - whole_end) * k) * sizeof(uint16_t));
    __builtin_memset(tail_block + (r1 - whole_end) * k, 0,
                     static_cast<size_t>((kAmxBlockRows - (r1 - whole_end)) * k) * sizeof(uint16_t));
    tail = tail_block;
  }
  for (int64_t t = 0; t < num_tokens; t += kAmxChunkTokens) {
    const int64_t t_end = t + kAmxChunkTokens < num_tokens ? t + kAmxChunkTokens : num_tokens;
    for (int64_t r = r0; r < whole_end; r += kAmxBlockRows) {
      // the next block's rows into L2 while this one computes, spread over all of its steps (amx_tiles.h)
      const char* next = r + 2 * kAmxBlockRows <= n ? reinterpret_cast<const char*>(w + (r + kAmxBlockRows) * k)
                                                    : nullptr;
      amx_block(w + r * k, k, packed_x, t, t_end, r, kAmxBlockRows, epilogue, next);
    }
    if (whole_end < r1) amx_block(tail, k, packed_x, t, t_end, whole_end, r1 - whole_end, epilogue, nullptr);
  }
  _tile_release();
}

// One 32-row block of a weight that `source` fills (amx_bf16.h, AmxWeightSource) against tokens
// [t_begin, t_end) of packed x, as amx_block, a k chunk at a time: the source writes a chunk's A tiles into
// one of two L1-resident buffers ([kAmxFillSteps][32][32] bfloat16, 12 KiB each) one chunk ahead of the tile
// products that read them. With one token pair its C tiles stay in tile registers from chunk to chunk and a
// chunk is 2 steps (64 columns); with several, every pair's C tiles go to memory between chunks of
// kAmxFillSteps. Every (token, row) sums in k order in 32-column steps, as amx_block.
inline void amx_filled_block(const kiln::AmxWeightSource& source, uint16_t* buffers, int64_t steps,
                             const uint32_t* packed_x, int64_t t_begin, int64_t t_end, int64_t r, int64_t valid_rows,
                             const GemvEpilogue& epilogue) {
  constexpr int64_t kStepElems = kAmxBlockRows * 32;  // one step of the block: two A tiles
  const int64_t b_begin = t_begin / kAmxTokens, b_end = (t_end + kAmxTokens - 1) / kAmxTokens;
  const bool one_pair = b_end - b_begin <= 2;
  const int64_t chunk = one_pair ? 2 : kiln::kAmxFillSteps;
  const auto buffer = [&](int64_t i0) { return buffers + (i0 / chunk & 1) * kiln::kAmxFillSteps * kStepElems; };
  const auto fill = [&](int64_t i0) {
    source.fill(source.self, r, valid_rows, i0, i0 + chunk < steps ? i0 + chunk : steps, buffer(i0));
  };
  alignas(64) float c_all[kAmxChunkTokens / (2 * kAmxTokens)][4][16][16];
  fill(0);
  for (int64_t i0 = 0; i0 < steps; i0 += chunk) {
    const int64_t i1 = i0 + chunk < steps ? i0 + chunk : steps;
    if (i1 < steps) fill(i1);
    const uint16_t* w = buffer(i0);
    for (int64_t b = b_begin; b < b_end; b += 2) {
      const bool two = b + 1 < b_end;
      float(*c)[16][16] = c_all[(b - b_begin) / 2];
      const uint32_t* b0 = packed_x + b * steps * 256;
      const uint32_t* b1 = b0 + steps * 256;
      if (i0 == 0 || !one_pair) amx_begin_pair(c, i0 == 0, two);
      const auto nothing = [](int64_t) {};
      if (two) amx_pair_steps<true>(w, kStepElems, kStepElems / 2, 64, b0, b1, i0, i1, nothing);
      else amx_pair_steps<false>(w, kStepElems, kStepElems / 2, 64, b0, b1, i0, i1, nothing);
      if (one_pair && i1 < steps) continue;  // the sums stay in tiles 0-3 for the next chunk
      amx_end_pair(c, two);
      if (i1 == steps) amx_store_block(c, b, t_end, r, valid_rows, epilogue);
    }
  }
}

// Rows [r0, r1) (r0 a multiple of 32) of a weight that `source` fills, against the num_tokens (at most
// kAmxChunkTokens: one pass) tokens of packed x, through `epilogue`. buffers: two fill buffers,
// 2 * kAmxFillSteps * 32 * 32 bfloat16, 64-byte aligned.
void amx_filled_rows(const uint32_t* packed_x, int64_t num_tokens, const kiln::AmxWeightSource& source, int64_t k,
                     int64_t r0, int64_t r1, uint16_t* buffers, const GemvEpilogue& epilogue) {
  amx_configure_tiles();  // C tiles 0-3, A (weights) 4-5, B (x) 6-7
  for (int64_t r = r0; r < r1; r += kAmxBlockRows) {
    const int64_t rows = r1 - r < kAmxBlockRows ? r1 - r : kAmxBlockRows;
    amx_filled_block(source, buffers, k / 32, packed_x, 0, num_tokens, r, rows, epilogue);
  }
  _tile_release();
}
