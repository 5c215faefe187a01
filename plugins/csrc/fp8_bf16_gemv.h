// Generation-phase GEMV of kilnlm::fp8_linear on CPUs with AVX512-BF16 and AVX512-VBMI: FP8 weight rows
// converted to exact bfloat16 in registers (byte tables, VPERMI2B) for bf16_gemv.h's loop. Included by
// fp8_kernels.h in the KILN_ISA_AVX512_VBMI copy only, after fp8_bf16_gemm.h and bf16_gemv.h; fp8_lut()
// is the including file's (fp8_linear.cpp).

// bfloat16 bits of every E4M3 magnitude 0..127, from fp8_lut (exact: at most 4 significant bits,
// exponents 2^-9..2^8, all normal in bfloat16; 0x7F, NaN, stays a NaN), split into low and high bytes
// for VPERMI2B.
struct Fp8Bf16Table {
  alignas(64) uint8_t lo[128];
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t pairs[64];  // byte 2j and 2j + 1 of a vector <- byte j of 32 loaded weights
  Fp8Bf16Table() {
    for (int b = 0; b < 128; ++b) {
      uint32_t u;
      std::memcpy(&u, &fp8_lut().value[b], sizeof(u));
      const auto bits = static_cast<uint16_t>(u >> 16);  // the low 16 bits are zero
      lo[b] = static_cast<uint8_t>(bits & 0xFF);
      hi[b] = static_cast<uint8_t>(bits >> 8);
    }
    for (int j = 0; j < 64; ++j) pairs[j] = static_cast<uint8_t>(j / 2);
  }
};

// FP8 E4M3 weight rows ([rows, k] bytes, row-major) as their exact bfloat16 values: each byte is copied
// into both bytes of a 16-bit lane (VPERMB), VPERMI2B looks the magnitude (bits 0-6) up in the low-byte
// table for the even bytes and in the high-byte table for the odd ones, and the sign bit is ORed back.
// Four vector instructions per 32 weights (the F16C route, byte -> half -> float -> bfloat16, took about
// twice as many and bound the GEMV by compute on Zen 5 at ~17 GB/s per core).
// What both loaders below share: the rows, the byte tables in registers, and where a chunk is stored.
struct Fp8TableRows {
  Fp8TableRows(const uint8_t* w_, int64_t k_) : w(w_), k(k_) {
    lo0 = _mm512_load_si512(table().lo);
    lo1 = _mm512_load_si512(table().lo + 64);
    hi0 = _mm512_load_si512(table().hi);
    hi1 = _mm512_load_si512(table().hi + 64);
  }
  static const Fp8Bf16Table& table() {
    static const Fp8Bf16Table t;
    return t;
  }
  const uint8_t* w;
  int64_t k;
  __m512i lo0, lo1, hi0, hi1;
  inline const void* address(int64_t r, int64_t i) const { return w + r * k + i; }
};

struct Fp8Rows : Fp8TableRows {
  Fp8Rows(const uint8_t* w_, int64_t k_) : Fp8TableRows(w_, k_), pairs(_mm512_load_si512(table().pairs)) {}
  __m512i pairs;
  static constexpr int64_t kCols = 32;
  static constexpr int64_t kChunkBytes = 32;
  inline void load(int64_t r, int64_t i, __m512bh* out) const {
    const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + r * k + i));
    const __m512i both = _mm512_permutexvar_epi8(pairs, _mm512_castsi256_si512(bytes));
    __m512i v = _mm512_mask2_permutex2var_epi8(lo0, both, __mmask64{0x5555555555555555ull}, lo1);
    v = _mm512_mask2_permutex2var_epi8(hi0, v, __mmask64{0xAAAAAAAAAAAAAAAAull}, hi1);
    out[0] = (__m512bh)_mm512_ternarylogic_epi32(v, both, _mm512_set1_epi16(static_cast<short>(0x8000)), 0xF8);  // v | (both & sign)
  }
};

// The same conversion 64 weights at a time with fewer permutes (rows of a multiple of 64 bytes): VPERMI2B
// looks the 64 bytes' magnitudes up once in the low-byte table and once in the high-byte one, the sign
// is ORed into the high bytes, and VPUNPCKLBW / VPUNPCKHBW interleave them into 16-bit lanes. Five vector
// instructions per 64 weights instead of eight, in an interleaved column order: per 128-bit lane L,
// out[0] holds columns 16 L + 0..7 and out[1] columns 16 L + 8..15 (pairs64_order gives x the same order).
// On an Intel Xeon the 32-byte loader's permutes bound the GEMV, not DRAM.
struct Fp8Rows64 : Fp8TableRows {
  using Fp8TableRows::Fp8TableRows;
  static constexpr int64_t kCols = 64;
  static constexpr int64_t kChunkBytes = 64;
  inline void load(int64_t r, int64_t i, __m512bh* out) const {
    const __m512i bytes = _mm512_loadu_si512(w + r * k + i);
    const __m512i lo = _mm512_permutex2var_epi8(lo0, bytes, lo1);  // index bits 0-6: the magnitude
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, bytes, hi1), bytes,
                                                 _mm512_set1_epi8(static_cast<char>(0x80)), 0xF8);  // hi | (bytes & sign)
    out[0] = (__m512bh)_mm512_unpacklo_epi8(lo, hi);
    out[1] = (__m512bh)_mm512_unpackhi_epi8(lo, hi);
  }
};

// y[t, o] = sum * scale[o] (+ bias[o]) for rows [r0, r1), or with token_scale (per-token activation scales,
// else null) sum * (token_scale[t] * scale[o]) (+ bias[o]); bfloat16 or float32 out: the sums are those of
// the reference's float32 accumulation (exact products, another order), and the epilogue rounds as the
// reference does (GemvEpilogue). xb in Fp8Rows64's order when in is a multiple of 64, else natural.
void gemv_fp8_rows(const uint16_t* xb, int64_t num_tokens, const uint8_t* w, int64_t out_features, int64_t in,
                   const float* scale, const float* token_scale, const float* bias, void* out, bool out_bf16, int64_t r0,
                   int64_t r1) {
  const GemvEpilogue epilogue(out, out_features, bias, scale, out_bf16, token_scale);
  if (in % Fp8Rows64::kCols == 0) return gemv_any_rows(xb, num_tokens, in, Fp8Rows64(w, in), out_features, in, r0, r1, epilogue);
  gemv_any_rows(xb, num_tokens, in, Fp8Rows(w, in), out_features, in, r0, r1, epilogue);
}
