// kilnlm::paged_attention, CPU kernel (schema and semantics: kilnlm/plugins/schema.py).
//
// One call serves a packed batch of context chunks and generation tokens:
//   1. RoPE (rotate-half, as Hugging Face Llama) on q and k, q pre-multiplied by the softmax scale;
//      the rotated k and v are written into kv_cache[layer_idx] at slot_mapping, in place;
//   2. attention of each sequence's new query tokens over its KV blocks, read through its block table,
//      causal by KV position, GQA (query head h reads KV head h / (num_heads / num_kv_heads)).
// Step 2 is split into work items (sequence, KV head or single query head, chunk of query tokens) that
// threads take dynamically, largest first; each item runs the online-softmax kernel of
// attention_kernels.h. Few items that the threads cannot share evenly are split along their KV blocks
// and the parts' softmax states merged afterwards (split-KV); on AMX, decode items that read the same
// leading blocks (a shared prefix) take those blocks together first (cascade attention, share_prefixes).
// Activations in float32 or bfloat16,
// computed in float32 (on AMX tiles or with AVX512-BF16's VDPBF16PS, a bf16 engine's q and probabilities
// are rounded to bfloat16 for their products; the sums are float32).
//
// KV pool: the activation dtype, or 8 bits (float8_e4m3fn / int8) with the layer's per-tensor scales
// kv_scale = [k_scale, v_scale]: written as quantize(x / scale) (FP8: saturate at +-448, round to nearest
// even; int8: round half to even, clamp to [-128, 127]), read as stored * scale. The read never multiplies
// per element: scores use q * k_scale against the stored K, and the output is scaled by v_scale once
// (softmax weights are linear in V), so the 8-bit kernels differ from the 16-bit ones only in their loads.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "bf16_bits.h"
#include "c_shim.h"
#include "cpu_features.h"
#include "row_blocks.h"

namespace kiln_attn {

// The pool's element type as the kernels read it (see kv_f32 in attention_kernels.h).
enum class KvType { kFloat32, kBFloat16, kFp8E4M3, kInt8 };

// One unit of attention work (see attend() in attention_kernels.h). Pointers are raw and typed by the
// pool dtype at run time so that the ISA-specific kernels stay free of torch types.
struct AttnWork {
  const float* q;           // first query vector: q_rot[tok_begin, head_begin], float32, pre-scaled
  int64_t q_tok_stride;     // floats between consecutive tokens' query vectors (num_heads * head_dim)
  void* out;                // out[tok_begin, head_begin], the activation dtype
  bool out_bf16;            // out holds bfloat16 (else float32)
  int64_t out_tok_stride;   // num_heads * head_dim
  const void* k_base;       // kv_cache[layer, 0], pool dtype
  const void* v_base;       // kv_cache[layer, 1]
  int64_t kv_row_stride;    // elements between consecutive pool rows (num_kv_heads * head_dim)
  KvType kv_type;
  float out_scale;          // the output's factor: 1 for 16/32-bit pools, the folded v_scale for 8-bit pools
  const int32_t* block_table;  // this sequence's row of block_tables
  int64_t tokens_per_block;
  int64_t head_dim;
  int64_t head_begin;       // query heads [head_begin, head_end); head h reads KV head h / group
  int64_t head_end;
  int64_t group;            // num_heads / num_kv_heads
  int64_t num_q_tokens;
  int64_t first_q_pos;      // KV position of the first query token
  int64_t kv_block_begin;   // the sequence's KV blocks [kv_block_begin, kv_block_end) this item reads: all
  int64_t kv_block_end;     //   of them, or one part's range when the sequence's KV is split (make_work)
  float* partial;           // a split part's [M] max, [M] sum, [M, head_dim] unnormalized output (merged by
                            //   merge_parts), or null: the item writes its normalized output to `out`
  const float* init_m;      // the softmax state of the item's M query vectors after the KV blocks before
  const float* init_l;      //   kv_block_begin (from its part's first), computed for it and other items that
  const float* init_acc;    //   read the same blocks (cascade attention, share_prefixes): [M] max, [M] sum,
                            //   [M, head_dim] output; all null: the item starts empty at kv_block_begin
  int64_t cost;             // scheduling estimate: query vectors x KV positions read
  uint64_t call_id;         // this call's number in the process: what a thread's cached KV blocks are valid for
};

// Writes the item's output vector for query token qi, head h (of the item's heads): out = acc[0:head_dim] *
// scale in the output's dtype (bfloat16 rounded to nearest even). Used by every ISA's attend() and by
// merge_parts.
inline void store_output(const AttnWork& w, int64_t qi, int64_t h, const float* acc, float scale) {
  const int64_t D = w.head_dim, offset = qi * w.out_tok_stride + h * D;
  if (w.out_bf16) {
    uint16_t* dst = static_cast<uint16_t*>(w.out) + offset;
    for (int64_t d = 0; d < D; ++d) dst[d] = kiln::bf16_bits(acc[d] * scale);
  } else {
    float* dst = static_cast<float*>(w.out) + offset;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[d] * scale;
  }
}

// One unit of cascade attention's shared part (share_prefixes): the query vectors of one KV head, from the
// tokens of several items whose KV ranges start with the same blocks of the pool, through those blocks
// together. Run before the items, which go on from the states it leaves (AttnWork::init_m).
struct SharedUnit {
  AttnWork work;               // the unit as one item: the items' heads, num_q_tokens = the unit's tokens, the
                               //   shared KV blocks [kv_block_begin, kv_block_end) of the first item's table,
                               //   first_q_pos past them
  const float* const* q_rows;  // [work.num_q_tokens] each token's query row (its item's q at that token)
  int64_t kv_head;
  float* m;                    // the group's state at the unit's first token: [tokens * heads] max, sum and
  float* l;                    //   [tokens * heads, head_dim] output, vector (token, item-relative head) at
  float* acc;                  //   token * heads + head
};

#define KILN_ISA_KERNELS "attention_kernels.h"
#include "isa_variants.h"
#undef KILN_ISA_KERNELS

namespace {

using AttendFn = void (*)(const AttnWork&, float*);

// The kernel variant for an item: the widest the CPU has, for every item. With AMX-BF16 a bf16 pool with
// bf16 activations and blocks of a multiple of 32 tokens runs on AMX tiles (every other pool takes that
// copy's AVX-512 code): context chunks 2.1x and batch-32 decode 1.2x the AVX-512 kernel on a 2-core Xeon
// (bench_plugins.py --only attention). AVX-512 pays off for items with
// several query vectors: a context-phase item (+10-25% measured), and a generation-phase item over one KV
// head's GQA group (3 query heads for SmolLM2: 1.4-1.7x the AVX2 variant single-threaded at 128-2048 KV
// positions); an item of a single query vector runs as fast on either (scripts/bench_plugins.py). With
// AVX512-BF16 and no AMX (AMD Zen 4), bf16 activations over a bf16 or 8-bit pool take VDPBF16PS
// (attention_kernels.h; KILNLM_CPU_ISA=avx512 keeps them on the float32 AVX-512 code). One variant for all
// keeps every query vector's arithmetic the same whatever item holds it (batch invariance: the variants
// sum in different orders).
AttendFn attend_fn() {
#if defined(__x86_64__)
  if (kiln::cpu_has_amx_bf16()) return amxbf16::attend;
  if (kiln::cpu_has_avx512_bf16() && !kiln::cpu_isa_capped_at("avx512")) return avx512bf16::attend;
  if (kiln::cpu_has_avx512()) return avx512::attend;
  if (kiln::cpu_has_avx2_fma_f16c()) return avx2::attend;
#endif
  return generic::attend;
}

constexpr int64_t kQueryChunkTokens = 16;  // query tokens per work item in the context phase

using SharedFn = void (*)(const SharedUnit&, float*);

// The kernel for cascade attention's shared part (share_prefixes), or null where the CPU has no AMX-BF16:
// the AMX path alone takes its query vectors 16 to a tile, whoever's they are.
SharedFn attend_shared_fn() {
#if defined(__x86_64__)
  if (kiln::cpu_has_amx_bf16()) return amxbf16::attend_shared;
#endif
  return nullptr;
}

struct Dims {
  int64_t num_tokens, num_heads, num_kv_heads, head_dim, num_seqs, max_blocks_per_seq;
  int64_t num_layers, num_blocks, tokens_per_block;
};

// The packed batch's metadata (kilnlm.runtime.abi), raw pointers into contiguous CPU tensors; T tokens of B
// sequences, sequence b's new tokens at [cu_seqlens_q[b], cu_seqlens_q[b + 1]).
struct BatchView {
  const int64_t* positions;     // [T] each token's position in its sequence
  const int32_t* cu_seqlens_q;  // [B + 1]
  const int32_t* seq_lens_kv;   // [B] cached + new tokens after this step
  const int32_t* block_tables;  // [B, max_blocks_per_seq]
  const int64_t* slot_mapping;  // [T] slot = block_id * tokens_per_block + offset
};

// One layer's KV pool and its scales. An 8-bit pool is written as quantize(x / k_scale | v_scale) and read
// with the scales folded in: into the rotated queries (q_scale) and the outputs (out_scale).
struct PoolView {
  void* k;           // kv_cache[layer, 0]: [num_blocks, tokens_per_block, num_kv_heads, head_dim], pool dtype
  void* v;           // kv_cache[layer, 1]
  KvType kv_type;
  float k_scale;     // 8-bit pools' per-tensor scales; 1 for a pool in the activation dtype
  float v_scale;
  float q_scale;     // multiplies the rotated queries: the softmax scale (times the folded k_scale)
  float out_scale;   // multiplies the outputs: 1, or the folded v_scale
};

void check_tensor(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), "kilnlm::paged_attention (CPU kernel): ", name, " must be a CPU tensor, got ",
              t.device());
  TORCH_CHECK(t.scalar_type() == dtype, "kilnlm::paged_attention: ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.dim() == dim, "kilnlm::paged_attention: ", name, " must have ", dim, " dims, got shape ", t.sizes());
}

Dims check_shapes(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& kv_cache,
                  int64_t layer_idx, const at::Tensor& positions, const at::Tensor& inv_freq,
                  const at::Tensor& cu_seqlens_q, const at::Tensor& seq_lens_kv, const at::Tensor& block_tables,
                  const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& kv_scale) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16,
              "kilnlm::paged_attention: q must be float32 or bfloat16, got ", dtype);
  check_tensor(q, "q [T, num_heads, head_dim]", dtype, 3);
  check_tensor(k, "k [T, num_kv_heads, head_dim] (same dtype as q)", dtype, 3);
  check_tensor(v, "v [T, num_kv_heads, head_dim] (same dtype as q)", dtype, 3);
  if (kv_scale.has_value()) {
    const auto kv_dtype = kv_cache.scalar_type();
    TORCH_CHECK(kv_dtype == at::kFloat8_e4m3fn || kv_dtype == at::kChar, "kilnlm::paged_attention: kv_scale is "
                "given, so kv_cache must be an 8-bit pool (float8_e4m3fn or int8), got ", kv_dtype,
                " (pass kv_scale=None for a pool in q's dtype)");
    check_tensor(kv_cache, "kv_cache [num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]", kv_dtype, 6);
    check_tensor(*kv_scale, "kv_scale [2] (k_scale, v_scale)", at::kFloat, 1);
    TORCH_CHECK(kv_scale->size(0) == 2, "kilnlm::paged_attention: kv_scale must be [2] (k_scale, v_scale), got shape ",
                kv_scale->sizes());
  } else {
    check_tensor(kv_cache, "kv_cache [num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim] (same dtype "
                 "as q; an 8-bit pool needs kv_scale)", dtype, 6);
  }
  check_tensor(positions, "positions [T]", at::kLong, 1);
  check_tensor(inv_freq, "inv_freq [head_dim / 2]", at::kFloat, 1);
  check_tensor(cu_seqlens_q, "cu_seqlens_q [B + 1]", at::kInt, 1);
  check_tensor(seq_lens_kv, "seq_lens_kv [B]", at::kInt, 1);
  check_tensor(block_tables, "block_tables [B, max_blocks_per_seq]", at::kInt, 2);
  check_tensor(slot_mapping, "slot_mapping [T]", at::kLong, 1);

  Dims d{};
  d.num_tokens = q.size(0);
  d.num_heads = q.size(1);
  d.head_dim = q.size(2);
  d.num_kv_heads = k.size(1);
  d.num_seqs = seq_lens_kv.size(0);
  d.max_blocks_per_seq = block_tables.size(1);
  d.num_layers = kv_cache.size(0);
  d.num_blocks = kv_cache.size(2);
  d.tokens_per_block = kv_cache.size(3);
  TORCH_CHECK(k.sizes() == v.sizes(), "kilnlm::paged_attention: k and v shapes differ: ", k.sizes(), " vs ", v.sizes());
  TORCH_CHECK(k.size(0) == d.num_tokens && k.size(2) == d.head_dim,
              "kilnlm::paged_attention: k must be [T=", d.num_tokens, ", num_kv_heads, head_dim=", d.head_dim, "], got ",
              k.sizes());
  TORCH_CHECK(d.num_kv_heads > 0 && d.num_heads % d.num_kv_heads == 0, "kilnlm::paged_attention: num_heads (",
              d.num_heads, ") must be a multiple of num_kv_heads (", d.num_kv_heads, ")");
  TORCH_CHECK(d.head_dim % 2 == 0, "kilnlm::paged_attention: head_dim must be even for RoPE, got ", d.head_dim);
  TORCH_CHECK(kv_cache.size(1) == 2 && kv_cache.size(4) == d.num_kv_heads && kv_cache.size(5) == d.head_dim,
              "kilnlm::paged_attention: kv_cache must be [num_layers, 2, num_blocks, tokens_per_block, num_kv_heads=",
              d.num_kv_heads, ", head_dim=", d.head_dim, "], got ", kv_cache.sizes());
  TORCH_CHECK(kv_cache.is_contiguous(), "kilnlm::paged_attention: kv_cache must be contiguous (allocate the pool with "
              "torch.empty / torch.zeros, not as a view)");
  TORCH_CHECK(layer_idx >= 0 && layer_idx < d.num_layers, "kilnlm::paged_attention: layer_idx ", layer_idx,
              " is out of range for a kv_cache of ", d.num_layers, " layers");
  TORCH_CHECK(positions.size(0) == d.num_tokens && slot_mapping.size(0) == d.num_tokens,
              "kilnlm::paged_attention: positions and slot_mapping must have T=", d.num_tokens, " entries, got ",
              positions.size(0), " and ", slot_mapping.size(0));
  TORCH_CHECK(inv_freq.size(0) == d.head_dim / 2, "kilnlm::paged_attention: inv_freq must have head_dim / 2 = ",
              d.head_dim / 2, " entries, got ", inv_freq.size(0));
  TORCH_CHECK(cu_seqlens_q.size(0) == d.num_seqs + 1 && block_tables.size(0) == d.num_seqs,
              "kilnlm::paged_attention: with B=", d.num_seqs, " sequences (seq_lens_kv), cu_seqlens_q must have B+1 "
              "entries and block_tables B rows, got ", cu_seqlens_q.size(0), " and ", block_tables.size(0));
  return d;
}

// Value checks (bounds of every index the kernel will follow), O(T + B * max_blocks_per_seq).
void check_indices(const Dims& d, const BatchView& batch) {
  const int32_t *cu = batch.cu_seqlens_q, *kv_lens = batch.seq_lens_kv, *tables = batch.block_tables;
  const int64_t *slots = batch.slot_mapping, *positions = batch.positions;
  TORCH_CHECK(cu[0] == 0 && cu[d.num_seqs] == d.num_tokens, "kilnlm::paged_attention: cu_seqlens_q must start at 0 "
              "and end at T=", d.num_tokens, ", got ", cu[0], " .. ", cu[d.num_seqs]);
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t num_new = cu[b + 1] - cu[b];
    TORCH_CHECK(num_new >= 0, "kilnlm::paged_attention: cu_seqlens_q must be non-decreasing (sequence ", b, ")");
    TORCH_CHECK(kv_lens[b] >= num_new, "kilnlm::paged_attention: sequence ", b, " has ", num_new,
                " new tokens but seq_lens_kv = ", kv_lens[b], " (seq_lens_kv counts cached + new tokens)");
    const int64_t blocks_needed = (static_cast<int64_t>(kv_lens[b]) + d.tokens_per_block - 1) / d.tokens_per_block;
    TORCH_CHECK(num_new == 0 || blocks_needed <= d.max_blocks_per_seq, "kilnlm::paged_attention: sequence ", b,
                " needs ", blocks_needed, " KV blocks but block_tables has ", d.max_blocks_per_seq, " columns");
    if (num_new == 0) continue;
    for (int64_t j = 0; j < blocks_needed; ++j) {
      const int64_t blk = tables[b * d.max_blocks_per_seq + j];
      TORCH_CHECK(blk >= 0 && blk < d.num_blocks, "kilnlm::paged_attention: block_tables[", b, ", ", j, "] = ", blk,
                  " is out of range for a pool of ", d.num_blocks, " blocks");
    }
  }
  const int64_t num_slots = d.num_blocks * d.tokens_per_block;
  for (int64_t t = 0; t < d.num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "kilnlm::paged_attention: slot_mapping[", t, "] = ", slots[t],
                " is out of range for a pool of ", d.num_blocks, " blocks x ", d.tokens_per_block, " tokens");
    TORCH_CHECK(positions[t] >= 0, "kilnlm::paged_attention: positions[", t, "] = ", positions[t], " is negative");
  }
}

// One KV element as stored in a cache_t pool; `scale` is the 8-bit pools' per-tensor scale (unused for
// a pool in the activation dtype). Matches torch: `(x / scale).clamp(-448, 448).to(float8_e4m3fn)` and
// `(x / scale).round().clamp(-128, 127).to(int8)` (std::nearbyint: round half to even by default).
template <typename cache_t>
inline cache_t to_cache(float x, float scale);
template <>
inline float to_cache<float>(float x, float) { return x; }
template <>
inline at::BFloat16 to_cache<at::BFloat16>(float x, float) { return static_cast<at::BFloat16>(x); }
template <>
inline at::Float8_e4m3fn to_cache<at::Float8_e4m3fn>(float x, float scale) {
  const float v = x / scale;
  return at::Float8_e4m3fn(v < -448.0f ? -448.0f : (v > 448.0f ? 448.0f : v));
}
template <>
inline int8_t to_cache<int8_t>(float x, float scale) {
  const float v = std::nearbyint(x / scale);
  return static_cast<int8_t>(v < -128.0f ? -128.0f : (v > 127.0f ? 127.0f : v));
}

// cos(pos * inv_freq[j]) then sin(...), j < half, for one position: the calling thread's last table is
// kept with its position and inv_freq, so the 30 layers of a decode step compute their token's 64 cos / sin
// once instead of 30 times (~1 us a layer). Same values as computing them afresh.
class RopeTable {
 public:
  const float* get(int64_t pos, const float* inv_freq, int64_t half) {
    const bool hit = pos == pos_ && static_cast<int64_t>(inv_freq_.size()) == half &&
                     std::equal(inv_freq_.begin(), inv_freq_.end(), inv_freq);
    if (!hit) {
      inv_freq_.assign(inv_freq, inv_freq + half);
      cos_sin_.resize(static_cast<size_t>(2 * half));
      const float p = static_cast<float>(pos);
      for (int64_t j = 0; j < half; ++j) {
        const float angle = p * inv_freq[j];
        cos_sin_[j] = std::cos(angle);
        cos_sin_[half + j] = std::sin(angle);
      }
      pos_ = pos;
    }
    return cos_sin_.data();
  }

 private:
  int64_t pos_ = -1;
  std::vector<float> inv_freq_, cos_sin_;
};

// Step 1: RoPE on q (into q_rot [T, num_heads, head_dim], float32, times pool.q_scale) and k; write
// rotated k and v into the pool at slot_mapping (8-bit pools: quantized with k_scale / v_scale).
template <typename scalar_t, typename cache_t>
void rope_and_write_kv(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const PoolView& pool, const BatchView& batch, const float* inv_freq, float* q_rot) {
  const int64_t H = d.num_heads, Hkv = d.num_kv_heads, D = d.head_dim, half = D / 2;
  cache_t* k_pool = static_cast<cache_t*>(pool.k);
  cache_t* v_pool = static_cast<cache_t*>(pool.v);
  const int64_t *positions = batch.positions, *slots = batch.slot_mapping;
  const float scale = pool.q_scale, k_scale = pool.k_scale, v_scale = pool.v_scale;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  const int64_t q_stride = q.stride(0), k_stride = k.stride(0), v_stride = v.stride(0);
  at::parallel_for(0, d.num_tokens, 16, [&](int64_t t0, int64_t t1) {
    thread_local RopeTable rope;
    for (int64_t t = t0; t < t1; ++t) {
      const float* cos_v = rope.get(positions[t], inv_freq, half);
      const float* sin_v = cos_v + half;
      // out[j] = x[j] cos - x[j + half] sin ; out[j + half] = x[j + half] cos + x[j] sin
      for (int64_t h = 0; h < H; ++h) {
        const scalar_t* src = qp + t * q_stride + h * D;
        float* dst = q_rot + (t * H + h) * D;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = static_cast<float>(src[j]), x2 = static_cast<float>(src[j + half]);
          dst[j] = (x1 * cos_v[j] + (-x2) * sin_v[j]) * scale;
          dst[j + half] = (x2 * cos_v[j] + x1 * sin_v[j]) * scale;
        }
      }
      cache_t* k_dst = k_pool + slots[t] * Hkv * D;
      cache_t* v_dst = v_pool + slots[t] * Hkv * D;
      for (int64_t h = 0; h < Hkv; ++h) {
        const scalar_t* src = kp + t * k_stride + h * D;
        for (int64_t j = 0; j < half; ++j) {
          const float x1 = static_cast<float>(src[j]), x2 = static_cast<float>(src[j + half]);
          k_dst[h * D + j] = to_cache<cache_t>(x1 * cos_v[j] + (-x2) * sin_v[j], k_scale);
          k_dst[h * D + j + half] = to_cache<cache_t>(x2 * cos_v[j] + x1 * sin_v[j], k_scale);
        }
        const scalar_t* vsrc = vp + t * v_stride + h * D;
        if constexpr (std::is_same_v<cache_t, scalar_t>) {
          for (int64_t j = 0; j < D; ++j) v_dst[h * D + j] = vsrc[j];
        } else {
          for (int64_t j = 0; j < D; ++j) v_dst[h * D + j] = to_cache<cache_t>(static_cast<float>(vsrc[j]), v_scale);
        }
      }
    }
  });
}

// Split-KV parts of one item (flash-decoding): num_parts consecutive [M] max, [M] sum, [M, D] output
// states in `states`, merged into the item's output by merge_parts once every part has run.
struct SplitItem {
  AttnWork item;        // the whole item (its output pointer, heads, tokens, out_scale)
  const float* states;  // [num_parts, M * (D + 2)]
  int64_t num_parts;
};

struct SplitParts {
  std::vector<float> states;
  std::vector<SplitItem> items;
  void clear() {
    states.clear();
    items.clear();
  }
};

// Split-KV (as flash-decoding, Dao et al. 2023) at fixed KV positions: an item whose KV reaches past
// kPartTokens positions is cut into parts of kPartTokens positions (rounded up to whole blocks), each part
// an item of its own whose softmax state merge_parts combines, in part order, afterwards. Where the cuts
// fall depends on nothing but the block size, never on the batch or the thread count, so a query vector's
// result is the same whatever else the call computes (batch invariance, as in Thinking Machines' "Defeating
// Nondeterminism in LLM Inference", 2025): a sequence decoded alone and in a batch of 32 gives the same
// bits. The parts also keep two threads busy on a batch-1 decode step (SmolLM2's 3 KV-head items become 6
// at 512 KV positions), which is why the split exists. An item of one part runs whole: merging a single
// part (weight e^0 = 1) would give the same bits.
constexpr int64_t kPartTokens = 256;

void split_kv(const Dims& d, std::vector<AttnWork>& work, SplitParts& parts) {
  const int64_t part_blocks = std::max<int64_t>(1, (kPartTokens + d.tokens_per_block - 1) / d.tokens_per_block);
  const auto num_parts_of = [&](const AttnWork& w) { return (w.kv_block_end + part_blocks - 1) / part_blocks; };
  const auto state_size = [&](const AttnWork& w) { return w.num_q_tokens * (w.head_end - w.head_begin) * (d.head_dim + 2); };
  int64_t state_floats = 0, num_split = 0, num_items = 0;
  for (const AttnWork& w : work) {
    const int64_t num_parts = num_parts_of(w);
    num_items += num_parts;
    if (num_parts < 2) continue;
    state_floats += num_parts * state_size(w);
    ++num_split;
  }
  if (num_split == 0) return;
  parts.states.resize(static_cast<size_t>(state_floats));
  parts.items.reserve(static_cast<size_t>(num_split));
  thread_local std::vector<AttnWork> split;  // swapped with work below: the two buffers are reused in turn
  split.clear();
  split.reserve(static_cast<size_t>(num_items));
  float* state = parts.states.data();
  for (const AttnWork& w : work) {
    const int64_t num_parts = num_parts_of(w);
    if (num_parts < 2) {
      split.push_back(w);
      continue;
    }
    parts.items.push_back(SplitItem{w, state, num_parts});
    const int64_t num_blocks = w.kv_block_end, size = state_size(w);
    for (int64_t p = 0; p < num_parts; ++p, state += size) {
      AttnWork part = w;
      part.kv_block_begin = p * part_blocks;
      part.kv_block_end = std::min(num_blocks, (p + 1) * part_blocks);
      part.partial = state;
      part.cost = w.cost * (part.kv_block_end - part.kv_block_begin) / num_blocks;
      split.push_back(part);
    }
  }
  work.swap(split);
}

// out = out_scale * sum_p e^(m_p - m) acc_p / sum_p e^(m_p - m) l_p with m = max_p m_p, per query vector.
// Part 0 holds KV position 0, which every query sees, so m is finite; a part none of whose positions a
// query sees (a context chunk's early tokens) has m_p = -inf and weighs 0.
// Items are merged in parallel only when there is enough to merge (a long context chunk's parts): a decode
// step's merge is a few microseconds, less than waking the other threads.
constexpr int64_t kMinParallelMergeFloats = 1 << 16;

void merge_parts(const SplitParts& parts, int64_t head_dim) {
  const int64_t D = head_dim, num_items = static_cast<int64_t>(parts.items.size());
  if (num_items == 0) return;
  const int64_t grain = std::max<int64_t>(1, kMinParallelMergeFloats * num_items / static_cast<int64_t>(parts.states.size()));
  at::parallel_for(0, num_items, grain, [&](int64_t item0, int64_t item1) {
    thread_local std::vector<float> out;
    out.resize(static_cast<size_t>(D));
    for (int64_t item = item0; item < item1; ++item) {
      const SplitItem& s = parts.items[static_cast<size_t>(item)];
      const AttnWork& w = s.item;
      const int64_t num_heads_item = w.head_end - w.head_begin, M = w.num_q_tokens * num_heads_item;
      const int64_t size = M * (D + 2);
      for (int64_t qi = 0; qi < w.num_q_tokens; ++qi) {
        for (int64_t h = 0; h < num_heads_item; ++h) {
          const int64_t i = qi * num_heads_item + h;
          float m = -INFINITY;
          for (int64_t p = 0; p < s.num_parts; ++p) m = std::max(m, s.states[p * size + i]);
          std::fill(out.begin(), out.end(), 0.f);
          float l = 0.f;
          for (int64_t p = 0; p < s.num_parts; ++p) {
            const float* state = s.states + p * size;
            if (state[i] == -INFINITY) continue;
            const float weight = std::exp(state[i] - m);
            l += weight * state[M + i];
            const float* acc = state + 2 * M + i * D;
            for (int64_t e = 0; e < D; ++e) out[e] += weight * acc[e];
          }
          store_output(w, qi, h, out.data(), w.out_scale / l);
        }
      }
    }
  });
}

// Cascade attention (vLLM's name; FlashInfer's cascade inference, Ye et al. 2024; Hydragen, Juravsky et al.
// 2024) for the AMX path over a bfloat16 pool: items of fewer query vectors per KV head than an AMX tile
// holds (decode tokens, speculative verification) whose KV ranges start at the same pool block (a prompt
// prefix the prefix cache shares), every query of them past the blocks they share, take those blocks
// together in SharedUnits of up to kSharedUnitVectors query vectors of one KV head, 16 to a tile, where each
// item alone fills 3 of 16 (a SmolLM2 decode token). Each item then goes on from its vectors' states at the
// first block not shared. A vector's numbers come from its own row or lane of the tiles, in the same order
// either way (attention_kernels.h, amx_attend_block), so its result is the same bits with or without the
// sharing: batch invariance holds. Groups: the items of one first block (of their range: a split part's
// too) and head range, at least kMinSharedVectors vectors per KV head together; the blocks they share run
// from there as far as all of their tables agree and all of their queries see every key. Context chunks
// (a tile or more of their own) are not grouped: for them the extra pass cost more than it saved (on an
// Intel Xeon with AMX, a 256-token chunk after 256 cached 1.44 -> 1.71 ms, 8 new 256-token prompts 4.2 -> 5.2).
constexpr int64_t kSharedUnitVectors = 64;
constexpr int64_t kMinSharedVectors = 16;

struct SharedPrefixes {
  std::vector<float> states;          // each group's [M] max, [M] sum, [M, head_dim] output
  std::vector<const float*> q_rows;   // each group's tokens' query rows
  std::vector<SharedUnit> units;
  void clear() {
    states.clear();
    q_rows.clear();
    units.clear();
  }
};

void share_prefixes(const Dims& d, std::vector<AttnWork>& work, SharedPrefixes& shared) {
  const int64_t tpb = d.tokens_per_block, D = d.head_dim, group = d.num_heads / d.num_kv_heads;
  thread_local std::vector<int64_t> order;
  order.clear();
  for (int64_t i = 0; i < static_cast<int64_t>(work.size()); ++i) {
    const AttnWork& w = work[i];
    const int64_t per_kv_head = std::min(w.head_end - w.head_begin, group);
    if (w.num_q_tokens * per_kv_head < kMinSharedVectors && w.kv_block_end > w.kv_block_begin &&
        (w.first_q_pos + 1) / tpb > w.kv_block_begin)
      order.push_back(i);
  }
  const auto key = [&](int64_t i) {
    const AttnWork& w = work[i];
    return std::make_tuple(w.kv_block_begin, w.block_table[w.kv_block_begin], w.head_begin);
  };
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return key(a) != key(b) ? key(a) < key(b) : a < b; });
  struct Group {
    int64_t begin, end, blocks_begin, blocks_end, tokens;  // items order[begin, end), sharing these KV blocks
  };
  thread_local std::vector<Group> groups;
  groups.clear();
  int64_t state_floats = 0, num_rows = 0;
  for (int64_t r0 = 0, r1; r0 < static_cast<int64_t>(order.size()); r0 = r1) {
    for (r1 = r0 + 1; r1 < static_cast<int64_t>(order.size()) && key(order[r1]) == key(order[r0]); ++r1) {}
    const AttnWork& first = work[order[r0]];
    const int64_t heads = first.head_end - first.head_begin, per_kv_head = std::min(heads, group);
    const int64_t begin = first.kv_block_begin;
    int64_t tokens = 0, end = INT64_MAX;  // the shared blocks: [begin, end)
    for (int64_t r = r0; r < r1; ++r) {
      const AttnWork& w = work[order[r]];
      tokens += w.num_q_tokens;
      end = std::min({end, (w.first_q_pos + 1) / tpb, w.kv_block_end});
      for (int64_t j = begin + 1; j < end; ++j)
        if (w.block_table[j] != first.block_table[j]) end = j;
    }
    if (r1 - r0 < 2 || tokens * per_kv_head < kMinSharedVectors) continue;
    groups.push_back(Group{r0, r1, begin, end, tokens});
    state_floats += tokens * heads * (D + 2);
    num_rows += tokens;
  }
  if (groups.empty()) return;
  shared.states.resize(static_cast<size_t>(state_floats));
  shared.q_rows.reserve(static_cast<size_t>(num_rows));  // units point into both: sized before they do
  float* state = shared.states.data();
  for (const Group& g : groups) {
    const AttnWork& first = work[order[g.begin]];
    const int64_t heads = first.head_end - first.head_begin, M = g.tokens * heads;
    float *m = state, *l = m + M, *acc = l + M;
    state += M * (D + 2);
    const float* const* rows = shared.q_rows.data() + shared.q_rows.size();
    int64_t token = 0;
    for (int64_t r = g.begin; r < g.end; ++r) {
      AttnWork& w = work[order[r]];
      for (int64_t qi = 0; qi < w.num_q_tokens; ++qi) shared.q_rows.push_back(w.q + qi * w.q_tok_stride);
      w.init_m = m + token * heads;
      w.init_l = l + token * heads;
      w.init_acc = acc + token * heads * D;
      w.cost = std::max<int64_t>(1, w.cost - w.num_q_tokens * heads * (g.blocks_end - w.kv_block_begin) * tpb);
      w.kv_block_begin = g.blocks_end;
      token += w.num_q_tokens;
    }
    const int64_t per_kv_head = std::min(heads, group);
    const int64_t unit_tokens = std::max<int64_t>(1, kSharedUnitVectors / per_kv_head);
    for (int64_t kv_head = first.head_begin / group; kv_head <= (first.head_end - 1) / group; ++kv_head)
      for (int64_t t0 = 0; t0 < g.tokens; t0 += unit_tokens) {
        SharedUnit u;
        u.work = first;
        u.work.q = nullptr;
        u.work.num_q_tokens = std::min(unit_tokens, g.tokens - t0);
        u.work.first_q_pos = g.blocks_end * tpb;  // every query sees every key of the shared blocks
        u.work.kv_block_begin = g.blocks_begin;
        u.work.kv_block_end = g.blocks_end;
        u.work.partial = nullptr;
        u.work.init_m = u.work.init_l = u.work.init_acc = nullptr;
        u.q_rows = rows + t0;
        u.kv_head = kv_head;
        u.m = m + t0 * heads;
        u.l = l + t0 * heads;
        u.acc = acc + t0 * heads * D;
        shared.units.push_back(u);
      }
  }
}

// Step 2: work items, largest first. An item covers all heads of a chunk of query tokens when there are
// enough chunks to keep the threads busy (each KV row is then read once, whole); otherwise items are
// split per KV head (one GQA group: its query heads take each KV block in turn, from L1), and only
// when there are fewer of those than threads, per query head (re-reading KV rows, from cache); then
// split_kv cuts long items at fixed KV positions. How items are cut never changes a query vector's
// result: each vector's scores, softmax and output are computed by the same code in the same order
// whatever item holds it (attend_fn picks the kernel variant by ISA alone). Split parts write their
// states into `parts`, for merge_parts after run_work. Fills `work` (cleared first; the caller keeps its
// capacity across calls).
void make_work(const Dims& d, const BatchView& batch, const PoolView& pool, const float* q_rot, void* out, bool out_bf16,
               SplitParts& parts, SharedPrefixes& shared, std::vector<AttnWork>& work) {
  const int64_t H = d.num_heads, Hkv = d.num_kv_heads, D = d.head_dim, group = H / Hkv;
  const int32_t *cu = batch.cu_seqlens_q, *kv_lens = batch.seq_lens_kv, *tables = batch.block_tables;
  int64_t num_chunks = 0;
  for (int64_t b = 0; b < d.num_seqs; ++b) num_chunks += (cu[b + 1] - cu[b] + kQueryChunkTokens - 1) / kQueryChunkTokens;
  const int64_t num_threads = at::get_num_threads();
  int64_t heads_per_item = H;
  if (num_chunks < 4 * num_threads) heads_per_item = (num_chunks * Hkv < num_threads) ? 1 : group;

  static std::atomic<uint64_t> num_calls{0};
  const uint64_t call_id = num_calls.fetch_add(1) + 1;  // never 0, a cleared cache tag's
  work.clear();
  work.reserve(static_cast<size_t>(num_chunks * (H / heads_per_item)));
  for (int64_t b = 0; b < d.num_seqs; ++b) {
    const int64_t num_new = cu[b + 1] - cu[b];
    const int64_t first_pos = kv_lens[b] - num_new;
    for (int64_t c0 = 0; c0 < num_new; c0 += kQueryChunkTokens) {
      const int64_t n = std::min(kQueryChunkTokens, num_new - c0);
      const int64_t tok = cu[b] + c0;
      for (int64_t h0 = 0; h0 < H; h0 += heads_per_item) {
        AttnWork w{};
        w.q = q_rot + (tok * H + h0) * D;
        w.q_tok_stride = H * D;
        w.out = static_cast<char*>(out) + (tok * H + h0) * D * (out_bf16 ? 2 : 4);
        w.out_bf16 = out_bf16;
        w.out_tok_stride = H * D;
        w.k_base = pool.k;
        w.v_base = pool.v;
        w.kv_row_stride = Hkv * D;
        w.kv_type = pool.kv_type;
        w.out_scale = pool.out_scale;
        w.block_table = tables + b * d.max_blocks_per_seq;
        w.tokens_per_block = d.tokens_per_block;
        w.head_dim = D;
        w.head_begin = h0;
        w.head_end = h0 + heads_per_item;
        w.group = group;
        w.num_q_tokens = n;
        w.first_q_pos = first_pos + c0;
        w.kv_block_begin = 0;
        w.kv_block_end = (first_pos + c0 + n - 1) / d.tokens_per_block + 1;
        w.partial = nullptr;
        w.cost = n * heads_per_item * (first_pos + c0 + n);
        w.call_id = call_id;
        work.push_back(w);
      }
    }
  }
  split_kv(d, work, parts);
  if (attend_shared_fn() != nullptr && pool.kv_type == KvType::kBFloat16 && out_bf16 && d.head_dim % 32 == 0 &&
      d.tokens_per_block % 32 == 0)  // the AMX path's items (attention_kernels.h)
    share_prefixes(d, work, shared);
  std::stable_sort(work.begin(), work.end(), [](const AttnWork& a, const AttnWork& b) { return a.cost > b.cost; });
}

// Threads pull items from a shared counter (dynamic scheduling: items differ in cost by orders of
// magnitude in a mixed batch, at::parallel_for alone splits statically).
void run_work(const std::vector<AttnWork>& work, const Dims& d) {
  int64_t max_m = 0;
  for (const AttnWork& w : work) max_m = std::max(max_m, w.num_q_tokens * (w.head_end - w.head_begin));
  // Sized by the generic kernel's formula (both ISA variants use the same layout).
  const int64_t scratch_floats =
      generic::attn_scratch_floats(max_m, d.head_dim, d.tokens_per_block, d.num_kv_heads * d.head_dim);
  const AttendFn attend = attend_fn();
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(work.size());
  const int64_t num_workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, num_workers, 1, [&](int64_t, int64_t) {
    // Per thread, kept across calls (a decode step makes one call per layer); never read before written.
    float* scratch = kiln::thread_scratch<0>(scratch_floats);
    for (int64_t i = next.fetch_add(1); i < num_items; i = next.fetch_add(1)) {
      const AttnWork& w = work[i];
      attend(w, scratch);
    }
  });
}

// Cascade attention's shared part (share_prefixes), before the items that go on from its states; threads
// pull units as run_work's items.
void run_shared(const SharedPrefixes& shared, const Dims& d) {
  const int64_t num_units = static_cast<int64_t>(shared.units.size());
  if (num_units == 0) return;
  const int64_t scratch_floats =
      generic::attn_scratch_floats(kSharedUnitVectors, d.head_dim, d.tokens_per_block, d.num_kv_heads * d.head_dim);
  const SharedFn attend_shared = attend_shared_fn();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_units), 1, [&](int64_t, int64_t) {
    float* scratch = kiln::thread_scratch<0>(scratch_floats);
    for (int64_t i = next.fetch_add(1); i < num_units; i = next.fetch_add(1)) attend_shared(shared.units[i], scratch);
  });
}

// Steps 1 and 2 for activations scalar_t and a cache_t pool; out: [T, num_heads, head_dim] in scalar_t.
template <typename scalar_t, typename cache_t>
void rope_write_attend(const Dims& d, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const PoolView& pool, const BatchView& batch, const float* inv_freq, float* q_rot, void* out) {
  rope_and_write_kv<scalar_t, cache_t>(d, q, k, v, pool, batch, inv_freq, q_rot);
  // this thread's, reused by its later calls (a decode step makes one per layer)
  thread_local SplitParts parts;
  thread_local SharedPrefixes shared;
  thread_local std::vector<AttnWork> work;
  parts.clear();
  shared.clear();
  make_work(d, batch, pool, q_rot, out, std::is_same_v<scalar_t, at::BFloat16>, parts, shared, work);
  run_shared(shared, d);
  run_work(work, d);
  merge_parts(parts, d.head_dim);
}

}  // namespace

at::Tensor paged_attention_cpu(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                               const at::Tensor& kv_cache, int64_t layer_idx, const at::Tensor& positions_in,
                               const at::Tensor& inv_freq_in, const at::Tensor& cu_seqlens_q_in,
                               const at::Tensor& seq_lens_kv_in, const at::Tensor& block_tables_in,
                               const at::Tensor& slot_mapping_in, double scale,
                               const c10::optional<at::Tensor>& kv_scale) {
  const Dims d = check_shapes(q_in, k_in, v_in, kv_cache, layer_idx, positions_in, inv_freq_in, cu_seqlens_q_in,
                              seq_lens_kv_in, block_tables_in, slot_mapping_in, kv_scale);
  // Token rows may be strided (q, k, v split from a fused projection); heads and head_dim must be dense.
  auto dense_rows = [](const at::Tensor& t) {
    return (t.stride(2) == 1 && t.stride(1) == t.size(2)) ? t : t.contiguous();
  };
  const at::Tensor q = dense_rows(q_in), k = dense_rows(k_in), v = dense_rows(v_in);
  const at::Tensor positions = positions_in.contiguous(), inv_freq = inv_freq_in.contiguous();
  const at::Tensor cu_seqlens_q = cu_seqlens_q_in.contiguous(), seq_lens_kv = seq_lens_kv_in.contiguous();
  const at::Tensor block_tables = block_tables_in.contiguous(), slot_mapping = slot_mapping_in.contiguous();
  const BatchView batch{positions.data_ptr<int64_t>(), cu_seqlens_q.data_ptr<int32_t>(), seq_lens_kv.data_ptr<int32_t>(),
                        block_tables.data_ptr<int32_t>(), slot_mapping.data_ptr<int64_t>()};
  check_indices(d, batch);

  at::Tensor out = at::empty_like(q_in, q_in.options().memory_format(at::MemoryFormat::Contiguous));
  if (d.num_tokens == 0) return out;
  const bool is_bf16 = q.scalar_type() == at::kBFloat16;
  // [T, num_heads, head_dim] float32; slot 1: the workers' attention scratch is slot 0 (run_work)
  float* q_rot_p = kiln::thread_scratch<1>(d.num_tokens * d.num_heads * d.head_dim);

  // 8-bit pools: the scales (validated finite and positive), and their folded forms (FP8 reads as
  // 2^-8 * value, see attention_kernels.h).
  float k_scale = 1.0f, v_scale = 1.0f, fold = 1.0f;
  KvType kv_type = is_bf16 ? KvType::kBFloat16 : KvType::kFloat32;
  if (kv_scale.has_value()) {
    const at::Tensor scales = kv_scale->contiguous();
    k_scale = scales.data_ptr<float>()[0];
    v_scale = scales.data_ptr<float>()[1];
    TORCH_CHECK(std::isfinite(k_scale) && std::isfinite(v_scale) && k_scale > 0.f && v_scale > 0.f,
                "kilnlm::paged_attention: kv_scale must be finite and positive, got [", k_scale, ", ", v_scale,
                "]: recalibrate the KV cache (rebuild the engine)");
    const bool fp8 = kv_cache.scalar_type() == at::kFloat8_e4m3fn;
    kv_type = fp8 ? KvType::kFp8E4M3 : KvType::kInt8;
    fold = fp8 ? 256.0f : 1.0f;
  }
  const float q_scale = static_cast<float>(scale) * (kv_scale.has_value() ? fold * k_scale : 1.0f);
  const float out_scale = kv_scale.has_value() ? fold * v_scale : 1.0f;
  // kv_cache[layer_idx, 0] and [layer_idx, 1], each [num_blocks, tokens_per_block, num_kv_heads, head_dim]
  const int64_t kv_elems = d.num_blocks * d.tokens_per_block * d.num_kv_heads * d.head_dim;
  char* layer = static_cast<char*>(kv_cache.data_ptr()) + layer_idx * 2 * kv_elems * kv_cache.element_size();
  const PoolView pool{layer, layer + kv_elems * kv_cache.element_size(), kv_type, k_scale, v_scale, q_scale, out_scale};
  void* out_p = out.data_ptr();
  const float* inv_freq_p = inv_freq.data_ptr<float>();
  auto run = [&](auto activation_tag, auto cache_tag) {
    using scalar_t = decltype(activation_tag);
    using cache_t = decltype(cache_tag);
    rope_write_attend<scalar_t, cache_t>(d, q, k, v, pool, batch, inv_freq_p, q_rot_p, out_p);
  };
  switch (kv_type) {
    case KvType::kFloat32: run(float{}, float{}); break;
    case KvType::kBFloat16: run(at::BFloat16{}, at::BFloat16{}); break;
    case KvType::kFp8E4M3:
      if (is_bf16) run(at::BFloat16{}, at::Float8_e4m3fn{}); else run(float{}, at::Float8_e4m3fn{});
      break;
    case KvType::kInt8:
      if (is_bf16) run(at::BFloat16{}, int8_t{}); else run(float{}, int8_t{});
      break;
  }
  return out;
}

}  // namespace kiln_attn

TORCH_LIBRARY_IMPL(kilnlm, CPU, m) { m.impl("paged_attention", &kiln_attn::paged_attention_cpu); }

KILN_C_SHIM aoti_torch_cpu_paged_attention(AtenTensorHandle q, AtenTensorHandle k, AtenTensorHandle v,
                                           AtenTensorHandle kv_cache, int64_t layer_idx, AtenTensorHandle positions,
                                           AtenTensorHandle inv_freq, AtenTensorHandle cu_seqlens_q,
                                           AtenTensorHandle seq_lens_kv, AtenTensorHandle block_tables,
                                           AtenTensorHandle slot_mapping, double scale, AtenTensorHandle* kv_scale,
                                           AtenTensorHandle* ret0) {
  using namespace kiln_shim;
  return call(ret0, [&] {
    return kiln_attn::paged_attention_cpu(tensor(q), tensor(k), tensor(v), tensor(kv_cache), layer_idx, tensor(positions),
                                          tensor(inv_freq), tensor(cu_seqlens_q), tensor(seq_lens_kv),
                                          tensor(block_tables), tensor(slot_mapping), scale, optional_tensor(kv_scale));
  });
}
