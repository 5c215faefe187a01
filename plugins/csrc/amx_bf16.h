// The AMX bfloat16 GEMM (bf16_amx_gemm.h, compiled once, in gemm.cpp's AMX copy) for the other ops' CPU
// files: the quantized linears' context phase multiplies its dequantized bfloat16 weight tiles with it
// (quant_linear.h). Included at file scope with the torch headers; call only where kiln::cpu_has_amx_bf16().
#pragma once

#include <cstdint>

namespace kiln {

// uint32 elements amx_bf16_pack writes for num_tokens tokens of k columns (k a multiple of 32).
int64_t amx_bf16_packed_size(int64_t num_tokens, int64_t k);

// x [num_tokens, k] bfloat16 bits (rows x_stride apart) into AMX B tiles: packed [amx_bf16_packed_size]
// (at::parallel_for over 16-token blocks, two at least per task).
void amx_bf16_pack(const uint16_t* x, int64_t num_tokens, int64_t x_stride, int64_t k, uint32_t* packed);

// out[t, r] = (float32 sum over c of x[t, c] * w[r, c]) * row_scale[r] + bias[r] for r < rows and
// t < num_tokens, from packed x and w [rows rounded up to 32, k] bfloat16 bits (the rows past `rows`
// zero); row_scale and bias [rows] or null; out rows out_stride apart, bfloat16 (rounded to nearest even)
// or float32. One float32 chain per (t, r) over k in 32-column steps, the same at every token count.
// Runs on the calling thread.
void amx_bf16_linear(const uint32_t* packed, int64_t num_tokens, const uint16_t* w, int64_t rows, int64_t k,
                     const float* row_scale, const float* bias, void* out, int64_t out_stride, bool out_bf16);

}  // namespace kiln
