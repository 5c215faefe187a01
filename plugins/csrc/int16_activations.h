// Block floating point int16 activations for the AVX2 generation GEMVs of int4_linear and int8_linear
// (VPMADDWD against int16 weights instead of float32 FMAs): the per-thread buffers. The quantization
// itself is int16_quantize.h's, compiled inside each file's AVX2 namespace. Included at file scope.
#pragma once

#include <cstdint>
#include <vector>

namespace kiln {

// Kept per thread by the callers and only ever grown.
struct Int16Activations {
  std::vector<float> row;       // [in] x * pre_quant_scale of one token, natural order
  std::vector<int16_t> x16;     // [T, in]
  std::vector<float> x_scale;   // [T, num_blocks] 2^e
  std::vector<float> x_sum;     // [T, num_blocks] 2^e * sum of the block's x16

  void resize(int64_t num_tokens, int64_t in, int64_t num_blocks) {
    const auto grow = [](auto& v, int64_t n) { if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n)); };
    grow(row, in);
    grow(x16, num_tokens * in);
    grow(x_scale, num_tokens * num_blocks);
    grow(x_sum, num_tokens * num_blocks);
  }
};

}  // namespace kiln
