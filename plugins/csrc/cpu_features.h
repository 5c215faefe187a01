// Run-time CPU feature detection for kernels compiled in several ISA variants (the build uses plain -O3,
// never -march=native, so one build runs on any x86-64 machine and picks its fastest path here).
#pragma once

#include <cstdlib>
#include <cstring>

namespace kiln {

// AVX2 + FMA + F16C (Intel Haswell / AMD Zen and later): the vectorized path of every kernel.
// Setting the environment variable KILNLM_CPU_ISA=generic (read once per process) forces the portable
// scalar path, e.g. to test it on a machine that has AVX2.
inline bool cpu_has_avx2_fma_f16c() {
#if defined(__x86_64__) || defined(__i386__)
  static const bool has = [] {
    const char* forced = std::getenv("KILNLM_CPU_ISA");
    if (forced != nullptr && std::strcmp(forced, "generic") == 0) return false;
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  }();
  return has;
#else
  return false;
#endif
}

}  // namespace kiln
