// The AMX bfloat16 GEMM (bf16_amx_gemm.h, compiled once, in gemm.cpp's AMX copy) for the other ops' CPU
// files: the quantized linears' context phase multiplies its dequantized bfloat16 weight tiles with it, or
// has it call back for the weight a k chunk at a time (quant_linear.h). Included at file scope with the
// torch headers; call only where kiln::cpu_has_amx_bf16().
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

// Steps of 32 columns per k chunk of amx_bf16_linear_filled where a block has several token pairs (even: the
// int4 tiles come in 64-column chunks); with one, chunks of 2.
constexpr int64_t kAmxFillSteps = 6;

// A weight that is not bfloat16 in memory (int4_linear's), as amx_bf16_linear_filled reads it: fill(self, r,
// rows, i0, i1, dst) writes rows [r, r + rows) (rows <= 32) of the 32-column steps [i0, i1) (i0 even,
// i1 - i0 <= kAmxFillSteps; a block's chunks in k order) as bfloat16 bits into dst [i1 - i0][32][32], step
// by step (a step's rows 0-15 are one A tile, 16-31 the next), the rows past `rows` zero; dst is 64-byte
// aligned. Columns in the order x was packed in.
struct AmxWeightSource {
  void (*fill)(const void* self, int64_t r, int64_t rows, int64_t i0, int64_t i1, uint16_t* dst);
  const void* self;
};

// amx_bf16_linear for rows [r0, r1) (r0 a multiple of 32) of a weight that `source` converts a block's k
// chunk at a time into an L1-resident buffer just before its tiles multiply it, for at most 256 tokens (one
// pass: larger calls go 256 tokens at a time, quant_linear.h): out[t, r] as amx_bf16_linear's, the same bits
// as from the whole converted weight. Runs on the calling thread.
void amx_bf16_linear_filled(const uint32_t* packed, int64_t num_tokens, const AmxWeightSource& source, int64_t r0,
                            int64_t r1, int64_t k, const float* row_scale, const float* bias, void* out,
                            int64_t out_stride, bool out_bf16);

}  // namespace kiln
