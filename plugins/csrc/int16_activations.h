// Block floating point int16 activations for the AVX2 generation GEMVs of int4_linear and int8_linear
// (VPMADDWD against int16 weights instead of float32 FMAs). Included at file scope, beside the torch
// headers; scalar code only.
//
// Per token and block of `block` columns, x16 = round(x * 2^-e) with the power of two chosen so that the
// block's max |x| maps into [2^14, 2^15): 15 significant bits for the block's largest values (bfloat16 x
// has 8), an absolute error of at most 2^-16 max |x| per column. A block holding inf or NaN cannot be
// represented: prepare() then returns false and the caller takes its float32 kernel, which propagates it.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace kiln {

struct Int16Activations {
  std::vector<float> row;       // [in] x * pre_quant_scale of one token, natural order
  std::vector<int16_t> x16;     // [T, in]
  std::vector<float> x_scale;   // [T, num_blocks] 2^e
  std::vector<float> x_sum;     // [T, num_blocks] 2^e * sum of the block's x16

  // x [T, in] bfloat16 (times pre_quant_scale [in] unless null), `block` dividing in. With nibble_chunks
  // (int4_kernels.h, gemv_int16_rows) each 64 columns are stored as x16_c[16 k + i] = x16[4 i + k] (block
  // a multiple of 64); otherwise in natural order. Kept per thread by the callers and only ever grown.
  bool prepare(const at::Tensor& x, const float* pqs, int64_t block, bool nibble_chunks) {
    const int64_t num_tokens = x.size(0), in = x.size(1), num_blocks = in / block;
    const auto grow = [](auto& v, int64_t n) { if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n)); };
    grow(row, in);
    grow(x16, num_tokens * in);
    grow(x_scale, num_tokens * num_blocks);
    grow(x_sum, num_tokens * num_blocks);
    const at::BFloat16* src = x.data_ptr<at::BFloat16>();
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t c = 0; c < in; ++c) {
        const float v = static_cast<float>(src[t * in + c]);
        row[c] = pqs != nullptr ? v * pqs[c] : v;
      }
      int16_t* dst = x16.data() + t * in;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const float* xb = row.data() + b * block;
        float max_abs = 0.f;
        for (int64_t c = 0; c < block; ++c) max_abs = std::max(max_abs, std::fabs(xb[c]));
        if (!std::isfinite(max_abs)) return false;
        int exponent = 0;
        std::frexp(max_abs, &exponent);  // max_abs = m * 2^exponent, m in [0.5, 1): max_abs * 2^(15 - exponent) < 2^15
        const int e = max_abs > 0.f ? exponent - 15 : 0;
        const float inv = std::ldexp(1.f, -e);
        const auto quantize = [&](int64_t c) { return static_cast<int16_t>(std::min(32767L, std::lrint(xb[c] * inv))); };
        int64_t sum = 0;
        for (int64_t c = 0; c < block; ++c) {
          const int16_t v = quantize(c);
          const int64_t to = nibble_chunks ? c / 64 * 64 + c % 4 * 16 + c % 64 / 4 : c;  // column 4i + k -> 16k + i
          dst[b * block + to] = v;
          sum += v;
        }
        x_scale[t * num_blocks + b] = std::ldexp(1.f, e);
        x_sum[t * num_blocks + b] = std::ldexp(static_cast<float>(sum), e);
      }
    }
    return true;
  }
};

}  // namespace kiln
