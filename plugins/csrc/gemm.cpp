// kilnlm::gemm, CPU kernel (schema and numerics: kilnlm/plugins/schema.py): the 16/32-bit float linear
// layers and the LM head, y [T, out] = x [T, in] @ weight [out, in].T + bias, accumulated in float32.
//
// - bfloat16 on CPUs with AMX-BF16 (Intel Sapphire Rapids and later), in_features a multiple of 32: AMX
//   tiles at every token count (bf16_amx_gemm.h), the weight tiles loaded straight from the [out, in]
//   tensor. Each (token, row) sums in one order whatever the token count, so this path is batch-invariant
//   as it is. At one token it streams the weights a few percent slower than the direct kernel below, at
//   16-64 tokens it is 2.6-3.5x faster, and past 64 about as fast as at::linear (oneDNN on AMX;
//   docs/performance.md).
// - bfloat16, up to kMaxDirectTokens = 64 tokens (generation steps of up to 64 sequences), on CPUs with
//   AVX512-BF16 but no AMX: the weight rows are read once per call, straight from the [out, in] tensor,
//   and multiplied with VDPBF16PS (pairwise bf16 products, exact in float32, accumulated in float32)
//   against every token; the tokens are taken in groups of 4 / 2 / 1 while a 16-row block of the weight
//   is in L1/L2, so a batch of T generation tokens reads the weights from memory once (decode is bound by
//   the bytes of weights read; bf16_gemv.h). The last out % 16 rows are computed one at a time. With
//   KILNLM_BATCH_INVARIANT=1 (cpu_features.h), every token count, 64 tokens at a time.
// - bfloat16 on CPUs with AVX2 but not AVX512-BF16 (AMD Zen 2/3, Intel before Cooper Lake): at::linear's
//   bfloat16 GEMM there has no native bf16 arithmetic and runs at ~13 GB/s in the generation phase and
//   ~8 GFLOP/s in the context phase (SmolLM2's layers, 2 cores). Up to kMaxDirectTokensAvx2 tokens, a GEMV
//   that widens each weight to float32 in registers (a zero-extension and a shift per 8 weights) and FMAs
//   it with float32 x; beyond, tiles of kTileRows weight rows widened to float32 in a thread-local buffer
//   and multiplied through at::mm (float32 SGEMM), all T rows at once. The products of two bfloat16 values
//   are exact in float32 either way; only the summation order differs from at::linear.
//   With KILNLM_BATCH_INVARIANT=1, the GEMV at every token count.
// - float32, up to kMaxGemvTokensF32 tokens: that GEMV again, the float32 weights read as they are (on
//   AMD CPUs MKL's SGEMV streams SmolLM2's weights at a third of the bandwidth, see kMaxGemvTokensF32).
// - otherwise (float32 past that, bfloat16 past 64 tokens or K not a multiple of 32 on AVX512-BF16):
//   at::linear (oneDNN / MKL), whose blocked GEMM wins once the weights are reused over many rows. It sums
//   each row in an order that depends on the row count, so with KILNLM_BATCH_INVARIANT=1 these take the
//   GEMV above instead (its portable twin on CPUs without AVX2), at every token count.
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
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "amx_bf16.h"
#include "bf16_bits.h"
#include "c_shim.h"
#include "cpu_features.h"
#include "row_blocks.h"

namespace kiln_gemm {

#define KILN_ISA_KERNELS "gemm_kernels.h"
#include "isa_variants.h"
#undef KILN_ISA_KERNELS

namespace {

// Up to this many tokens the direct kernel beats at::linear on SmolLM2's shapes, all 30 layers plus the
// LM head in turn (weights streamed from DRAM, 2 cores, scripts/bench_plugins.py --only gemm): 2.7x at
// T = 1, 1.8x at 16, 1.2-1.5x at 32, 1.1-1.3x at 64, 0.95x at 128, where oneDNN's blocked GEMM, reusing
// each weight block over more rows than this kernel keeps in cache, takes over.
constexpr int64_t kMaxDirectTokens = 64;

// AVX2 (no AVX512-BF16): the GEMV up to this many tokens, float32 tiles of kTileRows rows beyond. SmolLM2's
// 30 layers, cold weights, 2 threads of an AMD EPYC Zen 3: the tiles take 1.51x the GEMV's time at 17
// tokens, 1.17x at 32, 1.03x at 48, 0.96x at 64.
constexpr int64_t kMaxDirectTokensAvx2 = 48;

// Float32: the AVX2 GEMV up to this many tokens, at::linear beyond. SmolLM2's layers and LM head, cold
// weights, 2 threads of an AMD EPYC (Zen 4), scripts/bench_plugins.py --only gemm: 53.5 against 18.7 GB/s
// at T = 1 (2.9x), 3.5x at 4, 1.8x at 16, 1.2x at 64, 1.03x at 128.
constexpr int64_t kMaxGemvTokensF32 = 64;
constexpr int64_t kTileRows = 64;

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

bool use_avx2(const at::Tensor& x) {
#if defined(__x86_64__)
  return x.scalar_type() == at::kBFloat16 && !kiln::cpu_has_avx512_bf16() && kiln::cpu_has_avx2_fma_f16c();
#else
  return false;
#endif
}

bool use_direct(const at::Tensor& x, const at::Tensor& weight, bool batch_invariant) {
#if defined(__x86_64__)
  return x.scalar_type() == at::kBFloat16 && weight.size(1) % 32 == 0 && weight.size(1) > 0 &&
         kiln::cpu_has_avx512_bf16() && (x.size(0) <= kMaxDirectTokens || batch_invariant);
#else
  return false;
#endif
}

// The AMX path (top of the file); it shares the direct kernel's shape requirements.
bool use_amx(const at::Tensor& x, const at::Tensor& weight) {
#if defined(__x86_64__)
  return x.scalar_type() == at::kBFloat16 && weight.size(1) % 32 == 0 && weight.size(1) > 0 && kiln::cpu_has_amx_bf16();
#else
  return false;
#endif
}

// acc[t, r] (row stride n) for weight rows [r0, r1): the AVX2 GEMV where the CPU has it, else its portable
// twin (gemm_kernels.h).
template <typename W>
void gemv_rows(const W* w, int64_t n, int64_t k, int64_t r0, int64_t r1, const float* x, int64_t num_tokens, float* acc) {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx2_fma_f16c()) return avx2::gemv_rows(w, n, k, r0, r1, x, num_tokens, acc);
#endif
  generic::gemv_rows(w, n, k, r0, r1, x, num_tokens, acc);
}

// Float32 sums of float32 operands (bfloat16 widened exactly), y [T, n] in x's dtype = x [T, k] @
// weight [n, k].T + bias (see the top of the file for who calls it): up to kMaxDirectTokensAvx2 tokens, or
// every token count with gemv_every_token_count, the GEMV; beyond, bfloat16 weight tiles widened to float32
// and multiplied through at::mm (float32 has no tiles: its callers pass gemv_every_token_count).
template <typename scalar_t>
at::Tensor gemm_widened(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias,
                        bool gemv_every_token_count) {
  using weight_t = std::conditional_t<std::is_same_v<scalar_t, float>, float, uint16_t>;
  const at::Tensor x = x_in.contiguous();
  const at::Tensor weight = weight_in.contiguous();
  const int64_t num_tokens = x.size(0), k = x.size(1), n = weight.size(0);
  at::Tensor y = at::empty({num_tokens, n}, x.options().memory_format(at::MemoryFormat::Contiguous));
  if (num_tokens == 0 || n == 0) return y;
  const at::Tensor bias_f32 = bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const float* b = bias.has_value() ? bias_f32.data_ptr<float>() : nullptr;
  const auto* wp = reinterpret_cast<const weight_t*>(weight.data_ptr<scalar_t>());
  scalar_t* yp = y.data_ptr<scalar_t>();
  // y[t, r] for rows [r0, r1) from float32 sums acc[t, r - r0] (row stride acc_stride)
  const auto store = [&](const float* acc, int64_t acc_stride, int64_t r0, int64_t r1) {
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t r = r0; r < r1; ++r) {
        const float v = acc[t * acc_stride + r - r0] + (b != nullptr ? b[r] : 0.f);
        if constexpr (std::is_same_v<scalar_t, float>) yp[t * n + r] = v;
        else reinterpret_cast<uint16_t*>(yp)[t * n + r] = kiln::bf16_bits(v);
      }
  };
  const float* xf = nullptr;  // x as float32: [T, k]
  if constexpr (std::is_same_v<scalar_t, float>) {
    xf = x.data_ptr<float>();
  } else {
    float* widened = kiln::thread_scratch<1>(num_tokens * k);
    const at::BFloat16* xb = x.data_ptr<at::BFloat16>();
    at::parallel_for(0, num_tokens, std::max<int64_t>(1, 65536 / std::max<int64_t>(k, 1)), [&](int64_t t0, int64_t t1) {
#if defined(__x86_64__)
      if (kiln::cpu_has_avx2_fma_f16c())
        return avx2::widen(reinterpret_cast<const uint16_t*>(xb) + t0 * k, (t1 - t0) * k, widened + t0 * k);
#endif
      for (int64_t i = t0 * k; i < t1 * k; ++i) widened[i] = static_cast<float>(xb[i]);
    });
    xf = widened;
  }
  if (num_tokens <= kMaxDirectTokensAvx2 || gemv_every_token_count) {
    float* acc_ptr = kiln::thread_scratch<0>(num_tokens * n);
    // ~16 KiB of weights per chunk at least, so that small layers do not pay for threading
    const int64_t min_rows = std::max<int64_t>(8, 16384 / std::max<int64_t>(k * static_cast<int64_t>(sizeof(weight_t)), 1));
    kiln::parallel_row_chunks(n, kiln::chunk_rows(n, 16, min_rows), [&](int64_t r0, int64_t r1) {
      gemv_rows(wp, n, k, r0, r1, xf, num_tokens, acc_ptr);
      store(acc_ptr + r0, n, r0, r1);
    });
    return y;
  }
#if defined(__x86_64__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const at::Tensor x_f32 = at::from_blob(const_cast<float*>(xf), {num_tokens, k}, at::kFloat);
    const int64_t num_tiles = (n + kTileRows - 1) / kTileRows;
    at::parallel_for(0, num_tiles, 1, [&](int64_t tile0, int64_t tile1) {
      std::vector<float> w_tile(static_cast<size_t>(kTileRows * k));  // [kTileRows, k]
      at::Tensor acc = at::empty({num_tokens, kTileRows}, at::kFloat);
      for (int64_t tile = tile0; tile < tile1; ++tile) {
        const int64_t r0 = tile * kTileRows, r1 = std::min(n, r0 + kTileRows);
        avx2::widen(wp + r0 * k, (r1 - r0) * k, w_tile.data());
        at::Tensor acc_view = acc.narrow(1, 0, r1 - r0);
        at::mm_out(acc_view, x_f32, at::from_blob(w_tile.data(), {r1 - r0, k}, at::kFloat).t());  // [T, rows]
        store(acc_view.data_ptr<float>(), acc_view.stride(0), r0, r1);
      }
    });
    return y;
  }
#endif
  TORCH_CHECK(false, "kilnlm::gemm: no tiled path for ", x.scalar_type(), " on this CPU");
}

}  // namespace

at::Tensor gemm_cpu(const at::Tensor& x_in, const at::Tensor& weight_in, const std::optional<at::Tensor>& bias) {
  check_inputs(x_in, weight_in, bias);
  const bool batch_invariant = kiln::batch_invariant_requested();
  if (use_avx2(x_in)) return gemm_widened<at::BFloat16>(x_in, weight_in, bias, batch_invariant);
  if (x_in.scalar_type() == at::kFloat &&
      ((x_in.size(0) <= kMaxGemvTokensF32 && kiln::cpu_has_avx2_fma_f16c()) || batch_invariant))
    return gemm_widened<float>(x_in, weight_in, bias, /*gemv_every_token_count=*/true);
  const bool amx = use_amx(x_in, weight_in);
  const bool direct = amx || use_direct(x_in, weight_in, batch_invariant);
  if (batch_invariant && !direct) return gemm_widened<at::BFloat16>(x_in, weight_in, bias, /*gemv_every_token_count=*/true);
  if (!direct || x_in.size(0) == 0) return at::linear(x_in, weight_in, bias);
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
  if (amx) {  // x packed into B tiles once, then 32-row blocks of the weight split between the threads
    auto* packed = reinterpret_cast<uint32_t*>(kiln::thread_scratch<0>(amxbf16::amx_packed_x_size(num_tokens, k)));
    kiln::amx_bf16_pack(xp, num_tokens, x_stride, k, packed);
    // Past kAmxChunkTokens tokens, the chunks one after another, each split between the threads: a thread's
    // row chunks then all read one chunk's packed x, which stays in L2, where each had read all of it (2,048
    // tokens of k = 576: 2.4 MB from L3 for each of the ~16 row chunks a thread takes)
    for (int64_t t0 = 0; t0 < num_tokens; t0 += amxbf16::kAmxChunkTokens) {
      const int64_t chunk = std::min(amxbf16::kAmxChunkTokens, num_tokens - t0);
      const uint32_t* chunk_x = packed + amxbf16::amx_packed_x_size(t0, k);
      const amxbf16::GemvEpilogue epilogue(yp + t0 * n, n, b);
      kiln::parallel_row_blocks(n, amxbf16::kAmxBlockRows, [&](int64_t r0, int64_t r1) {
        // 32 rows of bfloat16 for a partial last block
        auto* tail = reinterpret_cast<uint16_t*>(kiln::thread_scratch<1>(amxbf16::kAmxBlockRows * k / 2));
        amxbf16::amx_gemm_rows(chunk_x, chunk, wp, n, k, r0, r1, tail, epilogue);
      });
    }
    return y;
  }
  for (int64_t t0 = 0; t0 < num_tokens; t0 += kMaxDirectTokens) {  // one pass unless batch-invariant
    const int64_t chunk = std::min(kMaxDirectTokens, num_tokens - t0);
    kiln::parallel_row_blocks(n, avx512bf16::kGemvBlockRows, [&](int64_t r0, int64_t r1) {
      avx512bf16::gemm_rows(xp + t0 * x_stride, chunk, x_stride, wp, n, k, b, yp + t0 * n, r0, r1);
    });
  }
  return y;
#else
  return at::linear(x_in, weight_in, bias);
#endif
}

}  // namespace kiln_gemm

#if defined(__x86_64__)
namespace kiln {

int64_t amx_bf16_packed_size(int64_t num_tokens, int64_t k) { return kiln_gemm::amxbf16::amx_packed_x_size(num_tokens, k); }

void amx_bf16_pack(const uint16_t* x, int64_t num_tokens, int64_t x_stride, int64_t k, uint32_t* packed) {
  const int64_t blocks = (num_tokens + kiln_gemm::amxbf16::kAmxTokens - 1) / kiln_gemm::amxbf16::kAmxTokens;
  // a block is 16 tokens x k: threads only for several (a prefill), not for a decode step's one
  at::parallel_for(0, blocks, 2, [&](int64_t b0, int64_t b1) {
    kiln_gemm::amxbf16::amx_pack_x(x, num_tokens, x_stride, k, packed, b0, b1);
  });
}

void amx_bf16_linear(const uint32_t* packed, int64_t num_tokens, const uint16_t* w, int64_t rows, int64_t k,
                     const float* row_scale, const float* bias, void* out, int64_t out_stride, bool out_bf16) {
  const kiln_gemm::amxbf16::GemvEpilogue epilogue(out, out_stride, bias, row_scale, out_bf16);
  kiln_gemm::amxbf16::amx_gemm_rows(packed, num_tokens, w, rows, k, 0, rows, /*tail_block=*/nullptr, epilogue);
}

void amx_bf16_linear_filled(const uint32_t* packed, int64_t num_tokens, const AmxWeightSource& source, int64_t r0,
                            int64_t r1, int64_t k, const float* row_scale, const float* bias, void* out,
                            int64_t out_stride, bool out_bf16) {
  TORCH_INTERNAL_ASSERT(num_tokens <= kiln_gemm::amxbf16::kAmxChunkTokens, "one pass of at most 256 tokens");
  const kiln_gemm::amxbf16::GemvEpilogue epilogue(out, out_stride, bias, row_scale, out_bf16);
  // two fill buffers of kAmxFillSteps x 32 x 32 bfloat16 bits
  auto* buffers = reinterpret_cast<uint16_t*>(kiln::thread_scratch<10>(kAmxFillSteps * 32 * 32));
  kiln_gemm::amxbf16::amx_filled_rows(packed, num_tokens, source, k, r0, r1, buffers, epilogue);
}

}  // namespace kiln
#endif

TORCH_LIBRARY_IMPL(kilnlm, CPU, m) { m.impl("gemm", &kiln_gemm::gemm_cpu); }

KILN_C_SHIM aoti_torch_cpu_gemm(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* bias,
                                AtenTensorHandle* ret0) {
  using namespace kiln_shim;
  return call(ret0, [&] { return kiln_gemm::gemm_cpu(tensor(x), tensor(weight), optional_tensor(bias)); });
}
