// kilnlm::fp8_linear and kilnlm::fp8_rowwise_linear, CPU kernels (schema and numerics: kilnlm/plugins/schema.py).
//
//   x [T, in] f32/bf16 --quantize (x / s, clamp ±448, RNE to E4M3)--> x_q (held as exact floats)
//   y [T, out] = (x_q @ weight.T) * (s * weight_scale[o]) + bias, accumulated in float32
//   fp8_linear:         s = input_scale, static per tensor (weight_scale 0-dim: one per-tensor scale;
//                       [out]: one per output row, e.g. each part of a fused QKV keeps its own scale)
//   fp8_rowwise_linear: s = s_t = amax_t / 448 per token, computed here (1 for an all-zero row);
//                       weight_scale [out] per output channel
//
// The weight [out, in] float8_e4m3fn is read directly as bytes, never dequantized as a whole:
// - few tokens (generation phase): a fused dequantize-and-multiply GEMV over output rows, each byte read
//   once per call (memory bound: ~1 byte per weight); with AVX512-BF16 and VBMI the bytes become exact
//   bfloat16 in registers through byte tables (Fp8Rows) and meet the (exact bfloat16) quantized
//   activations in VDPBF16PS (bf16_gemv.h), else float32 FMAs (AVX2: weights converted by integer shifts,
//   fp8_kernels.h; scalar);
// - more tokens (context phase): tiles of kTileRows output rows are dequantized into a thread-local
//   buffer and multiplied: as exact bfloat16 on AMX tiles where the CPU has AMX-BF16 (fp8_linear, but for
//   KILNLM_BATCH_INVARIANT=1), else with AVX512-BF16 dot products (fp8_bf16_gemm.h) where the CPU has
//   them, else as float32 with at::mm.
// The token-count dispatch, thread split and tiling are quant_linear.h's (the driver of every weight-only
// quantized linear); this file supplies the FP8 row loaders (Fp8Format).

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
#include "quant_linear.h"
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

using GemvFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, const float*, int64_t, int64_t, float*, int64_t,
                        const float*);
using DequantFn = void (*)(const uint8_t*, int64_t, int64_t, int64_t, float*, const float*);

GemvFn gemv_fn() {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx2_fma_f16c()) return avx2::gemv_rows<false>;
#endif
  return generic::gemv_rows;
}

DequantFn dequant_fn() {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx2_fma_f16c()) return avx2::dequant_rows;
#endif
  return generic::dequant_rows;
}

void check_weight_scale(const char* op, const at::Tensor& weight_scale, const at::Tensor& weight, bool allow_0dim) {
  const bool per_row = weight_scale.dim() == 1 && weight_scale.size(0) == weight.size(0);
  TORCH_CHECK((per_row || (allow_0dim && weight_scale.dim() == 0)) && weight_scale.scalar_type() == at::kFloat &&
                  weight_scale.device().is_cpu(),
              op, ": weight_scale must be a ", allow_0dim ? "0-dim or " : "", "[out_features=", weight.size(0),
              "] float32 CPU tensor, got ", weight_scale.scalar_type(), " ", weight_scale.sizes());
}

using AmaxF32Fn = float (*)(const float*, int64_t);
using AmaxBf16Fn = float (*)(const uint16_t*, int64_t);

// x_q[t, i] = float(fp8_e4m3(clamp(float(x[t, i]) / s, -448, 448))), bit-exact with torch's
// `(x.float() / s).clamp(-448, 448).to(torch.float8_e4m3fn)` (see quantize_e4m3_scalar in fp8_kernels.h).
// s = input_scale, or with token_scale (per-token dynamic scales) s = token_scale[t] = amax_t / 448, written
// by this function, amax_t = max_c |float(x[t, c])| (1 where amax_t is 0 or NaN, as the reference).
template <typename scalar_t>
void quantize_activations(const at::Tensor& x, float input_scale, float* xq, float* token_scale = nullptr) {
  const int64_t num_tokens = x.size(0), in = x.size(1);
  const scalar_t* src = x.data_ptr<scalar_t>();
  const bool vec = kiln::cpu_has_avx2_fma_f16c();
#if defined(__x86_64__)
  const AmaxF32Fn amax_f32 = vec ? avx2::amax_f32 : generic::amax_f32;
  const AmaxBf16Fn amax_bf16 = vec ? avx2::amax_bf16 : generic::amax_bf16;
#else
  const AmaxF32Fn amax_f32 = generic::amax_f32;
  const AmaxBf16Fn amax_bf16 = generic::amax_bf16;
#endif
  // rows [t0, t1) with one scale
  auto quantize = [&](int64_t t0, int64_t t1, float scale) {
    const int64_t n = (t1 - t0) * in;
    if constexpr (std::is_same_v<scalar_t, float>) {
#if defined(__x86_64__)
      if (vec) return avx2::quantize_f32(src + t0 * in, scale, xq + t0 * in, n);
#endif
      generic::quantize_f32(src + t0 * in, scale, xq + t0 * in, n);
    } else {
      const uint16_t* bits = reinterpret_cast<const uint16_t*>(src + t0 * in);
#if defined(__x86_64__)
      if (vec) return avx2::quantize_bf16(bits, scale, xq + t0 * in, n);
#endif
      generic::quantize_bf16(bits, scale, xq + t0 * in, n);
    }
  };
  at::parallel_for(0, num_tokens, std::max<int64_t>(1, 65536 / std::max<int64_t>(in, 1)), [&](int64_t t0, int64_t t1) {
    if (token_scale == nullptr) return quantize(t0, t1, input_scale);
    for (int64_t t = t0; t < t1; ++t) {
      float amax;
      if constexpr (std::is_same_v<scalar_t, float>) amax = amax_f32(src + t * in, in);
      else amax = amax_bf16(reinterpret_cast<const uint16_t*>(src + t * in), in);
      token_scale[t] = amax > 0.f ? amax / 448.f : 1.f;  // NaN compares false: 1
      quantize(t, t + 1, token_scale[t]);
    }
  });
}

// bfloat16 bits of floats holding E4M3 values (exact: such floats have at most 4 significant bits).
void exact_bf16_row(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t bits;
    std::memcpy(&bits, src + i, sizeof(bits));
    dst[i] = static_cast<uint16_t>(bits >> 16);
  }
}

// A bf16 row (n a multiple of 64) in Fp8Rows64's column order, in place: per 64 columns, the 16-column
// lanes' first halves, then their second halves. Two VPERMT2W per 64 columns; needs AVX-512 BW (every
// caller has checked for AVX512-VBMI, which comes with it).
#if defined(__x86_64__)
__attribute__((target("avx512f,avx512bw"))) void pairs64_order(uint16_t* x, int64_t n) {
  alignas(64) static const uint16_t first[32] = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23,
                                                 32, 33, 34, 35, 36, 37, 38, 39, 48, 49, 50, 51, 52, 53, 54, 55};
  alignas(64) static const uint16_t second[32] = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31,
                                                  40, 41, 42, 43, 44, 45, 46, 47, 56, 57, 58, 59, 60, 61, 62, 63};
  const __m512i i0 = _mm512_load_si512(first), i1 = _mm512_load_si512(second);
  for (int64_t c = 0; c < n; c += 64) {
    const __m512i a = _mm512_loadu_si512(x + c), b = _mm512_loadu_si512(x + c + 32);
    _mm512_storeu_si512(x + c, _mm512_permutex2var_epi16(a, i0, b));
    _mm512_storeu_si512(x + c + 32, _mm512_permutex2var_epi16(a, i1, b));
  }
}
#endif

// FP8 E4M3 weight rows for the quantized-linear driver (quant_linear.h): x quantized to E4M3 once (xq,
// exact floats), y = (xq @ q.T) * scale[o] (+ bias[o]).
struct Fp8Format {
  // Up to this many tokens the fused GEMV beats dequantize-then-GEMM (measured on SmolLM2's shapes,
  // scripts/bench_plugins.py): the bf16 GEMM is ~4x the float32 one, so it takes over sooner.
  static constexpr kiln::GemvTokenLimits kGemvTokens{/*with_f32_gemm=*/16, /*int16_with_f32_gemm=*/16,
                                                     /*with_bf16_gemm=*/4, /*with_amx_gemm=*/4};

  const uint8_t* w;  // [out, in] E4M3 bytes
  kiln::LinearShape shape;
  const float* xq;   // [T, in] float32 holding exact E4M3 values
  kiln::Epilogue epilogue;           // * (token_scale[t] *) scale[o] (+ bias)
  kiln::Epilogue f32_tile_epilogue;  // the same: the tiles hold q exactly
  bool amx_context_tiles;            // amx_context(), decided once per call (fp8_amx_context)

  // E4M3 values are exact bfloat16, whatever x's dtype.
  bool bf16_context_gemm() const { return kiln::cpu_has_avx512_bf16(); }

  // FP8 has no int16 GEMV: its GEMVs read x as E4M3 values (xq).
  bool int16_generation() const { return false; }

  // Fused dequantize-and-multiply GEMV, each weight byte read once per call -- with AVX512-BF16 + VBMI
  // (and in_features a multiple of 32) through bf16_gemv.h, else through the AVX2 / scalar float32 GEMV.
  template <typename scalar_t>
  void generation(scalar_t* out) const {
    const int64_t num_tokens = shape.num_tokens, in = shape.in, out_features = shape.out_features;
#if defined(__x86_64__)
    if (kiln::cpu_has_avx512_bf16_vbmi() && in % avx512vbmi::Fp8Rows::kCols == 0) {
      std::vector<uint16_t> xb(static_cast<size_t>(num_tokens * in));
      const bool order64 = gemv_order64();
      for (int64_t t = 0; t < num_tokens; ++t) bf16_x_row(xq + t * in, xb.data() + t * in, order64);
      kiln::parallel_row_blocks(out_features, avx512vbmi::kGemvBlockRows, [&](int64_t r0, int64_t r1) {
        avx512vbmi::gemv_fp8_rows(xb.data(), num_tokens, w, out_features, in, epilogue.row_scale, epilogue.token_scale,
                                  epilogue.bias, out, std::is_same_v<scalar_t, at::BFloat16>, r0, r1);
      });
      return;
    }
#endif
    const float* lut = fp8_lut().value;
    GemvFn gemv = gemv_fn();
    const float* x = xq;
#if defined(__x86_64__)
    std::vector<float> x_prepared;  // the AVX2 GEMV's activations: x_q * 2^kXScaleLog2 (exact), in its block order
    if (gemv == avx2::gemv_rows<false>) {
      x_prepared.resize(static_cast<size_t>(num_tokens * in));
      avx2::prepare_x(xq, num_tokens, in, x_prepared.data());
      x = x_prepared.data();
      if (kiln::batch_invariant_requested()) gemv = avx2::gemv_rows<true>;
    }
#endif
    kiln::run_gemv(shape, [&](int64_t r0, int64_t r1, float* acc) {
      gemv(w, in, r0, r1, x, num_tokens, in, acc, out_features, lut);
    }, epilogue, out);
  }

  const float* prepare_context_x() const { return xq; }

  void tile_f32(int64_t r0, int64_t r1, float* tile) const { dequant_fn()(w, shape.in, r0, r1, tile, fp8_lut().value); }

  // Where the GEMV reads 64 columns at a time in Fp8Rows64's interleaved order, the context phase's
  // VDPBF16PS tiles take the same order, for x and the weights alike: then every output is summed by
  // VDPBF16PS over the same pairs into the same lanes and reduced by the same tree (reduce16) at every token
  // count, so a row's result does not depend on how many rows the call has (batch invariance: the GEMV
  // serves up to kGemvTokens.with_bf16_gemm tokens, the tiles the rest). A permutation of the columns on
  // both sides leaves the dot products' terms unchanged. AMX tiles sum in their own order whatever the
  // columns' (amx_context).
  bool gemv_order64() const {
#if defined(__x86_64__)
    return kiln::cpu_has_avx512_bf16_vbmi() && shape.in % avx512vbmi::Fp8Rows64::kCols == 0;
#else
    return false;
#endif
  }

  bool tiles_in_gemv_order() const { return gemv_order64() && !kiln::amx_tiles(*this); }

  bool context_sums_like_gemv() const { return bf16_context_gemm() && tiles_in_gemv_order(); }

  bool amx_context() const { return amx_context_tiles; }

  // One row of x_q as exact bfloat16 bits into dst [in], in Fp8Rows64's column order where gemv_order: the
  // GEMV's rows always in its own order, the tiles' in it only where they must sum as the GEMV does.
  void bf16_x_row(const float* x, uint16_t* dst, bool gemv_order) const {
    exact_bf16_row(x, shape.in, dst);
#if defined(__x86_64__)
    if (gemv_order) pairs64_order(dst, shape.in);
#endif
  }

  void x_row_bf16(const float* x, uint16_t* dst, int64_t /*k_pad: zero-filled*/) const {
    bf16_x_row(x, dst, tiles_in_gemv_order());
  }

  void tile_bf16(int64_t r0, int64_t r1, uint16_t* dst, int64_t k_pad) const {
#if defined(__x86_64__)
    avx2::dequant_rows_bf16(w, shape.in, r0, r1, dst, k_pad, fp8_lut().value);  // padding columns stay 0
    if (tiles_in_gemv_order())
      for (int64_t r = 0; r < r1 - r0; ++r) pairs64_order(dst + r * k_pad, shape.in);
#endif
  }

  void bf16_gemm(const uint16_t* xb, int64_t tokens_pad, const uint16_t* wb, int64_t rows_pad, int64_t k_pad, float* acc,
                 int64_t acc_stride) const {
#if defined(__x86_64__)
    avx512bf16::bf16_gemm_nt(xb, tokens_pad, wb, rows_pad, k_pad, acc, acc_stride);
#endif
  }
};

// Whether a call's context tiles may run on AMX (where the CPU has it): fp8_linear's do, as int8_linear's and
// int4_linear's, giving up its batch invariance there (the AMX tiles and the GEMV sum each row in different
// orders) but for KILNLM_BATCH_INVARIANT=1, which keeps the VDPBF16PS tiles. On an Intel Xeon with AMX
// (family 6 model 207, 2 vCPUs) the VDPBF16PS tiles held the fp8 engine's 128-token TTFT at 418 ms against
// bf16's 77 (docs/performance.md). fp8_rowwise_linear's per-token scales stay on the VDPBF16PS tiles: the AMX
// epilogue scales rows, not tokens.
bool fp8_amx_context(bool per_token) { return !per_token && !kiln::batch_invariant_requested(); }

// The body of both ops, inputs checked: scale[o] the per-row factor (input_scale * weight_scale[o], or
// weight_scale[o] alone with per_token, where the epilogue multiplies it by each token's scale first).
at::Tensor run_fp8_linear(const at::Tensor& x_in, const at::Tensor& weight, std::vector<float> scale,
                          float input_scale, bool per_token, const std::optional<at::Tensor>& bias_in) {
  const at::Tensor x = x_in.contiguous();
  const int64_t num_tokens = x.size(0), in = x.size(1), out_features = weight.size(0);
  at::Tensor out = at::empty({num_tokens, out_features}, x.options());
  if (num_tokens == 0 || out_features == 0) return out;
  at::Tensor bias;
  if (bias_in.has_value()) bias = bias_in->to(at::kFloat).contiguous();
  const float* bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const uint8_t* w = reinterpret_cast<const uint8_t*>(weight.data_ptr());

  std::vector<float> xq_buf(static_cast<size_t>(num_tokens * in));  // x_q: [T, in] float32 holding exact E4M3 values
  std::vector<float> token_scale(per_token ? static_cast<size_t>(num_tokens) : 0);  // [T]
  float* ts = per_token ? token_scale.data() : nullptr;
  const kiln::Epilogue epilogue{scale.data(), bias_ptr, ts};
  const Fp8Format format{w, kiln::LinearShape{num_tokens, in, out_features, /*row_bytes=*/in}, xq_buf.data(), epilogue,
                         epilogue, fp8_amx_context(per_token)};
  auto run = [&](auto* out_ptr) {  // float or at::BFloat16 (x's dtype, checked)
    using scalar_t = std::remove_pointer_t<decltype(out_ptr)>;
    quantize_activations<scalar_t>(x, input_scale, xq_buf.data(), ts);
    kiln::run_quantized_linear(format, format.shape, out_ptr);
  };
  if (x.scalar_type() == at::kFloat) run(out.data_ptr<float>());
  else run(out.data_ptr<at::BFloat16>());
  return out;
}

// weight_scale's values, one per output row (a 0-dim scale repeated).
std::vector<float> row_scales(const at::Tensor& weight_scale, int64_t out_features) {
  const at::Tensor w_scale = weight_scale.contiguous();
  const float* ws = w_scale.data_ptr<float>();  // once: data_ptr<T>() checks the dtype on every call
  if (weight_scale.dim() == 0) return std::vector<float>(static_cast<size_t>(out_features), ws[0]);
  return std::vector<float>(ws, ws + out_features);
}

}  // namespace

at::Tensor fp8_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                          const at::Tensor& input_scale, const std::optional<at::Tensor>& bias) {
  const char* op = "kilnlm::fp8_linear";
  kiln::check_linear_inputs(op, x, weight, at::kFloat8_e4m3fn, "float8_e4m3fn", bias);
  TORCH_CHECK(input_scale.dim() == 0 && input_scale.scalar_type() == at::kFloat && input_scale.device().is_cpu(), op,
              ": input_scale must be a 0-dim float32 CPU tensor, got ", input_scale.scalar_type(), " ",
              input_scale.sizes());
  check_weight_scale(op, weight_scale, weight, /*allow_0dim=*/true);
  const float s_in = *input_scale.data_ptr<float>();  // checked 0-dim float32 CPU; item() dispatches (~1 us)
  // scale[o] = input_scale * weight_scale[o], one float32 product per output row as the reference.
  std::vector<float> scale = row_scales(weight_scale, weight.size(0));
  for (float& s : scale) s = s_in * s;
  return run_fp8_linear(x, weight, std::move(scale), s_in, /*per_token=*/false, bias);
}

at::Tensor fp8_rowwise_linear_cpu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                                  const std::optional<at::Tensor>& bias) {
  const char* op = "kilnlm::fp8_rowwise_linear";
  kiln::check_linear_inputs(op, x, weight, at::kFloat8_e4m3fn, "float8_e4m3fn", bias);
  check_weight_scale(op, weight_scale, weight, /*allow_0dim=*/false);
  return run_fp8_linear(x, weight, row_scales(weight_scale, weight.size(0)), /*input_scale=*/1.f,
                        /*per_token=*/true, bias);
}

}  // namespace kiln_fp8

TORCH_LIBRARY_IMPL(kilnlm, CPU, m) {
  m.impl("fp8_linear", &kiln_fp8::fp8_linear_cpu);
  m.impl("fp8_rowwise_linear", &kiln_fp8::fp8_rowwise_linear_cpu);
}

KILN_C_SHIM aoti_torch_cpu_fp8_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle weight_scale,
                                      AtenTensorHandle input_scale, AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  using namespace kiln_shim;
  return call(ret0, [&] {
    return kiln_fp8::fp8_linear_cpu(tensor(x), tensor(weight), tensor(weight_scale), tensor(input_scale),
                                    optional_tensor(bias));
  });
}

KILN_C_SHIM aoti_torch_cpu_fp8_rowwise_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle weight_scale,
                                              AtenTensorHandle* bias, AtenTensorHandle* ret0) {
  using namespace kiln_shim;
  return call(ret0, [&] {
    return kiln_fp8::fp8_rowwise_linear_cpu(tensor(x), tensor(weight), tensor(weight_scale), optional_tensor(bias));
  });
}
