// float32 -> bfloat16 bits, one value at a time, for the kernels' scalar tails. Included at file scope
// (beside cpu_features.h) by the .cpp files whose ISA-namespaced kernel headers store bfloat16.
#pragma once

#include <cstdint>

namespace kiln {

// Rounds to nearest even; NaN -> quiet NaN 0x7FC0 (as c10::BFloat16 converts, so a kernel's bfloat16
// output matches `out.copy_(out_f32)` bit for bit).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace kiln
