// Raw attention kernels, written once and compiled twice by paged_attention.cpp: as a portable scalar
// version and, under `#pragma GCC target("avx2,fma,f16c")`, as an AVX2 version chosen at run time.
//
// Included *inside* a namespace after every system / torch header: includes nothing, uses raw pointers
// only (see fp8_kernels.h for why). KILN_AVX2 (0 or 1) selects the code path. `AttnWork` is defined by
// the including file, outside the ISA namespaces.

#if KILN_AVX2

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

static inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
  }
  for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
  float r = hsum8(_mm256_add_ps(s0, s1));
  for (; i < n; ++i) r += a[i] * b[i];
  return r;
}

// y += alpha * x
static inline void axpy_f32(float alpha, const float* x, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(a, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] += alpha * x[i];
}

static inline void scale_f32(float alpha, float* y, int64_t n) {
  const __m256 a = _mm256_set1_ps(alpha);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_mul_ps(a, _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] *= alpha;
}

// bfloat16 bits -> float32 (exact: the bf16 bits are the float's upper half)
static inline void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i)));
    _mm256_storeu_ps(dst + i, _mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
  }
  for (; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof(f));
    dst[i] = f;
  }
}

#else  // portable scalar path

static inline float dot_f32(const float* a, const float* b, int64_t n) {
  float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += a[i] * b[i];
    s1 += a[i + 1] * b[i + 1];
    s2 += a[i + 2] * b[i + 2];
    s3 += a[i + 3] * b[i + 3];
  }
  for (; i < n; ++i) s0 += a[i] * b[i];
  return (s0 + s1) + (s2 + s3);
}

static inline void axpy_f32(float alpha, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

static inline void scale_f32(float alpha, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] *= alpha;
}

static inline void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof(f));
    dst[i] = f;
  }
}

#endif

// One work item: the query vectors of `num_q_tokens` consecutive new tokens of one sequence, for query
// heads [head_begin, head_end) that all read KV head `kv_head`, over that sequence's paged KV.
// Flash-style online softmax over the KV blocks (Milakov & Gimelshein 2018, "Online normalizer
// calculation for softmax"; Dao et al. 2022, FlashAttention): per query vector a running max m, running
// sum l and unnormalized output acc; no [T, T] score matrix is ever built.
//
//   KV position p of the sequence:   block_table[p / tokens_per_block], offset p % tokens_per_block
//   query token qi sits at position  first_q_pos + qi and sees KV positions 0..first_q_pos + qi
//
// scratch: at least attn_scratch_floats(...) floats.
static void attend(const AttnWork& w, float* scratch) {
  const int64_t D = w.head_dim, tpb = w.tokens_per_block;
  const int64_t num_heads_item = w.head_end - w.head_begin;
  const int64_t M = w.num_q_tokens * num_heads_item;  // query vectors in this item
  float* m = scratch;                                  // [M] running max
  float* l = m + M;                                    // [M] running sum of exp
  float* acc = l + M;                                  // [M, D] unnormalized output
  float* s = acc + M * D;                              // [tpb] scores of one block
  float* kbuf = s + tpb;                               // [tpb, D] K block as float (bf16 pool)
  float* vbuf = kbuf + tpb * D;                        // [tpb, D] V block as float (bf16 pool)
  for (int64_t i = 0; i < M; ++i) {
    m[i] = -__builtin_inff();
    l[i] = 0.f;
  }
  for (int64_t i = 0; i < M * D; ++i) acc[i] = 0.f;

  const int64_t last_pos = w.first_q_pos + w.num_q_tokens - 1;
  const int64_t num_kv_blocks = last_pos / tpb + 1;
  for (int64_t j = 0; j < num_kv_blocks; ++j) {
    const int64_t base_pos = j * tpb;
    const int64_t num_block_tokens = (last_pos + 1 - base_pos) < tpb ? (last_pos + 1 - base_pos) : tpb;
    const int64_t first_row = static_cast<int64_t>(w.block_table[j]) * tpb;  // pool row of offset 0
    const float* k_rows;
    const float* v_rows;
    int64_t row_stride;
    if (w.kv_bf16) {
      const uint16_t* k16 = static_cast<const uint16_t*>(w.k_base) + first_row * w.kv_row_stride;
      const uint16_t* v16 = static_cast<const uint16_t*>(w.v_base) + first_row * w.kv_row_stride;
      for (int64_t o = 0; o < num_block_tokens; ++o) {
        bf16_to_f32(k16 + o * w.kv_row_stride, kbuf + o * D, D);
        bf16_to_f32(v16 + o * w.kv_row_stride, vbuf + o * D, D);
      }
      k_rows = kbuf;
      v_rows = vbuf;
      row_stride = D;
    } else {
      k_rows = static_cast<const float*>(w.k_base) + first_row * w.kv_row_stride;
      v_rows = static_cast<const float*>(w.v_base) + first_row * w.kv_row_stride;
      row_stride = w.kv_row_stride;
    }
    for (int64_t qi = 0; qi < w.num_q_tokens; ++qi) {
      const int64_t q_pos = w.first_q_pos + qi;
      int64_t num_valid = q_pos - base_pos + 1;  // causal: KV positions <= q_pos
      if (num_valid <= 0) continue;
      if (num_valid > num_block_tokens) num_valid = num_block_tokens;
      for (int64_t h = 0; h < num_heads_item; ++h) {
        const int64_t i = qi * num_heads_item + h;
        const float* qv = w.q + qi * w.q_tok_stride + h * D;
        float block_max = -__builtin_inff();
        for (int64_t o = 0; o < num_valid; ++o) {
          s[o] = dot_f32(qv, k_rows + o * row_stride, D);
          block_max = s[o] > block_max ? s[o] : block_max;
        }
        const float m_new = block_max > m[i] ? block_max : m[i];
        float* a = acc + i * D;
        if (m_new != m[i]) {
          const float alpha = __builtin_expf(m[i] - m_new);  // 0 on the first block (m = -inf)
          l[i] *= alpha;
          scale_f32(alpha, a, D);
          m[i] = m_new;
        }
        float sum = 0.f;
        for (int64_t o = 0; o < num_valid; ++o) {
          const float p = __builtin_expf(s[o] - m_new);
          sum += p;
          axpy_f32(p, v_rows + o * row_stride, a, D);
        }
        l[i] += sum;
      }
    }
  }
  for (int64_t qi = 0; qi < w.num_q_tokens; ++qi) {
    for (int64_t h = 0; h < num_heads_item; ++h) {
      const int64_t i = qi * num_heads_item + h;
      const float inv_l = 1.0f / l[i];
      float* dst = w.out + qi * w.out_tok_stride + h * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = acc[i * D + d] * inv_l;
    }
  }
}
