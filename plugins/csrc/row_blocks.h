// The generation-phase GEMVs' parallel loop (bf16_gemv.h works on whole 16-row blocks), shared by the
// ops' CPU files. Included with the torch headers, outside any `#pragma GCC target` region.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

namespace kiln {

// fn(r0, r1) over [0, num_rows) split between at::parallel_for's threads at multiples of `block` rows
// (only the last range may end on a partial block).
template <class F>
inline void parallel_row_blocks(int64_t num_rows, int64_t block, const F& fn) {
  at::parallel_for(0, (num_rows + block - 1) / block, 1,
                   [&](int64_t b0, int64_t b1) { fn(b0 * block, std::min(num_rows, b1 * block)); });
}

}  // namespace kiln
