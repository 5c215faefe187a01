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
// - int8_sq_linear, any token count: int8 x int8 products summed exactly in int32: from 3 tokens on AMX-INT8
//   tiles where the CPU has them (TDPBSSD, int8_amx_gemm.h, the weight rows as A tiles), else by a
//   register-blocked micro-kernel (from 4 tokens AVX512-VNNI VPDPBUSD where the CPU has it,
//   int8_vnni_gemm.h; else sign extension to int16 + VPMADDWD), over tiles of rows so a tile stays in cache
//   while every token block passes over it. Bit-exact with the reference on every path.
// All parallelize over chunks of output rows (row_blocks.h). int8_linear's token-count dispatch, thread split
// and tiling are quant_linear.h's (the driver of every weight-only quantized linear; Int8Format here);
// int8_sq_linear keeps its own (W8A8: quantized activations, exact int32 sums) and shares its epilogue.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "bf16_bits.h"
#include "c_shim.h"
#include "cpu_features.h"
#include "int16_activations.h"
#include "quant_linear.h"
#include "row_blocks.h"

namespace kiln_int8 {
#define KILN_ISA_KERNELS "int8_kernels.h"
#include "isa_variants.h"
#undef KILN_ISA_KERNELS

namespace {

// int8_sq_linear: below this many tokens the VPMADDWD GEMV, which reads each weight byte once, beats the
// VNNI kernel, which sums every row tile once more for its offset correction (cold-weight decode sweep of
// scripts/bench_plugins.py: ~6 vs ~10 ms per 30 layers).
constexpr int64_t kMinVnniTokens = 4;
// ... and from this many, AMX-INT8 tiles (int8_amx_gemm.h) where the CPU has them: on an Intel Xeon with AMX,
// SmolLM2's 30 layers with cold weights took 4.6 against 5.4 ms at 3 tokens, 4.3 against 3.6 at 2 (the
// VPMADDWD GEMV); cache-hot 3072x576 at 32 tokens 42-73 against 219 us (VNNI), at 2,048 tokens 2.6 against
// 15.4 ms.
constexpr int64_t kMinAmxTokens = 3;
using kiln::kTileRows;

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
  kiln::check_linear_inputs(op, x, weight, at::kChar, "int8", bias);
  const int64_t out_features = weight.size(0);
  TORCH_CHECK(weight_scale.scalar_type() == at::kFloat && weight_scale.dim() == 1 && weight_scale.size(0) == out_features &&
                  weight_scale.device().is_cpu(),
              op, ": weight_scale must be float32 [out_features=", out_features, "] (per output channel) on the CPU, got ",
              weight_scale.scalar_type(), " ", weight_scale.sizes());
}

// x [T, in] (f32 / bf16) -> float32 copy, times pre_quant_scale when given.
template <typename scalar_t>
void to_float(const at::Tensor& x, const float* pqs, float* dst) {
  const int64_t in = x.size(1);
  const scalar_t* src = x.data_ptr<scalar_t>();
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, 65536 / std::max<int64_t>(in, 1)), [=](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const scalar_t* row = src + t * in;
      float* dst_row = dst + t * in;
      // restrict and values captured (not references): otherwise a store through dst_row may alias row, pqs or
      // the loop's bound, and the loops stay scalar
      const scalar_t* __restrict from = row;
      float* __restrict to = dst_row;
      const float* __restrict factor = pqs;
      if (factor == nullptr)
        for (int64_t c = 0; c < in; ++c) to[c] = static_cast<float>(from[c]);
      else
        for (int64_t c = 0; c < in; ++c) to[c] = static_cast<float>(from[c]) * factor[c];
    }
  });
}

at::Tensor float_bias(const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? bias->to(at::kFloat).contiguous() : at::Tensor();
}

// ---------------------------------------------------------------------------------------------- W8A16

// int8 weight rows with per-row scales (W8A16) for the quantized-linear driver (quant_linear.h):
// y = (x @ q.T) * scale[o] (+ bias[o]).
struct Int8Format {
  // Up to this many tokens the fused GEMV beats dequantize-then-GEMM (scripts/bench_plugins.py, SmolLM2's
  // shapes); the bf16 GEMM is ~3x the float32 one, so it takes over sooner (its fixed cost, converting the
  // weight to bf16 tiles, is paid back from ~5 tokens). The int16 GEMV beats the float32 tiles at every
  // token count (an AMD EPYC Zen 3, 2 threads, SmolLM2's 30 layers cold: the tiles take 1.98x its time at 17
  // tokens, 1.55x at 32, 1.25x at 64, 1.38x at 128, 1.08-1.12x at 512-2,048), so it serves them all.
  static constexpr kiln::GemvTokenLimits kGemvTokens{/*with_f32_gemm=*/16,
                                                     /*int16_with_f32_gemm=*/std::numeric_limits<int64_t>::max(),
                                                     /*with_bf16_gemm=*/4, /*with_amx_gemm=*/4};

  const at::Tensor& x;  // [T, in] float32 / bfloat16, contiguous
  const int8_t* w;      // [out, in]
  float* xs;            // [T, in] float32 copy of x (this thread's scratch)
  kiln::LinearShape shape;
  kiln::Epilogue epilogue;           // * scale[o] (+ bias)
  kiln::Epilogue f32_tile_epilogue;  // + bias: the float32 tiles hold q * scale

  bool x_bf16() const { return x.scalar_type() == at::kBFloat16; }

  bool bf16_context_gemm() const { return x_bf16() && kiln::cpu_has_avx512_bf16(); }

  // The AVX512-BF16 GEMV (bf16_gemv.h) and the bf16 tiles sum the same pairs into the same lanes and reduce
  // them alike (reduce16), and scale after the sum: each row gets the same bits from either.
  bool bf16_gemv_sums_like_tiles() const {
#if defined(__x86_64__)
    return bf16_context_gemm() && shape.in % avx512bf16::PlainRows<avx512bf16::Int8Weights>::kCols == 0;
#else
    return false;
#endif
  }

  // With KILNLM_BATCH_INVARIANT the generation phase takes that bf16 GEMV rather than the int16 one (block
  // floating point x: other sums), so the tiles keep the context phase; the float32 tiles (at::mm) never sum
  // as the GEMV does.
  bool context_sums_like_gemv() const { return bf16_gemv_sums_like_tiles() && kiln::batch_invariant_requested(); }

#if defined(__x86_64__)
  // AVX2's int16 GEMV can take this call's shapes on this CPU (bfloat16 x).
  bool int16_gemv_applies() const { return kiln::cpu_has_avx2_fma_f16c() && shape.in % avx2::kInt16BlockCols == 0; }
#endif

  // generation() takes AVX2's int16 GEMV where the context tiles would be float32 (but for an x holding
  // inf / NaN, which int16_quantize refuses).
  bool int16_generation() const {
#if defined(__x86_64__)
    return x_bf16() && !kiln::cpu_has_avx512() && int16_gemv_applies();
#else
    return false;
#endif
  }

  // The bf16 context tiles run on AMX where the CPU has it (quant_linear.h), but for KILNLM_BATCH_INVARIANT,
  // where they must sum as the bf16 GEMV does.
  bool amx_context() const { return !context_sums_like_gemv(); }

  template <typename scalar_t>
  void generation(scalar_t* out) const {
    const int64_t num_tokens = shape.num_tokens, in = shape.in, out_features = shape.out_features;
#if defined(__x86_64__)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      const bool bf16_gemm = bf16_context_gemm();
      // Block floating point int16 x through AVX2's VPMADDWD (int8_kernels.h, gemv_int16_rows): on AVX2
      // CPUs, and on AVX512-BF16 CPUs too (but for KILNLM_BATCH_INVARIANT, see context_sums_like_gemv;
      // on an AMD Zen 4 just as fast), where the bf16 GEMV below is bound by its instructions (an
      // Intel Xeon, 30 cold SmolLM2 gate_up + down pairs: 62-66 against 97 us per pair at one token, 140
      // against 165 at four; a cold decode sweep 34.7 against 25.0 GB/s).
      const bool int16_on_bf16 = bf16_gemm && !context_sums_like_gemv();
      if ((int16_on_bf16 || !kiln::cpu_has_avx512()) && int16_gemv_applies()) {
        thread_local kiln::Int16Activations xq;
        xq.resize(num_tokens, in, in / avx2::kInt16BlockCols);
        if (avx2::int16_quantize(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), nullptr, num_tokens, in,
                                 avx2::kInt16BlockCols, /*nibble_chunks=*/false, xq.row.data(), xq.x16.data(),
                                 xq.x_scale.data(), xq.x_sum.data())) {
          // the pointers, not xq: a worker thread naming xq would get its own (empty) thread_local
          const int16_t* x16 = xq.x16.data();
          const float* x_scale = xq.x_scale.data();
          kiln::run_gemv(shape, [&](int64_t r0, int64_t r1, float* acc) {
            avx2::gemv_int16_rows(w, in, r0, r1, x16, num_tokens, in, x_scale, acc, out_features);
          }, epilogue, out);
          return;
        }
      }
      // bf16_gemv.h (cold SmolLM2 decode sweep: 37-48 GB/s on an AMD Zen 4; an x the int16 path refuses)
      if (bf16_gemm && in % avx512bf16::PlainRows<avx512bf16::Int8Weights>::kCols == 0) {
        const auto* xb = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
        auto* yb = reinterpret_cast<uint16_t*>(out);
        kiln::parallel_row_blocks(out_features, avx512bf16::kGemvBlockRows, [&](int64_t r0, int64_t r1) {
          avx512bf16::gemv_int8_rows(xb, num_tokens, w, out_features, in, epilogue.row_scale, epilogue.bias, yb, r0, r1);
        });
        return;
      }
    }
#endif
    prepare_context_x();
    const GemvF32Fn gemv = gemv_f32_fn();
    kiln::run_gemv(shape, [&](int64_t r0, int64_t r1, float* acc) {
      gemv(w, in, r0, r1, xs, num_tokens, in, acc, out_features);
    }, epilogue, out);
  }

  const float* prepare_context_x() const {
    if (x_bf16()) to_float<at::BFloat16>(x, nullptr, xs);
    else to_float<float>(x, nullptr, xs);
    return xs;
  }

  // float32 tiles: q * scale[r] rounded once (the epilogue then only adds the bias).
  void tile_f32(int64_t r0, int64_t r1, float* tile) const {
    const int64_t in = shape.in;
    const float* scale = epilogue.row_scale;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < in; ++c) tile[(r - r0) * in + c] = static_cast<float>(w[r * in + c]) * scale[r];
  }

  // bfloat16: q is exact in bfloat16 (8 significant bits), so VDPBF16PS forms exact products of x and q,
  // summed in float32; the per-row scale is applied after the sum.
  void x_row_bf16(const float* xs_row, uint16_t* dst, int64_t k_pad) const {
#if defined(__x86_64__)
    avx512bf16::to_bf16_padded(xs_row, shape.in, dst, k_pad);
#endif
  }

  void tile_bf16(int64_t r0, int64_t r1, uint16_t* dst, int64_t k_pad) const {
#if defined(__x86_64__)
    for (int64_t r = r0; r < r1; ++r) avx512bf16::int8_to_bf16_padded(w + r * shape.in, shape.in, dst + (r - r0) * k_pad, k_pad);
#endif
  }

  void bf16_gemm(const uint16_t* xb, int64_t tokens_pad, const uint16_t* wb, int64_t rows_pad, int64_t k_pad, float* acc,
                 int64_t acc_stride) const {
#if defined(__x86_64__)
    avx512bf16::bf16_gemm_nt(xb, tokens_pad, wb, rows_pad, k_pad, acc, acc_stride);
#endif
  }
};

// ----------------------------------------------------------------------------------------------- W8A8

// The activation quantizer of the CPU's ISA: quantize_int8_rows, and amax_abs for per-token scales.
struct Quantizer {
  void (*quantize)(const float*, int64_t, float, int16_t*);
  float (*amax)(const float*, int64_t);
};

Quantizer quantizer() {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx512()) return {avx512::quantize_int8_rows, avx512::amax_abs};
  if (kiln::cpu_has_avx2_fma_f16c()) return {avx2::quantize_int8_rows, avx2::amax_abs};
#endif
  return {generic::quantize_int8_rows, generic::amax_abs};
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
  const Quantizer q = quantizer();
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, 65536 / std::max<int64_t>(in, 1)), [&](int64_t t0, int64_t t1) {
    if (token_scale == nullptr) return q.quantize(xs + t0 * in, (t1 - t0) * in, input_scale, dst + t0 * in);
    for (int64_t t = t0; t < t1; ++t) {
      const float* row = xs + t * in;
      const float amax = q.amax(row, in);
      token_scale[t] = amax > 0.f ? amax / 127.f : 1.f;
      q.quantize(row, in, token_scale[t], dst + t * in);
    }
  });
}

// dst [T, in] = x_q + offset as bytes (int8_t: offset 0 for the AMX tiles; uint8_t: 128 for VPDPBUSD), over the
// threads. __restrict and the bound in a local: a byte store may alias x_q or a variable the loop reads by
// reference, which had kept it scalar, reloading its bound at every element (a 2,048-token call's conversion
// held 14% of an int8_sq prefill's samples so).
template <typename byte_t>
void xq_to_bytes(const int16_t* xq, int64_t num_tokens, int64_t in, int offset, byte_t* dst) {
  at::parallel_for(0, num_tokens, std::max<int64_t>(1, 65536 / in), [=](int64_t t0, int64_t t1) {
    byte_t* __restrict to = dst + t0 * in;
    const int16_t* __restrict from = xq + t0 * in;
    const int64_t count = (t1 - t0) * in;
    for (int64_t i = 0; i < count; ++i) to[i] = static_cast<byte_t>(from[i] + offset);
  });
}

// y = float(x_q @ q.T) * (token_scale[t] *) row_scale[o] (+ bias): from kMinAmxTokens tokens on AMX-INT8 CPUs
// x_q as bytes packed into B tiles, 32-row blocks of the weight through TDPBSSD, the epilogue vectorized
// with the same roundings (int8_amx_gemm.h); otherwise the int32 sums over the driver's row split
// (quant_linear.h, run_rows): from kMinVnniTokens tokens on AVX512-VNNI CPUs x_q + 128 as bytes through
// VPDPBUSD (int8_vnni_gemm.h), else row tiles of kTileRows through VPMADDWD (int8_kernels.h). All exact.
template <typename scalar_t>
void int8_sq_gemm(const int8_t* w, const kiln::LinearShape& shape, const int16_t* xq, const kiln::Epilogue& epilogue,
                  scalar_t* out) {
  const int64_t num_tokens = shape.num_tokens, in = shape.in, out_features = shape.out_features;
#if defined(__x86_64__)
  if (num_tokens >= kMinAmxTokens && in % 64 == 0 && kiln::cpu_has_amx_int8()) {
    // The calling thread's buffers, handed to the workers as pointers (no zero fill, no page faults per call):
    // x8 [T, in] x_q as bytes
    auto* x8 = reinterpret_cast<int8_t*>(kiln::thread_scratch<3>((num_tokens * in + 3) / 4));
    xq_to_bytes(xq, num_tokens, in, 0, x8);
    // 64 int8 columns are packed as 32 bfloat16 pairs are (int8_amx_gemm.h)
    auto* packed = reinterpret_cast<uint32_t*>(kiln::thread_scratch<4>(kiln::amx_bf16_packed_size(num_tokens, in / 2)));
    kiln::amx_bf16_pack(reinterpret_cast<const uint16_t*>(x8), num_tokens, in / 2, in / 2, packed);
    // the token chunks one after another, each split between the threads, as the bf16 gemm's (gemm.cpp)
    for (int64_t t0 = 0; t0 < num_tokens; t0 += amxbf16::kAmxInt8ChunkTokens) {
      const int64_t chunk = std::min(amxbf16::kAmxInt8ChunkTokens, num_tokens - t0);
      const uint32_t* chunk_x = packed + kiln::amx_bf16_packed_size(t0, in / 2);
      const amxbf16::AmxInt8Epilogue amx_epilogue{
          epilogue.row_scale, epilogue.token_scale != nullptr ? epilogue.token_scale + t0 : nullptr, epilogue.bias,
          out + t0 * out_features, out_features, std::is_same_v<scalar_t, at::BFloat16>};
      kiln::parallel_row_blocks(out_features, amxbf16::kAmxInt8BlockRows, [&](int64_t r0, int64_t r1) {
        auto* tail = reinterpret_cast<int8_t*>(kiln::thread_scratch<2>(amxbf16::kAmxInt8BlockRows * in / 4));
        amxbf16::gemm_amx_int8_rows(w, in, r0, r1, chunk_x, chunk, tail, amx_epilogue);
      });
    }
    return;
  }
#endif
  std::vector<int32_t> acc(static_cast<size_t>(num_tokens * out_features));  // [T, out]
#if defined(__x86_64__)
  if (num_tokens >= kMinVnniTokens && kiln::cpu_has_avx512_vnni()) {
    auto* xu = reinterpret_cast<uint8_t*>(kiln::thread_scratch<3>((num_tokens * in + 3) / 4));  // [T, in] x_q + 128
    xq_to_bytes(xq, num_tokens, in, 128, xu);
    kiln::run_rows(shape, acc.data(), [&](int64_t r0, int64_t r1, int32_t* y) {
      avx512vnni::gemm_vnni_rows(w, in, r0, r1, xu, num_tokens, in, y, out_features);
    }, epilogue, out);
    return;
  }
#endif
  const GemmI32Fn gemm = gemm_i32_fn();
  kiln::run_rows(shape, acc.data(), [&](int64_t r0, int64_t r1, int32_t* y) {
    for (int64_t t0 = r0; t0 < r1; t0 += kTileRows) gemm(w, in, t0, std::min(r1, t0 + kTileRows), xq, num_tokens, in, y, out_features);
  }, epilogue, out);
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
  const Int8Format format{x, w, xs, kiln::LinearShape{num_tokens, in, out_features, /*row_bytes=*/in},
                          kiln::Epilogue{scale, bias_ptr}, kiln::Epilogue{/*row_scale=*/nullptr, bias_ptr}};
  AT_DISPATCH_SWITCH(x.scalar_type(), "kilnlm::int8_linear",
      AT_DISPATCH_CASE(at::kFloat, [&] { kiln::run_quantized_linear(format, format.shape, out.data_ptr<float>()); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        kiln::run_quantized_linear(format, format.shape, out.data_ptr<at::BFloat16>());
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
  // [T, in] int8 values as int16: the calling thread's buffer (a vector's zero fill was 2.4 MB at 2,048 tokens)
  auto* xq = reinterpret_cast<int16_t*>(kiln::thread_scratch<5>((num_tokens * in + 1) / 2));
  const kiln::LinearShape shape{num_tokens, in, out_features, /*row_bytes=*/in};
  const kiln::Epilogue epilogue{row_scale.data(), bias_ptr, ts};
  AT_DISPATCH_SWITCH(x.scalar_type(), "kilnlm::int8_sq_linear",
      AT_DISPATCH_CASE(at::kFloat, [&] {
        quantize_int8<float>(x, pqs_ptr, s_in, xq, ts);
        int8_sq_gemm<float>(weight.data_ptr<int8_t>(), shape, xq, epilogue, out.data_ptr<float>());
      })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        quantize_int8<at::BFloat16>(x, pqs_ptr, s_in, xq, ts);
        int8_sq_gemm<at::BFloat16>(weight.data_ptr<int8_t>(), shape, xq, epilogue, out.data_ptr<at::BFloat16>());
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
