// kilnlm::int8_linear (W8A16: int8_wo) and kilnlm::int8_sq_linear (W8A8: int8_sq, SmoothQuant), CPU
// kernels (schemas and numerics: kilnlm/plugins/schema.py).
//
//   int8_linear     y [T, out] = x @ (q * weight_scale[:, None]).T + bias        (float32 accumulation)
//   int8_sq_linear  x_q = clamp(round_half_even((x * pre_quant_scale) / input_scale), -128, 127)
//                   y = float(x_q @ q.T) * (input_scale * weight_scale[o]) + bias (exact int32 accumulation)
//                   per_token: input_scale replaced by each token's own amax_t / 127 (dynamic)
//
// The int8 weight [out, in] is read directly, never dequantized as a whole:
// - int8_linear, few tokens (generation phase): fused convert-and-multiply GEMV, each weight byte read
//   once per call: bfloat16 x with AVX512-BF16 through bf16_gemv.h (q exact in bfloat16, VDPBF16PS),
//   otherwise float32 FMAs (int8_kernels.h); more tokens (context phase): tiles of kTileRows rows dequantized in a
//   thread-local buffer and multiplied with all T rows: float32 x -> float32 q * scale (the reference's
//   weight) through at::mm; bfloat16 x with AVX512-BF16 -> bfloat16 q (exact) through VDPBF16PS
//   (fp8_bf16_gemm.h), the scale applied after the float32 sum.
// - int8_sq_linear, any token count: int8 x int8 products summed exactly in int32 by a register-blocked
//   micro-kernel (from 4 tokens AVX512-VNNI VPDPBUSD where the CPU has it, int8_vnni_gemm.h; else sign
//   extension to int16 + VPMADDWD), over tiles of rows so a tile stays in cache while every token block
//   passes over it.
//   Bit-exact with the reference.
// All parallelize over output rows with at::parallel_for.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "bf16_bits.h"
#include "c_shim.h"
#include "cpu_features.h"
#include "int16_activations.h"
#include "row_blocks.h"

namespace kiln_int8 {
#define KILN_ISA_KERNELS "int8_kernels.h"
#include "isa_variants.h"
#undef KILN_ISA_KERNELS

namespace {

// int8_linear: up to this many tokens the fused GEMV beats dequantize-then-GEMM (scripts/bench_plugins.py,
// SmolLM2's shapes); the bf16 GEMM is ~3x the float32 one, so it takes over sooner (its fixed cost,
// converting the weight to bf16 tiles, is paid back from ~5 tokens). Both ops work on tiles of kTileRows
// output rows.
constexpr int64_t kMaxDirectTokensF32Gemm = 16;
constexpr int64_t kMaxDirectTokensBf16Gemm = 4;
// int8_sq_linear: below this many tokens the VPMADDWD GEMV, which reads each weight byte once, beats the
// VNNI kernel, which sums every row tile once more for its offset correction (cold-weight decode sweep of
// scripts/bench_plugins.py: ~6 vs ~10 ms per 30 layers).
constexpr int64_t kMinVnniTokens = 4;
constexpr int64_t kTileRows = 64;

using GemvF32Fn = void (*)(const int8_t*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t);
using GemmI32Fn = void (*)(const int8_t*, int64_t, int64_t, int64_t, const int16_t*, int64_t, int64_t, int32_t*, int64_t);

GemvF32Fn gemv_f32_fn() {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx512()) return avx512::gemv_f32_rows;
  if (kiln::cpu_has_avx2_fma_f16c()) return avx2::gemv_f32_rows;
#endif
  return generic::gemv_f32_rows;
}

GemmI32Fn gemm_i32_fn() {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx512()) return avx512::gemm_i32_rows;
  if (kiln::cpu_has_avx2_fma_f16c()) return avx2::gemm_i32_rows;
#endif
  return generic::gemm_i32_rows;
}

void check_common(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && weight_scale.device().is_cpu(), op,
              " (CPU kernel): x, weight and weight_scale must be CPU tensors");
  TORCH_CHECK(x.dim() == 2, op, ": x must be [num_tokens, in_features], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar, op,
              ": weight must be a 2-D int8 tensor [out_features, in_features], got ", weight.scalar_type(), " ",
              weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous (call .contiguous() when building)");
  TORCH_CHECK(weight.size(1) == x.size(1), op, ": x has ", x.size(1), " features but weight expects ", weight.size(1));
  const int64_t out_features = weight.size(0);
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.dim() == 1 && weight_scale.size(0) == out_features,
              op, ": weight_scale must be float32 [out_features=", out_features, "] (per output channel), got ",
              weight_scale.scalar_type(), " ", weight_scale.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->device().is_cpu(), op,
                ": bias must be [out_features=", out_features, "], got ", bias->sizes());
  }
}

// out[t, o] = acc[t, o - col_begin] * row_scale[o] (or 1) (+ bias[o]) in out's dtype; with token_scale,
// acc * (token_scale[t] * row_scale[o]) (per-token dynamic activation scales, one float32 product as the
// reference).
template <typename scalar_t, typename acc_t>
void epilogue(const acc_t* acc, int64_t acc_stride, int64_t num_tokens, int64_t col_begin, int64_t col_end,
              const float* row_scale, const float* bias, scalar_t* out, int64_t out_stride,
              const float* token_scale = nullptr) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t o = col_begin; o < col_end; ++o) {
      float y = static_cast<float>(acc[t * acc_stride + (o - col_begin)]);
      if (token_scale != nullptr) y = y * (token_scale[t] * row_scale[o]);
      else if (row_scale != nullptr) y = y * row_scale[o];
      if (bias != nullptr) y = y + bias[o];
      out[t * out_stride + o] = static_cast<scalar_t>(y);
    }
  }
}

// x [T, in] (f32 / bf16) -> float32 copy, times pre_quant_scale when given.
template <typename scalar_t>
void to_float(const at::Tensor& x, const float* pqs, float* dst) {
  const int64_t in = x.size(1);
  const scalar_t* src = x.data_ptr<scalar_t>();
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, 65536 / std::max<int64_t>(in, 1)), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const scalar_t* row = src + t * in;
      float* dst_row = dst + t * in;
      if (pqs == nullptr)
        for (int64_t c = 0; c < in; ++c) dst_row[c] = static_cast<float>(row[c]);
      else
        for (int64_t c = 0; c < in; ++c) dst_row[c] = static_cast<float>(row[c]) * pqs[c];
    }
  });
}

at::Tensor float_bias(const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
}

// ---------------------------------------------------------------------------------------------- W8A16

// gemv(r0, r1, acc) writes acc[t, r] (row stride out_features) for rows [r0, r1).
template <typename scalar_t, typename RowsFn>
void int8_linear_direct(const RowsFn& gemv, int64_t in, int64_t out_features, int64_t num_tokens, const float* scale,
                        const float* bias, scalar_t* out) {
  float* acc_ptr = kiln::thread_scratch<0>(num_tokens * out_features);
  const int64_t grain = std::max<int64_t>(8, 16384 / std::max<int64_t>(in, 1));  // >= ~16 KiB of weights per task
  at::parallel_for(0, out_features, grain, [&](int64_t r0, int64_t r1) {
    gemv(r0, r1, acc_ptr);
    epilogue<scalar_t>(acc_ptr + r0, out_features, num_tokens, r0, r1, scale, bias, out, out_features);
  });
}

template <typename scalar_t>
void int8_linear_direct(const int8_t* w, int64_t in, int64_t out_features, const float* xs, int64_t num_tokens,
                        const float* scale, const float* bias, scalar_t* out) {
  const GemvF32Fn gemv = gemv_f32_fn();
  int8_linear_direct<scalar_t>([&](int64_t r0, int64_t r1, float* acc) {
    gemv(w, in, r0, r1, xs, num_tokens, in, acc, out_features);
  }, in, out_features, num_tokens, scale, bias, out);
}

template <typename scalar_t>
void int8_linear_tiled(const int8_t* w, int64_t in, int64_t out_features, const float* xs, int64_t num_tokens,
                       const float* scale, const float* bias, scalar_t* out) {
  const int64_t num_tiles = (out_features + kTileRows - 1) / kTileRows;
  const at::Tensor x = at::from_blob(const_cast<float*>(xs), {num_tokens, in}, at::kFloat);
  at::parallel_for(0, num_tiles, 1, [&](int64_t tile0, int64_t tile1) {
    std::vector<float> w_tile(static_cast<size_t>(kTileRows * in));  // [kTileRows, in] float32
    at::Tensor acc = at::empty({num_tokens, kTileRows}, at::kFloat);
    for (int64_t tile = tile0; tile < tile1; ++tile) {
      const int64_t r0 = tile * kTileRows, r1 = std::min(out_features, r0 + kTileRows);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < in; ++c) w_tile[(r - r0) * in + c] = static_cast<float>(w[r * in + c]) * scale[r];
      const at::Tensor w_f = at::from_blob(w_tile.data(), {r1 - r0, in}, at::kFloat);
      at::Tensor acc_view = acc.narrow(1, 0, r1 - r0);
      at::mm_out(acc_view, x, w_f.t());  // [T, rows]
      epilogue<scalar_t, float>(acc_view.data_ptr<float>(), acc_view.stride(0), num_tokens, r0, r1, nullptr, bias,
                                out, out_features);
    }
  });
}

#if defined(__x86_64__)
// Context phase, bfloat16 x with AVX512-BF16: q is exact in bfloat16 (8 significant bits), so VDPBF16PS
// forms exact products of x and q, summed in float32; the per-row scale is applied after the sum.
template <typename scalar_t>
void int8_linear_tiled_bf16(const int8_t* w, int64_t in, int64_t out_features, const float* xs, int64_t num_tokens,
                            const float* scale, const float* bias, scalar_t* out) {
  const int64_t k_pad = (in + 31) / 32 * 32, tokens_pad = (num_tokens + 3) / 4 * 4;
  std::vector<uint16_t> xb(static_cast<size_t>(tokens_pad * k_pad), 0);  // [tokens_pad, k_pad] bf16 bits
  at::parallel_for(0, num_tokens, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) avx512bf16::to_bf16_padded(xs + t * in, in, xb.data() + t * k_pad, k_pad);
  });
  const int64_t num_tiles = (out_features + kTileRows - 1) / kTileRows;
  at::parallel_for(0, num_tiles, 1, [&](int64_t tile0, int64_t tile1) {
    std::vector<uint16_t> wb(static_cast<size_t>(kTileRows * k_pad), 0);  // [kTileRows, k_pad] bf16 q
    std::vector<float> acc(static_cast<size_t>(tokens_pad * kTileRows));  // [tokens_pad, kTileRows]
    for (int64_t tile = tile0; tile < tile1; ++tile) {
      const int64_t r0 = tile * kTileRows, r1 = std::min(out_features, r0 + kTileRows);
      const int64_t rows_pad = (r1 - r0 + 3) / 4 * 4;
      for (int64_t r = r0; r < r1; ++r) avx512bf16::int8_to_bf16_padded(w + r * in, in, wb.data() + (r - r0) * k_pad, k_pad);
      std::fill(wb.begin() + (r1 - r0) * k_pad, wb.begin() + rows_pad * k_pad, uint16_t{0});
      avx512bf16::bf16_gemm_nt(xb.data(), tokens_pad, wb.data(), rows_pad, k_pad, acc.data(), kTileRows);
      epilogue<scalar_t, float>(acc.data(), kTileRows, num_tokens, r0, r1, scale, bias, out, out_features);
    }
  });
}
#endif

// ----------------------------------------------------------------------------------------------- W8A8

using QuantizeFn = void (*)(const float*, int64_t, float, int16_t*);

QuantizeFn quantize_fn() {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx512()) return avx512::quantize_int8_rows;
  if (kiln::cpu_has_avx2_fma_f16c()) return avx2::quantize_int8_rows;
#endif
  return generic::quantize_int8_rows;
}

// x_q[t, c] = clamp(round_half_even(float(x[t, c]) * pqs[c] / s), -128, 127), as int16 (VPMADDWD's
// operand); bit-exact with quantize_int8_reference (IEEE multiply, IEEE division, rounding to nearest even).
// s = input_scale, or with token_scale (per-token dynamic scales) s = token_scale[t] = amax_t / 127, written
// by this function, amax_t = max_c |x[t, c] * pqs[c]| (1 for an all-zero row).
template <typename scalar_t>
void quantize_int8(const at::Tensor& x, const float* pqs, float input_scale, int16_t* dst, float* token_scale = nullptr) {
  const int64_t in = x.size(1);
  float* xs = kiln::thread_scratch<1>(x.numel());
  to_float<scalar_t>(x, pqs, xs);
  const QuantizeFn quantize = quantize_fn();
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, 65536 / std::max<int64_t>(in, 1)), [&](int64_t t0, int64_t t1) {
    if (token_scale == nullptr) return quantize(xs + t0 * in, (t1 - t0) * in, input_scale, dst + t0 * in);
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = xs + t * in;
      float amax = 0.f;
      for (int64_t c = 0; c < in; ++c) amax = std::max(amax, std::fabs(row[c]));
      token_scale[t] = amax > 0.f ? amax / 127.f : 1.f;
      quantize(row, in, token_scale[t], dst + t * in);
    }
  });
}

#if defined(__x86_64__)
// With AVX512-VNNI: x_q + 128 as bytes, then VPDPBUSD dot products (int8_vnni_gemm.h), exact as well.
template <typename scalar_t>
void int8_sq_gemm_vnni(const int8_t* w, int64_t in, int64_t out_features, const int16_t* xq, int64_t num_tokens,
                       const float* row_scale, const float* bias, scalar_t* out, const float* token_scale) {
  std::vector<uint8_t> xu(static_cast<size_t>(num_tokens * in));  // [T, in] x_q + 128
  for (int64_t i = 0; i < num_tokens * in; ++i) xu[i] = static_cast<uint8_t>(xq[i] + 128);
  std::vector<int32_t> acc(static_cast<size_t>(num_tokens * out_features));  // [T, out]
  int32_t* acc_ptr = acc.data();
  const int64_t grain = std::max<int64_t>(8, 16384 / std::max<int64_t>(in, 1));
  at::parallel_for(0, out_features, grain, [&](int64_t r0, int64_t r1) {
    avx512vnni::gemm_vnni_rows(w, in, r0, r1, xu.data(), num_tokens, in, acc_ptr, out_features);
    epilogue<scalar_t, int32_t>(acc_ptr + r0, out_features, num_tokens, r0, r1, row_scale, bias, out, out_features,
                                token_scale);
  });
}
#endif

template <typename scalar_t>
void int8_sq_gemm(const int8_t* w, int64_t in, int64_t out_features, const int16_t* xq, int64_t num_tokens,
                  const float* row_scale, const float* bias, scalar_t* out, const float* token_scale) {
#if defined(__x86_64__)
  if (num_tokens >= kMinVnniTokens && kiln::cpu_has_avx512_vnni())
    return int8_sq_gemm_vnni<scalar_t>(w, in, out_features, xq, num_tokens, row_scale, bias, out, token_scale);
#endif
  const GemmI32Fn gemm = gemm_i32_fn();
  std::vector<int32_t> acc(static_cast<size_t>(num_tokens * out_features));
  int32_t* acc_ptr = acc.data();
  const int64_t grain = std::max<int64_t>(8, 16384 / std::max<int64_t>(in, 1));
  at::parallel_for(0, out_features, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t t0 = r0; t0 < r1; t0 += kTileRows) {
      const int64_t t1 = std::min(r1, t0 + kTileRows);
      gemm(w, in, t0, t1, xq, num_tokens, in, acc_ptr, out_features);
      epilogue<scalar_t, int32_t>(acc_ptr + t0, out_features, num_tokens, t0, t1, row_scale, bias, out, out_features,
                                  token_scale);
    }
  });
}

}  // namespace

at::Tensor int8_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& weight_scale_in,
                           const std::optional<at::Tensor>& bias_in) {
  check_common("kilnlm::int8_linear", x_in, weight, weight_scale_in, bias_in);
  const at::Tensor x = x_in.contiguous();
  const int64_t num_tokens = x.size(0), in = x.size(1), out_features = weight.size(0);
  at::Tensor out = at::empty({num_tokens, out_features}, x.options());
  if (num_tokens == 0 || out_features == 0) return out;
  const at::Tensor weight_scale = weight_scale_in.contiguous(), bias = float_bias(bias_in);
  const float* scale = weight_scale.data_ptr<float>();
  const float* bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int8_t* w = weight.data_ptr<int8_t>();
  float* xs = kiln::thread_scratch<1>(num_tokens * in);  // [T, in] float32
  const bool bf16_gemm = x.scalar_type() == at::kBFloat16 && kiln::cpu_has_avx512_bf16();
  const bool direct = num_tokens <= (bf16_gemm ? kMaxDirectTokensBf16Gemm : kMaxDirectTokensF32Gemm);
  AT_DISPATCH_SWITCH(x.scalar_type(), "kilnlm::int8_linear",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        to_float<float>(x, nullptr, xs);
        if (direct) int8_linear_direct<float>(w, in, out_features, xs, num_tokens, scale, bias_ptr, out.data_ptr<float>());
        else int8_linear_tiled<float>(w, in, out_features, xs, num_tokens, scale, bias_ptr, out.data_ptr<float>());
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
#if defined(__x86_64__)
        // Block floating point int16 x through AVX2's VPMADDWD (int8_kernels.h, gemv_int16_rows): on AVX2
        // CPUs, and on AVX512-BF16 CPUs too, where the bf16 GEMV below is bound by its instructions (an
        // Intel Xeon, 30 cold SmolLM2 gate_up + down pairs: 62-66 against 97 us per pair at one token, 140
        // against 165 at four; a cold decode sweep 34.7 against 25.0 GB/s).
        if (direct && (bf16_gemm || !kiln::cpu_has_avx512()) && kiln::cpu_has_avx2_fma_f16c() &&
            in % avx2::kInt16BlockCols == 0) {
          thread_local kiln::Int16Activations xq;
          xq.resize(num_tokens, in, in / avx2::kInt16BlockCols);
          if (avx2::int16_quantize(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), nullptr, num_tokens, in,
                                   avx2::kInt16BlockCols, /*nibble_chunks=*/false, xq.row.data(), xq.x16.data(),
                                   xq.x_scale.data(), xq.x_sum.data())) {
            // the pointers, not xq: a worker thread naming xq would get its own (empty) thread_local
            const int16_t* x16 = xq.x16.data();
            const float* x_scale = xq.x_scale.data();
            int8_linear_direct<at::BFloat16>([&](int64_t r0, int64_t r1, float* acc) {
              avx2::gemv_int16_rows(w, in, r0, r1, x16, num_tokens, in, x_scale, acc, out_features);
            }, in, out_features, num_tokens, scale, bias_ptr, out.data_ptr<at::BFloat16>());
            return;
          }
        }
        // bf16_gemv.h (cold SmolLM2 decode sweep: 37-48 GB/s on an AMD Zen 4; an x the int16 path refuses)
        if (direct && bf16_gemm && in % avx512bf16::PlainRows<avx512bf16::Int8Weights>::kCols == 0) {
          const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
          auto* yb = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
          kiln::parallel_row_blocks(out_features, avx512bf16::kGemvBlockRows, [&](int64_t r0, int64_t r1) {
            avx512bf16::gemv_int8_rows(xb, num_tokens, w, out_features, in, scale, bias_ptr, yb, r0, r1);
          });
          return;
        }
#endif
        to_float<at::BFloat16>(x, nullptr, xs);
        at::BFloat16* y = out.data_ptr<at::BFloat16>();
        if (direct) int8_linear_direct<at::BFloat16>(w, in, out_features, xs, num_tokens, scale, bias_ptr, y);
#if defined(__x86_64__)
        else if (bf16_gemm) int8_linear_tiled_bf16<at::BFloat16>(w, in, out_features, xs, num_tokens, scale, bias_ptr, y);
#endif
        else int8_linear_tiled<at::BFloat16>(w, in, out_features, xs, num_tokens, scale, bias_ptr, y);
      }));
  return out;
}

at::Tensor int8_sq_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& weight_scale_in,
                              const at::Tensor& input_scale, const std::optional<at::Tensor>& pre_quant_scale_in,
                              const std::optional<at::Tensor>& bias_in, bool per_token) {
  const char* op = "kilnlm::int8_sq_linear";
  check_common(op, x_in, weight, weight_scale_in, bias_in);
  TORCH_CHECK(input_scale.numel() == 1 && input_scale.scalar_type() == at::kFloat && input_scale.device().is_cpu(), op,
              ": input_scale must be a 0-dim float32 CPU tensor (the calibrated per-tensor scale), got ",
              input_scale.scalar_type(), " ", input_scale.sizes());
  const int64_t num_tokens = x_in.size(0), in = x_in.size(1), out_features = weight.size(0);
  if (pre_quant_scale_in.has_value()) {
    TORCH_CHECK(pre_quant_scale_in->dim() == 1 && pre_quant_scale_in->size(0) == in && pre_quant_scale_in->device().is_cpu(),
                op, ": pre_quant_scale must be [in_features=", in, "], got ", pre_quant_scale_in->sizes());
  }
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({num_tokens, out_features}, x.options());
  if (num_tokens == 0 || out_features == 0) return out;

  const float s_in = *input_scale.data_ptr<float>();  // checked 0-dim float32 CPU; item() dispatches (~1 us)
  const at::Tensor weight_scale = weight_scale_in.contiguous(), bias = float_bias(bias_in);
  // row_scale[o] = input_scale * weight_scale[o], one float32 rounding as the reference; per token,
  // weight_scale[o] alone (the epilogue multiplies it by each token's scale).
  const float* w_scale = weight_scale.data_ptr<float>();  // once: data_ptr<T>() checks the dtype on every call
  std::vector<float> row_scale(w_scale, w_scale + out_features);
  if (!per_token)
    for (float& s : row_scale) s *= s_in;
  std::vector<float> token_scale(per_token ? static_cast<size_t>(num_tokens) : 0);  // [T]
  float* ts = per_token ? token_scale.data() : nullptr;
  at::Tensor pqs;
  if (pre_quant_scale_in.has_value()) pqs = pre_quant_scale_in->to(at::kFloat).contiguous();
  const float* pqs_ptr = pqs.defined() ? pqs.data_ptr<float>() : nullptr;
  const float* bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;
  std::vector<int16_t> xq(static_cast<size_t>(num_tokens * in));  // [T, in] int8 values as int16
  AT_DISPATCH_SWITCH(x.scalar_type(), "kilnlm::int8_sq_linear",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        quantize_int8<float>(x, pqs_ptr, s_in, xq.data(), ts);
        int8_sq_gemm<float>(weight.data_ptr<int8_t>(), in, out_features, xq.data(), num_tokens, row_scale.data(),
                            bias_ptr, out.data_ptr<float>(), ts);
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        quantize_int8<at::BFloat16>(x, pqs_ptr, s_in, xq.data(), ts);
        int8_sq_gemm<at::BFloat16>(weight.data_ptr<int8_t>(), in, out_features, xq.data(), num_tokens, row_scale.data(),
                                   bias_ptr, out.data_ptr<at::BFloat16>(), ts);
      }));
  return out;
}

}  // namespace kiln_int8

TORCH_LIBRARY_IMPL(kilnlm, CPU, m) {
  m.impl("int8_linear", &kiln_int8::int8_linear_cpu);
  m.impl("int8_sq_linear", &kiln_int8::int8_sq_linear_cpu);
}

KILN_C_SHIM aoti_torch_cpu_int8_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle weight_scale,
                                       AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  using namespace kiln_shim;
  return call(ret0, [&] {
    return kiln_int8::int8_linear_cpu(tensor(x), tensor(weight), tensor(weight_scale), optional_tensor(bias));
  });
}

KILN_C_SHIM aoti_torch_cpu_int8_sq_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle weight_scale,
                                          AtenTensorHandle input_scale, AtenTensorHandle* pre_quant_scale,
                                          AtenTensorHandle* bias, int32_t per_token, AtenTensorHandle* ret0) {
  using namespace kiln_shim;
  return call(ret0, [&] {
    return kiln_int8::int8_sq_linear_cpu(tensor(x), tensor(weight), tensor(weight_scale), tensor(input_scale),
                                         optional_tensor(pre_quant_scale), optional_tensor(bias), per_token != 0);
  });
}
