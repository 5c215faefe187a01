// kilnlm::gemm, CPU kernel (schema and numerics: kilnlm/plugins/schema.py): the 16/32-bit float linear
// layers and the LM head, y [T, out] = x [T, in] @ weight [out, in].T + bias, accumulated in float32.
//
// - bfloat16, up to kMaxDirectTokens = 64 tokens (generation steps of up to 64 sequences), on CPUs with
//   AVX512-BF16: the weight rows are read once per call, straight from the [out, in] tensor, and multiplied with VDPBF16PS
//   (pairwise bf16 products, exact in float32, accumulated in float32) against every token; the tokens
//   are taken in groups of 4 / 2 / 1 while a 16-row block of the weight is in L1/L2, so a batch of T
//   generation tokens reads the weights from memory once (decode is bound by the bytes of weights read;
//   bf16_gemv.h). The last out % 16 rows are computed one at a time.
// - otherwise (float32, many tokens, K not a multiple of 32, no AVX512-BF16): at::linear (oneDNN / MKL),
//   whose blocked GEMM wins once the weights are reused over many rows.
//
// The weight layout is the plain [out, in] of torch.nn.Linear, so the tied LM head and the embedding
// share one tensor (the embedding gathers its rows).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <optional>

#include "bf16_bits.h"
#include "cpu_features.h"
#include "row_blocks.h"

namespace kiln_gemm {

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16")
namespace avx512bf16 {
namespace {
#include "fp8_bf16_gemm.h"  // reduce16
#include "bf16_gemv.h"

// y[t, r] = bf16(sum + bias[r]) for rows [r0, r1).
void gemm_rows(const uint16_t* x, int64_t num_tokens, int64_t x_stride, const uint16_t* w, int64_t n, int64_t k,
               const float* bias, uint16_t* y, int64_t r0, int64_t r1) {
  gemv_any_rows(x, num_tokens, x_stride, PlainRows<Bf16Weights>{w, k}, n, k, r0, r1, GemvEpilogue(y, n, bias));
}
}  // namespace
}  // namespace avx512bf16
#pragma GCC pop_options
#endif

namespace {

// Up to this many tokens the direct kernel beats at::linear on SmolLM2's shapes, all 30 layers plus the
// LM head in turn (weights streamed from DRAM, 2 cores, scripts/bench_plugins.py --only gemm): 2.7x at
// T = 1, 1.8x at 16, 1.2-1.5x at 32, 1.1-1.3x at 64, 0.95x at 128, where oneDNN's blocked GEMM, reusing
// each weight block over more rows than this kernel keeps in cache, takes over.
constexpr int64_t kMaxDirectTokens = 64;

void check_inputs(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "kilnlm::gemm (CPU kernel): x and weight must be CPU tensors");
  TORCH_CHECK(x.dim() == 2, "kilnlm::gemm: x must be [num_tokens, in_features], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "kilnlm::gemm: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == x.scalar_type(),
              "kilnlm::gemm: weight must be a 2-D [out_features, in_features] tensor of x's dtype (", x.scalar_type(),
              "), got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(weight.size(1) == x.size(1), "kilnlm::gemm: x has ", x.size(1), " features but weight expects ",
              weight.size(1));
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->scalar_type() == x.scalar_type() &&
                    bias->device().is_cpu(),
                "kilnlm::gemm: bias must be [out_features=", weight.size(0), "] of x's dtype (", x.scalar_type(),
                "), got ", bias->scalar_type(), " ", bias->sizes());
  }
}

bool use_direct(const at::Tensor& x, const at::Tensor& weight) {
#if defined(__x86_64__)
  return x.scalar_type() == at::kBFloat16 && x.size(0) <= kMaxDirectTokens && weight.size(1) % 32 == 0 &&
         weight.size(1) > 0 && kiln::cpu_has_avx512_bf16();
#else
  return false;
#endif
}

}  // namespace

at::Tensor gemm_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias) {
  check_inputs(x_in, weight_in, bias);
  if (!use_direct(x_in, weight_in) || x_in.size(0) == 0) return at::linear(x_in, weight_in, bias);
#if defined(__x86_64__)
  const at::Tensor x = x_in.stride(1) == 1 ? x_in : x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const int64_t num_tokens = x.size(0), k = x.size(1), n = weight.size(0);
  at::Tensor y = at::empty({num_tokens, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  const at::Tensor bias_f32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(weight.data_ptr<at::BFloat16>());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t x_stride = x.stride(0);
  kiln::parallel_row_blocks(n, avx512bf16::kGemvBlockRows, [&](int64_t r0, int64_t r1) {
    avx512bf16::gemm_rows(xp, num_tokens, x_stride, wp, n, k, b, yp, r0, r1);
  });
  return y;
#else
  return at::linear(x_in, weight_in, bias);
#endif
}

}  // namespace kiln_gemm

TORCH_LIBRARY_IMPL(kilnlm, CPU, m) { m.impl("gemm", &kiln_gemm::gemm_cpu); }
