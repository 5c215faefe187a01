// kilnlm::fp8_linear, CPU kernel (schema and numerics: kilnlm/plugins/schema.py).
//
//   x [T, in] f32/bf16 --quantize (x / input_scale, clamp ±448, RNE to E4M3)--> x_q (held as exact floats)
//   y [T, out] = (x_q @ weight.T) * (input_scale * weight_scale[o]) + bias, accumulated in float32
//   (weight_scale 0-dim: one per-tensor scale; [out]: one per output row, e.g. each part of a fused QKV
//   keeps its own per-tensor scale)
//
// The weight [out, in] float8_e4m3fn is read directly as bytes, never dequantized as a whole:
// - few tokens (generation phase): a fused dequantize-and-multiply GEMV over output rows, each byte read
//   once per call (memory bound: ~1 byte per weight); with AVX512-BF16 and VBMI the bytes become exact
//   bfloat16 in registers through byte tables (Fp8Rows) and meet the (exact bfloat16) quantized
//   activations in VDPBF16PS (bf16_gemv.h), else float32 FMAs (AVX2: weights converted by integer shifts,
//   fp8_kernels.h; scalar);
// - more tokens (context phase): tiles of kTileRows output rows are dequantized into a thread-local
//   buffer and multiplied: as exact bfloat16 with AVX512-BF16 dot products (fp8_bf16_gemm.h) where the
//   CPU has them, else as float32 with at::mm.
// Both parallelize over output rows with at::parallel_for.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"
#include "c_shim.h"
#include "cpu_features.h"
#include "row_blocks.h"

namespace kiln_fp8 {
namespace {
// The float32 value of every E4M3 byte (c10's decoding: NaN for 0x7F / 0xFF).
struct Fp8Lut {
  float value[256];
  Fp8Lut() {
    for (int b = 0; b < 256; ++b) value[b] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(b), c10::Float8_e4m3fn::from_bits()));
  }
};

const Fp8Lut& fp8_lut() {
  static const Fp8Lut lut;
  return lut;
}
}  // namespace

#define KILN_ISA_KERNELS "fp8_kernels.h"
#include "isa_variants.h"
#undef KILN_ISA_KERNELS

namespace {

// Up to this many tokens the fused GEMV beats dequantize-then-GEMM (measured on SmolLM2's shapes,
// scripts/bench_plugins.py): the bf16 GEMM is ~4x the float32 one, so it takes over sooner.
constexpr int64_t kMaxDirectTokensF32Gemm = 16;
constexpr int64_t kMaxDirectTokensBf16Gemm = 4;
constexpr int64_t kTileRows = 64;

using GemvFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                        const float*);
using DequantFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, float*, const float*);

GemvFn gemv_fn() {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx2_fma_f16c()) return avx2::gemv_rows;
#endif
  return generic::gemv_rows;
}

DequantFn dequant_fn() {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx2_fma_f16c()) return avx2::dequant_rows;
#endif
  return generic::dequant_rows;
}

void check_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                  const at::Tensor& input_scale, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "kilnlm::fp8_linear (CPU kernel): x and weight must be CPU tensors");
  TORCH_CHECK(x.dim() == 2, "kilnlm::fp8_linear: x must be [num_tokens, in_features], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "kilnlm::fp8_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat8_e4m3fn,
              "kilnlm::fp8_linear: weight must be a 2-D float8_e4m3fn tensor [out_features, in_features], got ",
              weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), "kilnlm::fp8_linear: weight must be contiguous (call .contiguous() when building)");
  TORCH_CHECK(weight.size(1) == x.size(1), "kilnlm::fp8_linear: x has ", x.size(1), " features but weight expects ",
              weight.size(1));
  TORCH_CHECK(input_scale.dim() == 0 && input_scale.scalar_type() == at::kFloat && input_scale.device().is_cpu(),
              "kilnlm::fp8_linear: input_scale must be a 0-dim float32 CPU tensor, got ", input_scale.scalar_type(), " ",
              input_scale.sizes());
  const bool per_row = weight_scale.dim() == 1 && weight_scale.size(0) == weight.size(0);
  TORCH_CHECK((weight_scale.dim() == 0 || per_row) && weight_scale.scalar_type() == at::kFloat &&
                  weight_scale.device().is_cpu(),
              "kilnlm::fp8_linear: weight_scale must be a 0-dim or [out_features=", weight.size(0),
              "] float32 CPU tensor, got ", weight_scale.scalar_type(), " ", weight_scale.sizes());
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->device().is_cpu(),
                "kilnlm::fp8_linear: bias must be [out_features=", weight.size(0), "], got ", bias->sizes());
  }
}

// x_q[t, i] = float(fp8_e4m3(clamp(float(x[t, i]) / input_scale, -448, 448))), bit-exact with torch's
// `(x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)` (see quantize_e4m3_scalar in fp8_kernels.h).
template <typename scalar_t>
void quantize_activations(const at::Tensor& x, float input_scale, float* xq) {
  const int64_t num_tokens = x.size(0), in = x.size(1);
  const scalar_t* src = x.data_ptr<scalar_t>();
  const bool vec = kiln::cpu_has_avx2_fma_f16c();
  at::parallel_for(0, num_tokens, std::max<int64_t>(1, 65536 / std::max<int64_t>(in, 1)), [&](int64_t t0, int64_t t1) {
    const int64_t n = (t1 - t0) * in;
    if constexpr (std::is_same_v<scalar_t, float>) {
#if defined(__x86_64__)
      if (vec) return avx2::quantize_f32(src + t0 * in, input_scale, xq + t0 * in, n);
#endif
      generic::quantize_f32(src + t0 * in, input_scale, xq + t0 * in, n);
    } else {
      const uint16_t* bits = reinterpret_cast<const uint16_t*>(src + t0 * in);
#if defined(__x86_64__)
      if (vec) return avx2::quantize_bf16(bits, input_scale, xq + t0 * in, n);
#endif
      generic::quantize_bf16(bits, input_scale, xq + t0 * in, n);
    }
  });
}

// out[t, o] = acc[t, o] * scale[o] (+ bias[o]) in out's dtype (two roundings, as the reference).
template <typename scalar_t>
void epilogue(const float* acc, int64_t acc_stride, int64_t num_tokens, int64_t col_begin, int64_t col_end,
              const float* scale, const float* bias, scalar_t* out, int64_t out_stride) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t o = col_begin; o < col_end; ++o) {
      float y = acc[t * acc_stride + (o - col_begin)] * scale[o];
      if (bias != nullptr) y = y + bias[o];
      out[t * out_stride + o] = static_cast<scalar_t>(y);
    }
  }
}

bool use_bf16_gemm() { return kiln::cpu_has_avx512_bf16(); }

// bfloat16 bits of floats holding E4M3 values (exact: such floats have at most 4 significant bits).
void exact_bf16_row(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, sizeof(bits));
    dst[i] = static_cast<uint16_t>(bits >> 16);
  }
}

// x's bf16 row (n a multiple of 64) in Fp8Rows64's column order, in place: per 64 columns, the 16-column
// lanes' first halves, then their second halves.
void pairs64_order(uint16_t* x, int64_t n) {
  uint16_t chunk[64];
  for (int64_t c = 0; c < n; c += 64) {
    std::memcpy(chunk, x + c, sizeof(chunk));
    for (int64_t j = 0; j < 32; ++j) {
      x[c + j] = chunk[16 * (j / 8) + j % 8];
      x[c + 32 + j] = chunk[16 * (j / 8) + 8 + j % 8];
    }
  }
}

// Generation phase (few tokens): fused dequantize-and-multiply GEMV, each weight byte read once per call
// -- with AVX512-BF16 (and in_features a multiple of 32) through bf16_gemv.h, else through the AVX2 /
// scalar float32 GEMV.
template <typename scalar_t>
void run_direct(const uint8_t* w, int64_t in, int64_t out_features, const float* xq, int64_t num_tokens, const float* scale,
                const float* bias, scalar_t* out) {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx512_bf16_vbmi() && in % avx512vbmi::Fp8Rows::kCols == 0) {
    std::vector<uint16_t> xb(static_cast<size_t>(num_tokens * in));
    for (int64_t t = 0; t < num_tokens; ++t) {
      exact_bf16_row(xq + t * in, in, xb.data() + t * in);
      if (in % avx512vbmi::Fp8Rows64::kCols == 0) pairs64_order(xb.data() + t * in, in);
    }
    kiln::parallel_row_blocks(out_features, avx512vbmi::kGemvBlockRows, [&](int64_t r0, int64_t r1) {
      avx512vbmi::gemv_fp8_rows(xb.data(), num_tokens, w, out_features, in, scale, bias, out,
                                std::is_same_v<scalar_t, at::BFloat16>, r0, r1);
    });
    return;
  }
#endif
  const float* lut = fp8_lut().value;
  const GemvFn gemv = gemv_fn();
  const float* x = xq;
#if defined(__x86_64__)
  std::vector<float> x_prepared;  // the AVX2 GEMV's activations: x_q * 2^kXScaleLog2 (exact), in its block order
  if (gemv == avx2::gemv_rows) {
    x_prepared.resize(static_cast<size_t>(num_tokens * in));
    avx2::prepare_x(xq, num_tokens, in, x_prepared.data());
    x = x_prepared.data();
  }
#endif
  float* acc_ptr = kiln::thread_scratch<0>(num_tokens * out_features);
  // ~16 KiB of weights per task at least, so that small layers do not pay for threading.
  const int64_t grain = std::max<int64_t>(8, 16384 / std::max<int64_t>(in, 1));
  at::parallel_for(0, out_features, grain, [&](int64_t r0, int64_t r1) {
    gemv(w, in, r0, r1, x, num_tokens, in, acc_ptr, out_features, lut);
    epilogue<scalar_t>(acc_ptr + r0, out_features, num_tokens, r0, r1, scale, bias, out, out_features);
  });
}

// Context phase (many tokens): dequantize kTileRows output rows at a time into a thread-local tile
// (never a dequantized copy of the whole weight) and multiply: with AVX512-BF16, tiles and activations
// as (exact) bfloat16 through bf16_gemm_nt; otherwise float32 tiles through at::mm.
template <typename scalar_t>
void run_tiled(const uint8_t* w, int64_t in, int64_t out_features, const float* xq, int64_t num_tokens, const float* scale,
               const float* bias, scalar_t* out) {
  const float* lut = fp8_lut().value;
  const DequantFn dequant = dequant_fn();
  const int64_t num_tiles = (out_features + kTileRows - 1) / kTileRows;
#if defined(__x86_64__)
  if (use_bf16_gemm()) {
    const int64_t k_pad = (in + 31) / 32 * 32, tokens_pad = (num_tokens + 3) / 4 * 4;
    std::vector<uint16_t> xb(static_cast<size_t>(tokens_pad * k_pad), 0);  // [tokens_pad, k_pad]
    at::parallel_for(0, num_tokens, 64, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) exact_bf16_row(xq + t * in, in, xb.data() + t * k_pad);
    });
    at::parallel_for(0, num_tiles, 1, [&](int64_t tile0, int64_t tile1) {
      std::vector<uint16_t> wb(static_cast<size_t>(kTileRows * k_pad), 0);  // [kTileRows, k_pad]
      std::vector<float> acc(static_cast<size_t>(tokens_pad * kTileRows));
      for (int64_t tile = tile0; tile < tile1; ++tile) {
        const int64_t r0 = tile * kTileRows, r1 = std::min(out_features, r0 + kTileRows);
        const int64_t rows_pad = (r1 - r0 + 3) / 4 * 4;
        avx2::dequant_rows_bf16(w, in, r0, r1, wb.data(), k_pad, lut);  // padding columns stay 0
        std::fill(wb.begin() + (r1 - r0) * k_pad, wb.begin() + rows_pad * k_pad, uint16_t{0});
        avx512bf16::bf16_gemm_nt(xb.data(), tokens_pad, wb.data(), rows_pad, k_pad, acc.data(), kTileRows);
        epilogue<scalar_t>(acc.data(), kTileRows, num_tokens, r0, r1, scale, bias, out, out_features);
      }
    });
    return;
  }
#endif
  const at::Tensor x_q = at::from_blob(const_cast<float*>(xq), {num_tokens, in}, at::kFloat);
  at::parallel_for(0, num_tiles, 1, [&](int64_t tile0, int64_t tile1) {
    std::vector<float> w_tile(static_cast<size_t>(kTileRows * in));
    at::Tensor acc = at::empty({num_tokens, kTileRows}, at::kFloat);
    for (int64_t tile = tile0; tile < tile1; ++tile) {
      const int64_t r0 = tile * kTileRows, r1 = std::min(out_features, r0 + kTileRows);
      dequant(w, in, r0, r1, w_tile.data(), lut);
      at::Tensor w_f = at::from_blob(w_tile.data(), {r1 - r0, in}, at::kFloat);
      at::Tensor acc_view = acc.narrow(1, 0, r1 - r0);
      at::mm_out(acc_view, x_q, w_f.t());  // [T, rows]
      epilogue<scalar_t>(acc_view.data_ptr<float>(), acc_view.stride(0), num_tokens, r0, r1, scale, bias, out,
                         out_features);
    }
  });
}

}  // namespace

at::Tensor fp8_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& weight_scale,
                          const at::Tensor& input_scale, const std::optional<at::Tensor>& bias_in) {
  check_inputs(x_in, weight, weight_scale, input_scale, bias_in);
  const at::Tensor x = x_in.contiguous();
  const int64_t num_tokens = x.size(0), in = x.size(1), out_features = weight.size(0);
  at::Tensor out = at::empty({num_tokens, out_features}, x.options());
  if (num_tokens == 0 || out_features == 0) return out;

  const float s_in = *input_scale.data_ptr<float>();  // checked 0-dim float32 CPU; item() dispatches (~1 us)
  // scale[o] = input_scale * weight_scale[o], one float32 product per output row as the reference.
  std::vector<float> scale_buf(static_cast<size_t>(out_features));
  const at::Tensor w_scale = weight_scale.contiguous();
  const float* ws = w_scale.data_ptr<float>();
  for (int64_t o = 0; o < out_features; ++o) scale_buf[o] = s_in * ws[weight_scale.dim() == 0 ? 0 : o];
  const float* scale = scale_buf.data();
  at::Tensor bias;
  if (bias_in.has_value()) bias = bias_in->to(at::kFloat).contiguous();
  const float* bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(weight.data_ptr());

  const int64_t max_direct = use_bf16_gemm() ? kMaxDirectTokensBf16Gemm : kMaxDirectTokensF32Gemm;
  // x_q: [T, in] float32 holding exact E4M3 values.
  std::vector<float> xq_buf(static_cast<size_t>(num_tokens * in));
  float* xq = xq_buf.data();
  AT_DISPATCH_SWITCH(x.scalar_type(), "kilnlm::fp8_linear",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        quantize_activations<float>(x, s_in, xq);
        if (num_tokens <= max_direct) run_direct<float>(w, in, out_features, xq, num_tokens, scale, bias_ptr, out.data_ptr<float>());
        else run_tiled<float>(w, in, out_features, xq, num_tokens, scale, bias_ptr, out.data_ptr<float>());
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        quantize_activations<at::BFloat16>(x, s_in, xq);
        at::BFloat16* y = out.data_ptr<at::BFloat16>();
        if (num_tokens <= max_direct) run_direct<at::BFloat16>(w, in, out_features, xq, num_tokens, scale, bias_ptr, y);
        else run_tiled<at::BFloat16>(w, in, out_features, xq, num_tokens, scale, bias_ptr, y);
      }));
  return out;
}

}  // namespace kiln_fp8

TORCH_LIBRARY_IMPL(kilnlm, CPU, m) { m.impl("fp8_linear", &kiln_fp8::fp8_linear_cpu); }

KILN_C_SHIM aoti_torch_cpu_fp8_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle weight_scale,
                                      AtenTensorHandle input_scale, AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  using namespace kiln_shim;
  return call(ret0, [&] {
    return kiln_fp8::fp8_linear_cpu(tensor(x), tensor(weight), tensor(weight_scale), tensor(input_scale),
                                    optional_tensor(bias));
  });
}
