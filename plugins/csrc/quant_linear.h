// The one driver of the quantized linears: for the weight-only ones (fp8_linear, int4_linear,
// int8_linear) the token-count dispatch, the thread split of the generation-phase GEMVs and the context
// phase's tiling, over a per-format weight-row loader; int8_sq_linear (W8A8, exact int32 sums of quantized
// activations) runs its GEMMs over the same row split (run_rows) and epilogue. Included at file scope with
// the torch headers, outside the per-ISA copies (isa_variants.h).
//
//   y [T, out] = x [T, in] @ dequantize(weight [out, *]).T (+ bias), accumulated in float32
//
//   T <= the format's GEMV token limit  -> generation phase: format.generation(out), a fused
//   (every T with KILNLM_BATCH_INVARIANT   dequantize-and-multiply GEMV (each weight byte read once per
//   where the tiles sum in another order)  call; memory bound), usually through run_gemv below
//   more tokens, bf16 context GEMM      -> tiles of kTileRows output rows as exact bfloat16, VDPBF16PS (AMX
//                                          tiles where the CPU has AMX-BF16 and the format's amx_context())
//   more tokens, otherwise              -> tiles of kTileRows output rows as float32, at::mm
//
// A format (Fp8Format, Int4Format, Int8Format in the ops' files) provides:
//   kGemvTokens                  GemvTokenLimits: its tuned limits (scripts/bench_plugins.py)
//   int16_generation()           whether generation() takes the int16 GEMV for this call (bfloat16 x on AVX2
//                                CPUs; the int16_with_f32_gemm limit)
//   bf16_context_gemm()          whether the context phase multiplies bfloat16 tiles (AVX512-BF16)
//   context_sums_like_gemv()     whether the context phase sums each row as generation() does (same pairs,
//                                same lanes, same reduction), so a row's bits never depend on T
//   generation(out)              the generation phase, whole (it picks its GEMV per ISA)
//   prepare_context_x()          x as the tiles meet it, [T, in] float32 in natural column order (called
//                                once per call)
//   tile_f32(r0, r1, tile)       rows [r0, r1) dequantized into tile [r1 - r0, in] float32
//   x_row_bf16(x, dst, k_pad)    one row of that x as bfloat16 bits into dst [k_pad] (its columns from `in`
//                                on arrive zero)
//   tile_bf16(r0, r1, dst, k_pad) rows [r0, r1) as bfloat16 bits into dst [r1 - r0, k_pad] (the same)
//   bf16_gemm(...)               the AVX512-BF16 GEMM of its ISA namespace (fp8_bf16_gemm.h, bf16_gemm_nt)
//   amx_context()                whether the bf16 tiles may run on AMX instead (amx_bf16.h) where the CPU has it
//   amx_source()                 optional: the weight as amx_bf16.h's AmxWeightSource, which the AMX tiles
//                                convert a k chunk at a time, or none (then whole tiles through tile_bf16)
//   epilogue, f32_tile_epilogue  Epilogue: what the float32 sums are scaled by (the float32 tiles may carry
//                                the row scale already)
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_bf16.h"
#include "cpu_features.h"
#include "row_blocks.h"

namespace kiln {

// What every W8 linear op requires of x, weight and bias: x [T, in] float32 / bfloat16, weight [out, in]
// contiguous of weight_dtype (named weight_name in the messages), bias [out] or none, all on the CPU. `op`:
// the op's name, which every message starts with.
inline void check_linear_inputs(const char* op, const at::Tensor& x, const at::Tensor& weight, at::ScalarType weight_dtype,
                                const char* weight_name, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), op, " (CPU kernel): x and weight must be CPU tensors");
  TORCH_CHECK(x.dim() == 2, op, ": x must be [num_tokens, in_features], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op,
              ": x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == weight_dtype, op, ": weight must be a 2-D ", weight_name,
              " tensor [out_features, in_features], got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), op, ": weight must be contiguous (call .contiguous() when building)");
  TORCH_CHECK(weight.size(1) == x.size(1), op, ": x has ", x.size(1), " features but weight expects ", weight.size(1));
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0) && bias->device().is_cpu(), op,
                ": bias must be [out_features=", weight.size(0), "], got ", bias->sizes());
  }
}

// Output rows per context-phase tile: dequantized into a per-thread buffer, never the whole weight.
constexpr int64_t kTileRows = 64;

// Up to how many tokens a format's fused GEMV beats dequantize-then-GEMM, depending on the context GEMM it
// would otherwise take (the bf16 GEMM is ~3-4x the float32 one, so it takes over sooner; AMX tiles sooner
// still where the format's tiles take them) and on the GEMV: against the float32 tiles, the int16 GEMV
// (bfloat16 x as block floating point int16, VPMADDWD; AVX2 CPUs) keeps up far longer than a float32 one.
struct GemvTokenLimits {
  int64_t with_f32_gemm;
  int64_t int16_with_f32_gemm;
  int64_t with_bf16_gemm;
  int64_t with_amx_gemm;
};

// The shape of one call: x [num_tokens, in], weight rows of row_bytes bytes, out [num_tokens, out_features].
struct LinearShape {
  int64_t num_tokens, in, out_features, row_bytes;
};

// out[t, o] = acc[t, o - r0] * (token_scale[t] * row_scale[o], or row_scale[o], or 1) (+ bias[o]) in out's
// dtype: one float32 product of the scales as the references, then two roundings.
struct Epilogue {
  const float* row_scale = nullptr;    // [out] or null
  const float* bias = nullptr;         // [out] float32 or null
  const float* token_scale = nullptr;  // [T] per-token dynamic activation scales (int8_sq_linear) or null

  template <typename scalar_t, typename acc_t>
  void store(const acc_t* acc, int64_t acc_stride, int64_t num_tokens, int64_t r0, int64_t r1, scalar_t* out,
             int64_t out_stride) const {
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t o = r0; o < r1; ++o) {
        float y = static_cast<float>(acc[t * acc_stride + (o - r0)]);
        if (token_scale != nullptr) y = y * (token_scale[t] * row_scale[o]);
        else if (row_scale != nullptr) y = y * row_scale[o];
        if (bias != nullptr) y = y + bias[o];
        out[t * out_stride + o] = static_cast<scalar_t>(y);
      }
    }
  }
};

// rows(r0, r1, acc) writes acc[t, r] (row stride out_features, float32 or int32) for rows [r0, r1): chunks
// of 16-row multiples with at least ~16 KiB of weights each (so that small layers do not pay for
// threading), which parallel_row_chunks (row_blocks.h) hands to the threads; each chunk then stores its
// rows through the epilogue.
template <typename scalar_t, typename acc_t, typename RowsFn>
void run_rows(const LinearShape& s, acc_t* acc, const RowsFn& rows, const Epilogue& epilogue, scalar_t* out) {
  const int64_t min_rows = std::max<int64_t>(8, 16384 / std::max<int64_t>(s.row_bytes, 1));
  parallel_row_chunks(s.out_features, chunk_rows(s.out_features, 16, min_rows), [&](int64_t r0, int64_t r1) {
    rows(r0, r1, acc);
    epilogue.store(acc + r0, s.out_features, s.num_tokens, r0, r1, out, s.out_features);
  });
}

// Generation phase: run_rows with a GEMV, its float32 sums [T, out] in the calling thread's reused scratch.
template <typename scalar_t, typename RowsFn>
void run_gemv(const LinearShape& s, const RowsFn& gemv, const Epilogue& epilogue, scalar_t* out) {
  run_rows(s, thread_scratch<0>(s.num_tokens * s.out_features), gemv, epilogue, out);
}

// Context phase, float32: each thread dequantizes its tiles of kTileRows rows and multiplies them with all
// T rows of x through at::mm (float32 SGEMM).
template <typename scalar_t, typename Format>
void run_tiled_f32(const Format& format, const LinearShape& s, scalar_t* out) {
  const at::Tensor x = at::from_blob(const_cast<float*>(format.prepare_context_x()), {s.num_tokens, s.in}, at::kFloat);
  const int64_t num_tiles = (s.out_features + kTileRows - 1) / kTileRows;
  at::parallel_for(0, num_tiles, 1, [&](int64_t tile0, int64_t tile1) {
    std::vector<float> w_tile(static_cast<size_t>(kTileRows * s.in));  // [kTileRows, in]
    at::Tensor acc = at::empty({s.num_tokens, kTileRows}, at::kFloat);
    for (int64_t tile = tile0; tile < tile1; ++tile) {
      const int64_t r0 = tile * kTileRows, r1 = std::min(s.out_features, r0 + kTileRows);
      format.tile_f32(r0, r1, w_tile.data());
      at::Tensor acc_view = acc.narrow(1, 0, r1 - r0);
      at::mm_out(acc_view, x, at::from_blob(w_tile.data(), {r1 - r0, s.in}, at::kFloat).t());  // [T, rows]
      format.f32_tile_epilogue.store(acc_view.data_ptr<float>(), acc_view.stride(0), s.num_tokens, r0, r1, out,
                                     s.out_features);
    }
  });
}

// Whether the format's bfloat16 context tiles run on AMX here.
template <typename Format>
bool amx_tiles(const Format& format) {
#if defined(__x86_64__)
  return cpu_has_amx_bf16() && format.amx_context();
#else
  return false;
#endif
}

// Tokens per pass over the tiles on AMX: each pass dequantizes every tile again, and its packed x (k = 1536:
// 768 KiB) stays in L2 while the tiles meet it. In one pass at 2,048 tokens every 64-row tile re-read the
// whole packed x from L3 (an Intel Xeon, SmolLM2 int4_awq: 8 x 256-token prefill 1.6x bf16's time).
constexpr int64_t kAmxContextChunkTokens = 256;

// Whether Format has amx_source() (see the top of this file).
template <typename Format, typename = void>
struct HasAmxSource : std::false_type {};
template <typename Format>
struct HasAmxSource<Format, std::void_t<decltype(std::declval<const Format&>().amx_source())>> : std::true_type {};

// Context phase, bfloat16 (AVX512-BF16): x rounded (or exactly converted) to bfloat16 once, tiles of
// kTileRows rows as bfloat16, VDPBF16PS products accumulated in float32; tokens padded to 4, rows to 4,
// columns to 32 with zeros. With AMX (amx_bf16.h) where the format takes it (amx_context: not where its
// tiles must sum each row as its GEMV does), x is packed into B tiles once and each tile's rows, padded
// to 32, are the A tiles, kAmxContextChunkTokens tokens at a time; a format with amx_source() converts
// its weight a 32-row block's k chunk at a time instead (amx_bf16_linear_filled), into a buffer that
// stays in L1 where a whole tile went to L2 (kTileRows x 1536 bfloat16: 192 KiB). Every (token, row) sum
// is the same whichever pass the token is in.
template <typename scalar_t, typename Format>
void run_tiled_bf16(const Format& format, const LinearShape& s, scalar_t* out) {
  const int64_t k_pad = (s.in + 31) / 32 * 32, tokens_pad = (s.num_tokens + 3) / 4 * 4;
  const float* x = format.prepare_context_x();
  // The calling thread's buffers (reused, no page faults for a 2,048-token chunk's megabytes), handed to
  // the workers as pointers. xb [tokens_pad, k_pad] bf16 bits, the padding columns and tokens zero.
  auto* xb = reinterpret_cast<uint16_t*>(thread_scratch<7>(tokens_pad * k_pad / 2));
  if (k_pad != s.in) std::fill(xb, xb + tokens_pad * k_pad, uint16_t{0});
  at::parallel_for(0, s.num_tokens, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) format.x_row_bf16(x + t * s.in, xb + t * k_pad, k_pad);
  });
  std::fill(xb + s.num_tokens * k_pad, xb + tokens_pad * k_pad, uint16_t{0});
  const bool amx = amx_tiles(format);
  uint32_t* packed = nullptr;  // x as AMX B tiles
  if (amx) {
    TORCH_INTERNAL_ASSERT(format.epilogue.token_scale == nullptr, "the AMX tiles take weight-only formats");
    packed = reinterpret_cast<uint32_t*>(thread_scratch<8>(amx_bf16_packed_size(s.num_tokens, k_pad)));
    amx_bf16_pack(xb, s.num_tokens, k_pad, k_pad, packed);
    if constexpr (HasAmxSource<Format>::value) {
      if (const std::optional<AmxWeightSource> source = format.amx_source()) {
        // 32-row blocks, each converted a k chunk at a time into L1 just before its tiles multiply it; the
        // token chunks one after another, each split between the threads, so that its packed x stays in L2
        const Epilogue& e = format.epilogue;
        for (int64_t t0 = 0; t0 < s.num_tokens; t0 += kAmxContextChunkTokens) {
          const int64_t num_tokens = std::min(kAmxContextChunkTokens, s.num_tokens - t0);
          parallel_row_blocks(s.out_features, 32, [&](int64_t r0, int64_t r1) {
            amx_bf16_linear_filled(packed + amx_bf16_packed_size(t0, k_pad), num_tokens, *source, r0, r1, k_pad,
                                   e.row_scale, e.bias, out + t0 * s.out_features, s.out_features,
                                   std::is_same_v<scalar_t, at::BFloat16>);
          });
        }
        return;
      }
    }
  }
  const int64_t row_multiple = amx ? 32 : 4, chunk_tokens = amx ? kAmxContextChunkTokens : tokens_pad;
  const int64_t num_tiles = (s.out_features + kTileRows - 1) / kTileRows;
  at::parallel_for(0, num_tiles, 1, [&](int64_t tile0, int64_t tile1) {
    // this thread's buffers, 64-byte aligned: every row of a weight tile starts a cache line (k_pad % 32 == 0)
    auto* wb = reinterpret_cast<uint16_t*>(thread_scratch<5>(kTileRows * k_pad / 2));  // [kTileRows, k_pad] bf16 bits
    float* acc = amx ? nullptr : thread_scratch<6>(tokens_pad * kTileRows);             // [tokens_pad, kTileRows]
    if (k_pad != s.in) std::fill(wb, wb + kTileRows * k_pad, uint16_t{0});  // the padding columns
    for (int64_t t0 = 0; t0 < s.num_tokens; t0 += chunk_tokens) {
      const int64_t num_tokens = std::min(chunk_tokens, s.num_tokens - t0);
      for (int64_t tile = tile0; tile < tile1; ++tile) {
        const int64_t r0 = tile * kTileRows, r1 = std::min(s.out_features, r0 + kTileRows);
        const int64_t rows_pad = (r1 - r0 + row_multiple - 1) / row_multiple * row_multiple;
        format.tile_bf16(r0, r1, wb, k_pad);
        std::fill(wb + (r1 - r0) * k_pad, wb + rows_pad * k_pad, uint16_t{0});
        if (amx) {  // straight into out through the format's epilogue; token blocks of 16 from t0 on
          const Epilogue& e = format.epilogue;
          amx_bf16_linear(packed + amx_bf16_packed_size(t0, k_pad), num_tokens, wb, r1 - r0, k_pad,
                          e.row_scale != nullptr ? e.row_scale + r0 : nullptr, e.bias != nullptr ? e.bias + r0 : nullptr,
                          out + t0 * s.out_features + r0, s.out_features, std::is_same_v<scalar_t, at::BFloat16>);
        } else {
          format.bf16_gemm(xb, tokens_pad, wb, rows_pad, k_pad, acc, kTileRows);
          format.epilogue.store(acc, kTileRows, s.num_tokens, r0, r1, out, s.out_features);
        }
      }
    }
  });
}

// The token-count dispatch of every weight-only quantized linear (see the top of this file).
template <typename scalar_t, typename Format>
void run_quantized_linear(const Format& format, const LinearShape& s, scalar_t* out) {
  const bool bf16_gemm = format.bf16_context_gemm();
  const GemvTokenLimits& limits = Format::kGemvTokens;
  int64_t max_gemv_tokens = limits.with_f32_gemm;
  if (bf16_gemm) max_gemv_tokens = amx_tiles(format) ? limits.with_amx_gemm : limits.with_bf16_gemm;
  else if (format.int16_generation()) max_gemv_tokens = limits.int16_with_f32_gemm;
  if (s.num_tokens <= max_gemv_tokens) return format.generation(out);
  // batch invariance (cpu_features.h): a GEMV sums each token's row alone, in one order at every T
  if (batch_invariant_requested() && !format.context_sums_like_gemv()) return format.generation(out);
  if (bf16_gemm) return run_tiled_bf16(format, s, out);
  run_tiled_f32(format, s, out);
}

}  // namespace kiln
