// float32 -> bfloat16 conversion of the quantized GEMMs' context-phase operands, included by int4_kernels.h
// and int8_kernels.h in their KILN_ISA_AVX512_BF16 copy (isa_variants.h), next to fp8_bf16_gemm.h (whose
// bf16_gemm_nt multiplies them).

// dst[i] = bfloat16 bits of src[i] rounded to nearest even for i < n, and 0 for n <= i < n_pad.
static void to_bf16_padded(const float* src, int64_t n, uint16_t* dst, int64_t n_pad) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + i)));
  if (i < n) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m256i v = (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + i));
    _mm256_mask_storeu_epi16(dst + i, mask, v);
    i = n;
  }
  for (; i < n_pad; ++i) dst[i] = 0;
}

// dst[i] = bfloat16 bits of the int8 src[i] (exact: 8 significant bits) for i < n, 0 for n <= i < n_pad.
static void int8_to_bf16_padded(const int8_t* src, int64_t n, uint16_t* dst, int64_t n_pad) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), (__m256i)_mm512_cvtneps_pbh(v));
  }
  for (; i < n; ++i) {  // exact: the float32 bits of a small integer end in 16 zero bits
    const float f = static_cast<float>(src[i]);
    uint32_t bits;
    __builtin_memcpy(&bits, &f, sizeof(bits));
    dst[i] = static_cast<uint16_t>(bits >> 16);
  }
  for (; i < n_pad; ++i) dst[i] = 0;
}
