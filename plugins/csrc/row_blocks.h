// The GEMVs' parallel loop over chunks of weight rows (bf16_gemv.h works on whole 16-row blocks) and per-call
// scratch, shared by the ops' CPU files. Included with the torch headers, outside the per-ISA copies
// (isa_variants.h).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <new>

namespace kiln {

// Rows of one chunk of parallel_row_chunks: whole `block`s, at least min_rows, and few enough that a call
// has about kChunksPerCall of them. The split depends on the layer alone, never on the thread count.
constexpr int64_t kChunksPerCall = 32;

inline int64_t chunk_rows(int64_t num_rows, int64_t block, int64_t min_rows) {
  const int64_t rows = std::max(min_rows, (num_rows + kChunksPerCall - 1) / kChunksPerCall);
  return (rows + block - 1) / block * block;
}

// fn(r0, r1) for each chunk [r0, r1) of `chunk` rows of [0, num_rows) (the last may be shorter). Each
// thread first takes the chunks of its own contiguous share in order, as a static split would (one stream
// of rows per thread), then the chunks left in the others' shares: a thread that runs slower (a busy
// sibling hyperthread on a shared host, another tenant) is helped by the one that finished, where a static
// split makes every call wait for the slowest share. The chunks are fixed by the layer, so which thread
// runs one never changes a result.
struct alignas(64) ChunkShare {
  std::atomic<int64_t> next;  // the share's next chunk (runs past end once it is taken)
  int64_t end;
};
constexpr int64_t kMaxChunkShares = 64;

template <class F>
inline void parallel_row_chunks(int64_t num_rows, int64_t chunk, const F& fn) {
  const int64_t num_chunks = (num_rows + chunk - 1) / chunk;
  const int64_t num_workers = std::min({static_cast<int64_t>(at::get_num_threads()), num_chunks, kMaxChunkShares});
  if (num_workers <= 1 || at::in_parallel_region()) {
    for (int64_t c = 0; c < num_chunks; ++c) fn(c * chunk, std::min(num_rows, (c + 1) * chunk));
    return;
  }
  ChunkShare shares[kMaxChunkShares];
  for (int64_t w = 0; w < num_workers; ++w) {
    shares[w].next.store(w * num_chunks / num_workers, std::memory_order_relaxed);
    shares[w].end = (w + 1) * num_chunks / num_workers;
  }
  at::parallel_for(0, num_workers, 1, [&](int64_t w0, int64_t) {
    for (int64_t i = 0; i < num_workers; ++i) {
      ChunkShare& share = shares[(w0 + i) % num_workers];
      for (int64_t c = share.next.fetch_add(1, std::memory_order_relaxed); c < share.end;
           c = share.next.fetch_add(1, std::memory_order_relaxed))
        fn(c * chunk, std::min(num_rows, (c + 1) * chunk));
    }
  });
}

// fn(r0, r1) over [0, num_rows) in chunks of whole `block`s (only the last may end on a partial block).
template <class F>
inline void parallel_row_blocks(int64_t num_rows, int64_t block, const F& fn) {
  parallel_row_chunks(num_rows, chunk_rows(num_rows, block, block), fn);
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
