// The generation-phase GEMVs' parallel loop (bf16_gemv.h works on whole 16-row blocks) and per-call
// scratch, shared by the ops' CPU files. Included with the torch headers, outside the per-ISA copies
// (isa_variants.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>

namespace kiln {

// fn(r0, r1) over [0, num_rows) split between at::parallel_for's threads at multiples of `block` rows
// (only the last range may end on a partial block).
template <class F>
inline void parallel_row_blocks(int64_t num_rows, int64_t block, const F& fn) {
  at::parallel_for(0, (num_rows + block - 1) / block, 1,
                   [&](int64_t b0, int64_t b1) { fn(b0 * block, std::min(num_rows, b1 * block)); });
}

// At least n floats, 64-byte aligned and uninitialized, owned by the calling thread and reused by its
// later calls (grown to the largest call's size, never shrunk: [2048, 1536] float32 activations of a full
// context chunk, 12.6 MB). For the GEMVs' per-call float32 accumulators and activations: a decode step
// makes ~150 op calls of a few microseconds each, where a std::vector<float>(n) costs a malloc, a zero
// fill that the kernels overwrite anyway, and a free (for the LM head's [1, 49152] accumulator: a 196 KB
// memset, and glibc consolidating its free lists). Slot tells apart the buffers one call holds at the same
// time; no op holds one across another op's call. The pointer, not the buffer, goes to worker threads.
// The alignment matters: the context phase hands the activations to at::mm, which ran an int4_awq
// 128-token prefill 3-10% slower from a buffer that plain operator new had aligned to 16 bytes.
struct AlignedDelete {
  void operator()(float* p) const { ::operator delete[](p, std::align_val_t{64}); }
};

template <int Slot>
inline float* thread_scratch(int64_t n) {
  thread_local std::unique_ptr<float[], AlignedDelete> buffer;
  thread_local size_t capacity = 0;
  if (capacity < static_cast<size_t>(n)) {
    buffer.reset(static_cast<float*>(::operator new[](static_cast<size_t>(n) * sizeof(float), std::align_val_t{64})));
    capacity = static_cast<size_t>(n);
  }
  return buffer.get();
}

}  // namespace kiln
