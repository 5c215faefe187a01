// kilnlm::int4_linear, CPU kernel (W4A16: int4_awq, int4_wo; schema and numerics: kilnlm/plugins/schema.py).
//
//   x [T, in] f32/bf16 --(* pre_quant_scale, float32)--> xs [T, in] float32
//   y [T, out] = xs @ ((q - zero[:, g]) * weight_scale[:, g]).T + bias, g = c / group_size, accumulated in
//   float32, x's dtype (zero: weight_zero_point, or 0; weight_scale float32 or float16)
//
// The packed weight [out, in / 2] uint8 is read directly, never dequantized as a whole:
// - few tokens (generation phase): a fused unpack-and-multiply GEMV over output rows, each weight byte read
//   once per call (memory bound at half a byte per weight): bfloat16 x with AVX512-BF16 through
//   int4_bf16_gemv.h (nibbles made bfloat16 integers in registers, VDPBF16PS, the group scale applied to
//   each group's float32 partial sums); bfloat16 x on AVX2 as block floating point int16 (per token and
//   group, 15 significant bits) through VPMADDWD (int4_kernels.h, gemv_int16_rows); otherwise float32 FMAs
//   (int4_kernels.h);
// - more tokens (context phase): tiles of kTileRows output rows are dequantized into a thread-local buffer
//   and multiplied with all T rows: float32 x -> float32 tiles (exactly the reference's q * scale) through
//   at::mm; bfloat16 x on CPUs with AVX512-BF16 -> bfloat16 tiles (q * scale rounded once to bfloat16, as
//   a bf16 checkpoint's weights are) through VDPBF16PS (fp8_bf16_gemm.h), float32 accumulation; on CPUs
//   with AMX-BF16, where in and group_size are multiples of 64, the same bfloat16 values a 32-row block's
//   k chunk at a time into L1, right before the AMX tiles multiply them (Int4Format::amx_source).
// The token-count dispatch, thread split and tiling are quant_linear.h's (the driver of every weight-only
// quantized linear); this file supplies the int4 row loaders (Int4Format).
//
// float16 weight scales (what the builder stores: a decode step streams the scales with the weights, and
// float32 ones were 11% of an int4 layer's bytes at group size 64) are read natively by AVX2's int16 GEMV;
// for every other path they are widened to float32 kScaleBlockRows rows at a time into a per-thread buffer
// just before those rows are multiplied (for_row_spans), so that the kernels read float32 as before.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"
#include "c_shim.h"
#include "cpu_features.h"
#include "int16_activations.h"
#include "quant_linear.h"
#include "row_blocks.h"

namespace kiln_int4 {

// Weight rows as the int16 GEMV (int4_kernels.h, gemv_int16_rows) reads them. Scale: float, or uint16_t
// float16 bits (read natively).
template <typename Scale>
struct Int4Weight {
  const uint8_t* w;      // [out, in / 2] packed int4
  const Scale* scales;   // [out, num_groups]
  const int8_t* zeros;   // [out, num_groups] zero points, or null
  int64_t in, group_size;
};

// Block floating point int16 activations of num_tokens tokens (int16_quantize.h, nibble_chunks order).
struct Int16Tokens {
  const int16_t* x16;    // [T, in], rows `stride` apart
  int64_t stride;
  const float* x_scale;  // [T, num_groups] 2^e
  const float* x_sum;    // [T, num_groups] 2^e * sum of the group's x16
  int64_t num_tokens;
};

#define KILN_ISA_KERNELS "int4_kernels.h"
#include "isa_variants.h"
#undef KILN_ISA_KERNELS

namespace {

// AVX2's int16 GEMV also serves bfloat16 x on AVX512-BF16 CPUs up to this many tokens (see generation()).
constexpr int64_t kMaxInt16TokensBf16Gemm = 3;

using GemvFn = void (*)(const uint8_t*, int64_t, const float*, const int8_t*, int64_t, int64_t, int64_t, const float*,
                        int64_t, int64_t, float*, int64_t);
using DequantFn = void (*)(const uint8_t*, int64_t, const float*, const int8_t*, int64_t, int64_t, int64_t, float*);

enum class Isa { kGeneric, kAvx2, kAvx512 };

// The vector paths need whole bytes per group (an even group_size); any other falls back to scalar.
Isa pick_isa(int64_t group_size) {
#if defined(__x86_64__)
  if (group_size % 2 == 0) {
    if (kiln::cpu_has_avx512()) return Isa::kAvx512;
    if (kiln::cpu_has_avx2_fma_f16c()) return Isa::kAvx2;
  }
#endif
  return Isa::kGeneric;
}

GemvFn gemv_fn(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return avx512::gemv_rows;
  if (isa == Isa::kAvx2) return avx2::gemv_rows;
#endif
  return generic::gemv_rows;
}

DequantFn dequant_fn(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return avx512::dequant_rows;
  if (isa == Isa::kAvx2) return avx2::dequant_rows;
#endif
  return generic::dequant_rows;
}

void check_inputs(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& weight_scale,
                  const std::optional<at::Tensor>& pre_quant_scale, const std::optional<at::Tensor>& bias,
                  int64_t group_size, const std::optional<at::Tensor>& zero_point) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu() && weight_scale.device().is_cpu(),
              "kilnlm::int4_linear (CPU kernel): x, weight and weight_scale must be CPU tensors");
  TORCH_CHECK(x.dim() == 2, "kilnlm::int4_linear: x must be [num_tokens, in_features], got ", x.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "kilnlm::int4_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kByte,
              "kilnlm::int4_linear: weight must be a 2-D uint8 tensor [out_features, in_features // 2] of packed "
              "int4 pairs (kilnlm.plugins.pack_int4), got ", weight.scalar_type(), " ", weight.sizes());
  TORCH_CHECK(weight.is_contiguous(), "kilnlm::int4_linear: weight must be contiguous (call .contiguous() when building)");
  const int64_t in = x.size(1), out_features = weight.size(0);
  TORCH_CHECK(in % 2 == 0, "kilnlm::int4_linear: in_features must be even (two int4 values per byte), got ", in);
  TORCH_CHECK(weight.size(1) * 2 == in, "kilnlm::int4_linear: x has ", in, " features but the packed weight holds ",
              weight.size(1) * 2, " (", weight.size(1), " bytes per row)");
  TORCH_CHECK(group_size > 0 && in % group_size == 0, "kilnlm::int4_linear: group_size ", group_size,
              " must be positive and divide in_features ", in, " (use a divisor, or group_size == in_features for "
              "per-channel scales)");
  TORCH_CHECK((weight_scale.scalar_type() == at::kFloat || weight_scale.scalar_type() == at::kHalf) &&
                  weight_scale.dim() == 2 && weight_scale.size(0) == out_features &&
                  weight_scale.size(1) == in / group_size,
              "kilnlm::int4_linear: weight_scale must be float32 or float16 [out_features=", out_features,
              ", in_features / group_size=", in / group_size, "], got ", weight_scale.scalar_type(), " ",
              weight_scale.sizes());
  if (pre_quant_scale.has_value()) {
    TORCH_CHECK(pre_quant_scale->dim() == 1 && pre_quant_scale->size(0) == in && pre_quant_scale->device().is_cpu(),
                "kilnlm::int4_linear: pre_quant_scale must be [in_features=", in, "], got ", pre_quant_scale->sizes());
  }
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features && bias->device().is_cpu(),
                "kilnlm::int4_linear: bias must be [out_features=", out_features, "], got ", bias->sizes());
  }
  if (zero_point.has_value()) {
    TORCH_CHECK(zero_point->scalar_type() == at::kChar && zero_point->dim() == 2 && zero_point->device().is_cpu() &&
                    zero_point->size(0) == out_features && zero_point->size(1) == in / group_size,
                "kilnlm::int4_linear: weight_zero_point must be int8 [out_features=", out_features,
                ", in_features / group_size=", in / group_size, "], got ", zero_point->scalar_type(), " ",
                zero_point->sizes());
  }
}

// The column order a kernel reads x in (int4_kernels.h): at::mm and the scalar path natural, the AVX-512
// GEMV and AVX2's general one block-permuted, AVX2's shuffle-free one (gemv_chunk_rows) in chunk order.
enum class XOrder { kNatural, kBlocks32, kChunks64 };

// xs [T, in] float32 = x * pre_quant_scale, in `order`. Few tokens (the generation phase) run on the
// calling thread, and natural order needs no buffer of its own.
template <typename scalar_t>
void prepare_activations(const at::Tensor& x, const float* pqs, int64_t group_size, XOrder order, float* xs) {
  const int64_t num_tokens = x.size(0), in = x.size(1);
  const bool permute = order != XOrder::kNatural;
  const int64_t num_blocks = order == XOrder::kBlocks32 ? group_size / 32 : 0;
  const scalar_t* src = x.data_ptr<scalar_t>();
  at::parallel_for(0, num_tokens, std::max<int64_t>(1, 65536 / std::max<int64_t>(in, 1)), [&](int64_t t0, int64_t t1) {
    std::vector<float> row(static_cast<size_t>(permute ? in : 0));
    for (int64_t t = t0; t < t1; ++t) {
      float* scaled = permute ? row.data() : xs + t * in;
      for (int64_t c = 0; c < in; ++c) {
        const float v = static_cast<float>(src[t * in + c]);
        scaled[c] = pqs != nullptr ? v * pqs[c] : v;
      }
      if (!permute) continue;
      float* dst = xs + t * in;
      if (order == XOrder::kChunks64) {
        for (int64_t c0 = 0; c0 < in; c0 += 64)
          for (int64_t k = 0; k < 8; ++k)
            for (int64_t i = 0; i < 8; ++i) dst[c0 + 8 * k + i] = row[c0 + 8 * i + k];
        continue;
      }
      for (int64_t c0 = 0; c0 < in; c0 += group_size) {
        for (int64_t b = 0; b < num_blocks; ++b) {
          const int64_t c = c0 + 32 * b;
          for (int64_t i = 0; i < 16; ++i) {
            dst[c + i] = row[c + 2 * i];
            dst[c + 16 + i] = row[c + 2 * i + 1];
          }
        }
        for (int64_t c = c0 + 32 * num_blocks; c < c0 + group_size; ++c) dst[c] = row[c];
      }
    }
  });
}

// The bf16 GEMV's per-call buffers (int4_bf16_gemv.h), kept per thread and only ever grown.
// Sizes: a row of x in the kernel's order holds num_loads * kInt4LoadCols bf16 values, and num_lanes =
// num_loads * kInt4LoadLanes lane sums.
struct Int4GemvScratch {
  std::vector<float> xs;             // [num_tokens, in] x * pre_quant_scale
  std::vector<uint16_t> xb;          // [num_tokens, xb_row]
  std::vector<float> neg_sums;       // [num_tokens, num_lanes]
  std::vector<float> neg_group_sums; // [num_tokens, num_groups]
  std::vector<int64_t> first_group;  // the plan's arrays: [num_loads]
  std::vector<int32_t> lane_group;   // [num_lanes]
  std::vector<uint16_t> group_mask;  // [num_loads]
  void resize(int64_t num_tokens, int64_t in, int64_t num_groups, int64_t num_loads, int64_t xb_row, int64_t num_lanes) {
    const auto grow = [](auto& v, int64_t n) { if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n)); };
    grow(xs, num_tokens * in);
    grow(xb, num_tokens * xb_row);
    grow(neg_sums, num_tokens * num_lanes);
    grow(neg_group_sums, num_tokens * num_groups);
    grow(first_group, num_loads);
    grow(lane_group, num_lanes);
    grow(group_mask, num_loads);
  }
};

struct Problem {
  const uint8_t* w;           // [out, in / 2] packed int4
  const float* scales;        // [out, in / group_size] float32, or nullptr for float16 scales:
  const uint16_t* scales_f16; // [out, in / group_size] float16 bits (exactly one of the two is set)
  const int8_t* zeros;        // [out, in / group_size] zero points, or nullptr
  int64_t in, out_features, group_size, num_tokens;
  const float* xs;            // [T, in] float32, pre_quant_scale applied
  const float* bias;          // [out] or nullptr
};

// Whether none of v[0, n) is an inf or NaN.
bool all_finite(const float* v, int64_t n) {
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) finite &= std::isfinite(v[i]);
  return finite;
}

constexpr int64_t kScaleBlockRows = 128;  // a multiple of the bf16 GEMV's kGemvBlockRows (16)

void widen_half(const uint16_t* src, int64_t n, float* dst) {
#if defined(__x86_64__)
  if (kiln::cpu_has_avx2_fma_f16c()) return avx2::widen_half(src, n, dst);
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::detail::fp16_ieee_to_fp32_value(src[i]);
}

// Rows [b0, b1) of the weight, rebased for a kernel that takes them as its rows [0, b1 - b0): their packed
// int4, float32 scales and zero points (or nullptr).
struct RowSpan {
  int64_t b0, b1;
  const uint8_t* w;
  const float* scales;
  const int8_t* zeros;
};

// fn(span) over rows [r0, r1): one span with float32 scales; with float16 scales, spans of kScaleBlockRows
// rows whose scales are widened into a per-thread buffer (L1 / L2-resident) just before fn reads them.
template <class F>
void for_row_spans(const Problem& p, int64_t r0, int64_t r1, const F& fn) {
  const int64_t num_groups = p.in / p.group_size, row_bytes = p.in / 2;
  const auto span = [&](int64_t b0, int64_t b1, const float* scales) {
    fn(RowSpan{b0, b1, p.w + b0 * row_bytes, scales, p.zeros != nullptr ? p.zeros + b0 * num_groups : nullptr});
  };
  if (p.scales != nullptr) return span(r0, r1, p.scales + r0 * num_groups);
  float* scales = kiln::thread_scratch<2>(std::min(kScaleBlockRows, r1 - r0) * num_groups);
  for (int64_t b0 = r0; b0 < r1; b0 += kScaleBlockRows) {
    const int64_t b1 = std::min(r1, b0 + kScaleBlockRows);
    widen_half(p.scales_f16 + b0 * num_groups, (b1 - b0) * num_groups, scales);
    span(b0, b1, scales);
  }
}

// Rows [r0, r1) (at most kTileRows) dequantized into tile [r1 - r0, in].
void dequant_tile(const Problem& p, DequantFn dequant, int64_t r0, int64_t r1, float* tile) {
  for_row_spans(p, r0, r1, [&](const RowSpan& s) {
    dequant(s.w, p.in, s.scales, s.zeros, p.group_size, 0, s.b1 - s.b0, tile + (s.b0 - r0) * p.in);
  });
}

// Packed int4 weight rows (group-wise scales, optional zero points) for the quantized-linear driver
// (quant_linear.h): xs = x * pre_quant_scale in float32, y = xs @ ((q - zero) * scale).T (+ bias).
struct Int4Format {
  // Up to this many tokens the fused GEMV beats dequantize-then-GEMM (scripts/bench_plugins.py, SmolLM2's
  // shapes). The bf16 GEMM is ~3x the float32 one, so it takes over sooner (its fixed cost, converting the
  // weight to bf16 tiles, is paid back from ~9 tokens); on AMX from 4 (an Intel Xeon, 3072x576 cache-hot:
  // the GEMV 88 / 106 us at 3 / 4 tokens, the tiles ~91 at any count up to 16). The int16 GEMV against the
  // float32 tiles (an AMD EPYC Zen 3, 2 threads, SmolLM2's 30 layers cold, with zero points): the tiles take
  // 1.31x its time at 17 tokens, 1.07x at 24, 0.98x at 32, 0.82x at 64.
  static constexpr kiln::GemvTokenLimits kGemvTokens{/*with_f32_gemm=*/16, /*int16_with_f32_gemm=*/24,
                                                     /*with_bf16_gemm=*/8, /*with_amx_gemm=*/3};

  const at::Tensor& x;  // [T, in] float32 / bfloat16, contiguous
  const float* pqs;     // [in] pre_quant_scale or null
  float* xs;            // [T, in] float32 x * pre_quant_scale, in the order of the kernel that reads it
  Problem problem;      // the weight (problem.xs == xs)
  bool half_scales;     // weight_scale is float16
  kiln::LinearShape shape;
  kiln::Epilogue epilogue;           // + bias (the scales are inside the sums)
  kiln::Epilogue f32_tile_epilogue;  // the same

  bool x_bf16() const { return x.scalar_type() == at::kBFloat16; }

  bool bf16_context_gemm() const { return x_bf16() && kiln::cpu_has_avx512_bf16(); }

  // The tiles round x to bfloat16 (or sum through at::mm) where the GEMV does not.
  bool context_sums_like_gemv() const { return false; }

#if defined(__x86_64__)
  // AVX2's int16 GEMV can take this call's shapes on this CPU (bfloat16 x).
  bool int16_gemv_applies() const {
    return kiln::cpu_has_avx2_fma_f16c() && avx2::int16_kernel_applies(shape.in, problem.group_size);
  }
#endif

  // generation() takes AVX2's int16 GEMV (but for an x holding inf / NaN, see run_int16_gemv).
  bool int16_generation() const {
#if defined(__x86_64__)
    return x_bf16() && pick_isa(problem.group_size) == Isa::kAvx2 && int16_gemv_applies();
#else
    return false;
#endif
  }

  // The bf16 context tiles run on AMX where the CPU has it (quant_linear.h).
  bool amx_context() const { return true; }

  // xs in `order`.
  void prepare_xs(XOrder order) const {
    if (x_bf16()) prepare_activations<at::BFloat16>(x, pqs, problem.group_size, order, xs);
    else prepare_activations<float>(x, pqs, problem.group_size, order, xs);
  }

  // Fused unpack-and-multiply GEMV, each weight byte read once per call: bfloat16 x through AVX2's int16
  // GEMV or the AVX512-BF16 one (int4_bf16_gemv.h) where they apply, else the float32 GEMV of the CPU's ISA
  // (AVX2's shuffle-free chunk kernel where it applies).
  template <typename scalar_t>
  void generation(scalar_t* out) const {
    const int64_t num_tokens = shape.num_tokens, in = shape.in, out_features = shape.out_features;
    const int64_t group_size = problem.group_size;
    const Isa isa = pick_isa(group_size);
    XOrder order = isa != Isa::kGeneric ? XOrder::kBlocks32 : XOrder::kNatural;
    GemvFn gemv = gemv_fn(isa);
#if defined(__x86_64__)
    if (isa == Isa::kAvx2 && avx2::chunk_kernel_applies(in, group_size)) {
      order = XOrder::kChunks64;
      gemv = avx2::gemv_chunk_rows;
    }
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      const bool bf16_gemv = bf16_context_gemm() && group_size % 32 == 0;  // int4_bf16_gemv.h, its own buffers
      // AVX2's int16 GEMV (block floating point x, VPMADDWD; VPDPWSSD in its AVX512-VNNI copy) also on
      // AVX512-BF16 CPUs for up to kMaxInt16TokensBf16Gemm tokens: there the bf16 GEMV below is bound by
      // its instructions (an Intel Xeon, VPMADDWD, 30 cold SmolLM2 gate_up + down pairs: 49 against 66 us
      // per pair at one token, 86 against 92 at two, 176 against 165 at four; an AMD Zen 4, the VNNI copy,
      // SmolLM2's 30 int4 layers cold: 4.9 ms at three tokens against the bf16 GEMV's 5.3-5.8 at four).
      // With KILNLM_BATCH_INVARIANT (cpu_features.h) the bf16 GEMV serves every token count alone: one
      // GEMV, one order. Of the two it costs the context phase less (SmolLM2 on an AMD Zen 4: a 512-token
      // prompt 1.6-1.8x the tiles' time against 3.1x with the int16 GEMV, batch-1 decode 1.07-1.18x
      // against 1.0x; docs/reliability.md).
      const bool int16_here = num_tokens <= kMaxInt16TokensBf16Gemm && !kiln::batch_invariant_requested();
      if ((isa == Isa::kAvx2 || (bf16_gemv && int16_here)) && int16_gemv_applies() && run_int16_gemv(out)) return;
      if (bf16_gemv && run_bf16_gemv(out)) return;
    }
#endif
    prepare_xs(order);
    kiln::run_gemv(shape, [&](int64_t r0, int64_t r1, float* acc) {
      for_row_spans(problem, r0, r1, [&](const RowSpan& s) {
        gemv(s.w, in, s.scales, s.zeros, group_size, 0, s.b1 - s.b0, xs, num_tokens, in, acc + s.b0,
             out_features);
      });
    }, epilogue, out);
  }

#if defined(__x86_64__)
  // AVX2's int16 GEMV (its AVX512-VNNI copy where the CPU has it); returns false, having written nothing, for
  // an x holding inf / NaN.
  bool run_int16_gemv(at::BFloat16* out) const {
    const int64_t num_tokens = shape.num_tokens, in = shape.in, out_features = shape.out_features;
    const int64_t group_size = problem.group_size;
    thread_local kiln::Int16Activations xq;
    xq.resize(num_tokens, in, in / group_size);
    if (!avx2::int16_quantize(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), pqs, num_tokens, in,
                              group_size, /*nibble_chunks=*/true, xq.row.data(), xq.x16.data(), xq.x_scale.data(),
                              xq.x_sum.data()))
      return false;
    const bool vnni = kiln::cpu_has_avx512_vnni();  // the same int32 sums, VPDPWSSD for VPMADDWD + add
    const int16_t* x16 = xq.x16.data();
    if (vnni && avx512vnni::int16_pairs_chunks(group_size)) {  // its 512-bit loop's order, 64-byte aligned
      auto* paired = reinterpret_cast<int16_t*>(kiln::thread_scratch<4>(num_tokens * in / 2));
      avx512vnni::int16_pair_chunks(x16, num_tokens, in, in, paired);
      x16 = paired;
    }
    // the pointers, not xq: a worker thread naming xq would get its own (empty) thread_local
    const Int16Tokens tokens{x16, in, xq.x_scale.data(), xq.x_sum.data(), num_tokens};
    kiln::run_gemv(shape, [&](int64_t r0, int64_t r1, float* acc) {
      float* group_scale = kiln::thread_scratch<3>(4 * (in / group_size));  // this thread's
      const auto gemv = [&](const auto* scales) {  // float32 or float16 bits, read as they are
        const Int4Weight<std::remove_cv_t<std::remove_pointer_t<decltype(scales)>>> weight{
            problem.w, scales, problem.zeros, in, group_size};
        if (vnni) avx512vnni::gemv_int16_rows(weight, r0, r1, tokens, group_scale, acc, out_features);
        else avx2::gemv_int16_rows(weight, r0, r1, tokens, group_scale, acc, out_features);
      };
      if (half_scales) gemv(problem.scales_f16);
      else gemv(problem.scales);
    }, epilogue, out);
    return true;
  }

  // The AVX512-BF16 GEMV (int4_bf16_gemv.h); returns false, having written nothing, for an x the kernel
  // cannot take (see below).
  bool run_bf16_gemv(at::BFloat16* out) const {
    const int64_t num_tokens = shape.num_tokens, in = shape.in, out_features = shape.out_features;
    const int64_t group_size = problem.group_size;
    // Per-thread buffers, reused: a decode step makes ~120 calls of a few microseconds each.
    thread_local Int4GemvScratch scratch;
    const int64_t num_loads = avx512bf16::int4_gemv_num_loads(in);
    const int64_t xb_row = num_loads * avx512bf16::kInt4LoadCols, sums_row = num_loads * avx512bf16::kInt4LoadLanes;
    const int64_t num_groups = in / group_size;
    scratch.resize(num_tokens, in, num_groups, num_loads, xb_row, sums_row);
    avx512bf16::Int4GemvPlan plan{in, num_loads, scratch.first_group.data(), scratch.lane_group.data(),
                                  scratch.group_mask.data(), 0};
    avx512bf16::int4_gemv_plan(group_size, plan);
    // x * pre_quant_scale in float32, then rounded to bf16 once, in the kernel's order, with its lane sums
    prepare_activations<at::BFloat16>(x, pqs, group_size, XOrder::kNatural, scratch.xs.data());
    for (int64_t t = 0; t < num_tokens; ++t)
      avx512bf16::int4_gemv_prepare_x(scratch.xs.data() + t * in, plan, scratch.xb.data() + t * xb_row,
                                     scratch.neg_sums.data() + t * sums_row);
    // An inf or NaN in x makes its lane sums non-finite. The kernel's offsets, (136 + q) x - 136 x, would
    // turn an inf into NaN, so such calls go to the float32 kernel, which propagates them as the reference
    // does.
    if (!all_finite(scratch.neg_sums.data(), num_tokens * sums_row)) return false;
    for (int64_t t = 0; t < num_tokens; ++t)
      avx512bf16::int4_gemv_group_sums(plan, scratch.neg_sums.data() + t * sums_row, num_groups,
                                       scratch.neg_group_sums.data() + t * num_groups);
    auto* yb = reinterpret_cast<uint16_t*>(out);
    // the pointers, not scratch: a worker thread naming scratch would get its own (empty) thread_local
    const uint16_t* xb = scratch.xb.data();
    const float* neg_group_sums = scratch.neg_group_sums.data();
    kiln::parallel_row_blocks(out_features, avx512bf16::kGemvBlockRows, [&](int64_t r0, int64_t r1) {
      for_row_spans(problem, r0, r1, [&](const RowSpan& s) {
        // rows from s.b0 on; num_rows bounds the prefetches, which may run past the span
        const avx512bf16::Int4GemvArgs args{s.w, s.scales, s.zeros, in / 2, num_groups, out_features - s.b0,
                                            &plan, xb, neg_group_sums};
        avx512bf16::gemv_int4_rows(args, num_tokens, problem.bias != nullptr ? problem.bias + s.b0 : nullptr,
                                   yb + s.b0, out_features, 0, s.b1 - s.b0);
      });
    });
    return true;
  }
#endif

  const float* prepare_context_x() const {
    prepare_xs(XOrder::kNatural);
    return xs;
  }

  // float32 tiles: exactly the reference's q * scale.
  void tile_f32(int64_t r0, int64_t r1, float* tile) const {
    dequant_tile(problem, dequant_fn(pick_isa(problem.group_size)), r0, r1, tile);
  }

  // bfloat16: x * pre_quant_scale and the tiles' q * scale each rounded to bfloat16 once (as a bf16
  // checkpoint's weights are); both in chunk64 order where it applies (int4_kernels.h: the tiles come
  // straight from the packed nibbles), else in natural order.
#if defined(__x86_64__)
  bool chunk64() const { return avx512bf16::chunk64_applies(shape.in, problem.group_size); }
#endif

  void x_row_bf16(const float* xs_row, uint16_t* dst, int64_t k_pad) const {
#if defined(__x86_64__)
    if (chunk64()) return avx512bf16::to_bf16_chunk64(xs_row, shape.in, dst);  // k_pad == in
    avx512bf16::to_bf16_padded(xs_row, shape.in, dst, k_pad);
#endif
  }

  void tile_bf16(int64_t r0, int64_t r1, uint16_t* dst, int64_t k_pad) const {
#if defined(__x86_64__)
    if (chunk64()) {  // k_pad == in
      for_row_spans(problem, r0, r1, [&](const RowSpan& s) {
        avx512bf16::dequant_rows_bf16(s.w, shape.in, s.scales, s.zeros, problem.group_size, 0, s.b1 - s.b0,
                                      dst + (s.b0 - r0) * k_pad);
      });
      return;
    }
    float* tile = kiln::thread_scratch<4>(kiln::kTileRows * shape.in);  // [kTileRows, in] float32, this thread's
    tile_f32(r0, r1, tile);
    for (int64_t r = 0; r < r1 - r0; ++r) avx512bf16::to_bf16_padded(tile + r * shape.in, shape.in, dst + r * k_pad, k_pad);
#endif
  }

  // The AMX tiles' weight, dequantized a block's k chunk at a time into L1 (amx_bf16.h), where the tiles are
  // in chunk64 order; none otherwise (the driver then dequantizes whole tiles through tile_bf16).
  std::optional<kiln::AmxWeightSource> amx_source() const {
#if defined(__x86_64__)
    if (chunk64()) return kiln::AmxWeightSource{&fill_amx_steps, this};
#endif
    return std::nullopt;
  }

#if defined(__x86_64__)
  static void fill_amx_steps(const void* self, int64_t r, int64_t rows, int64_t i0, int64_t i1, uint16_t* dst) {
    const Problem& p = static_cast<const Int4Format*>(self)->problem;
    const int64_t num_groups = p.in / p.group_size, row_bytes = p.in / 2, steps = p.in / 32;
    // The next block's packed rows (contiguous) into L2, a share per chunk, in memory order: a block's rows
    // are read 32 bytes apiece, 32 rows at a time, which the hardware prefetchers do not follow (SmolLM2's
    // 30 cold layers at 16 tokens: ~10-30% of the time).
    if (r + 2 * rows <= p.out_features) {
      const char* next = reinterpret_cast<const char*>(p.w + (r + rows) * row_bytes);
      const int64_t bytes = rows * row_bytes;
      for (int64_t b = bytes * i0 / steps / 64 * 64; b < bytes * i1 / steps; b += 64)
        _mm_prefetch(next + b, _MM_HINT_T1);
    }
    const float* scales = p.scales != nullptr ? p.scales + r * num_groups : nullptr;
    if (scales == nullptr) {  // float16: the block's scales widened by its first chunk, on this thread
      float* widened = kiln::thread_scratch<11>(32 * num_groups);
      if (i0 == 0) widen_half(p.scales_f16 + r * num_groups, rows * num_groups, widened);
      scales = widened;
    }
    avx512bf16::dequant_amx_steps(p.w + r * row_bytes, row_bytes, scales,
                                  p.zeros != nullptr ? p.zeros + r * num_groups : nullptr, num_groups, p.group_size,
                                  rows, 32 * i0, 32 * i1, dst);
  }
#endif

  void bf16_gemm(const uint16_t* xb, int64_t tokens_pad, const uint16_t* wb, int64_t rows_pad, int64_t k_pad, float* acc,
                 int64_t acc_stride) const {
#if defined(__x86_64__)
    avx512bf16::bf16_gemm_nt(xb, tokens_pad, wb, rows_pad, k_pad, acc, acc_stride);
#endif
  }
};

}  // namespace

at::Tensor int4_linear_cpu(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& weight_scale_in,
                           const std::optional<at::Tensor>& pre_quant_scale_in, const std::optional<at::Tensor>& bias_in,
                           int64_t group_size, const std::optional<at::Tensor>& zero_point_in) {
  check_inputs(x_in, weight, weight_scale_in, pre_quant_scale_in, bias_in, group_size, zero_point_in);
  const at::Tensor x = x_in.contiguous();
  const int64_t num_tokens = x.size(0), in = x.size(1), out_features = weight.size(0);
  at::Tensor out = at::empty({num_tokens, out_features}, x.options());
  if (num_tokens == 0 || out_features == 0) return out;

  const at::Tensor weight_scale = weight_scale_in.contiguous();
  // float32 contiguous as given without a dispatch (a decode step makes ~120 of these calls)
  const auto as_float = [](const at::Tensor& t) {
    return t.scalar_type() == at::kFloat ? t.contiguous() : t.to(at::kFloat).contiguous();
  };
  at::Tensor bias, pqs, zero_point;
  if (bias_in.has_value()) bias = as_float(*bias_in);
  if (zero_point_in.has_value()) zero_point = zero_point_in->contiguous();
  if (pre_quant_scale_in.has_value()) pqs = as_float(*pre_quant_scale_in);

  float* xs = kiln::thread_scratch<1>(num_tokens * in);  // [T, in] x * pre_quant_scale
  const bool half_scales = weight_scale.scalar_type() == at::kHalf;
  const float* bias_ptr = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const Problem problem{reinterpret_cast<const uint8_t*>(weight.data_ptr()),
                        half_scales ? nullptr : weight_scale.data_ptr<float>(),
                        half_scales ? reinterpret_cast<const uint16_t*>(weight_scale.data_ptr<at::Half>()) : nullptr,
                        zero_point.defined() ? zero_point.data_ptr<int8_t>() : nullptr, in, out_features, group_size,
                        num_tokens, xs, bias_ptr};
  const kiln::Epilogue epilogue{/*row_scale=*/nullptr, bias_ptr};
  const Int4Format format{x, pqs.defined() ? pqs.data_ptr<float>() : nullptr, xs, problem, half_scales,
                          kiln::LinearShape{num_tokens, in, out_features, /*row_bytes=*/in / 2}, epilogue, epilogue};
  AT_DISPATCH_SWITCH(x.scalar_type(), "kilnlm::int4_linear",
      AT_DISPATCH_CASE(at::kFloat, [&] { kiln::run_quantized_linear(format, format.shape, out.data_ptr<float>()); })
      AT_DISPATCH_CASE(at::kBFloat16, [&] {
        kiln::run_quantized_linear(format, format.shape, out.data_ptr<at::BFloat16>());
      }));
  return out;
}

}  // namespace kiln_int4

TORCH_LIBRARY_IMPL(kilnlm, CPU, m) { m.impl("int4_linear", &kiln_int4::int4_linear_cpu); }

KILN_C_SHIM aoti_torch_cpu_int4_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle weight_scale,
                                       AtenTensorHandle* pre_quant_scale, AtenTensorHandle* bias, int64_t group_size,
                                       AtenTensorHandle* weight_zero_point, AtenTensorHandle* ret0) {
  using namespace kiln_shim;
  return call(ret0, [&] {
    return kiln_int4::int4_linear_cpu(tensor(x), tensor(weight), tensor(weight_scale), optional_tensor(pre_quant_scale),
                                      optional_tensor(bias), group_size, optional_tensor(weight_zero_point));
  });
}
