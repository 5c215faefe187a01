// Run-time CPU feature detection for kernels compiled in several ISA variants (the build uses plain -O3,
// never -march=native, so one build runs on any x86-64 machine and picks its fastest path here), and the
// one other run-time switch of the kernels' paths, KILNLM_BATCH_INVARIANT.
#pragma once

#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kiln {

// The environment variable KILNLM_CPU_ISA (read once per process) caps the paths used, e.g. to test the
// portable ones on a machine that has more: "generic" (scalar only), "avx2" (no AVX-512 paths) or
// "avx512" (no AVX512-VNNI or AMX path) or "avx512bf16" (no AMX path).
inline bool cpu_isa_capped_at(const char* level) {
  const char* cap = std::getenv("KILNLM_CPU_ISA");
  return cap != nullptr && std::strcmp(cap, level) == 0;
}

// AVX2 + FMA + F16C (Intel Haswell / AMD Zen and later): the vectorized path of every kernel.
inline bool cpu_has_avx2_fma_f16c() {
#if defined(__x86_64__)
  static const bool has = !cpu_isa_capped_at("generic") && __builtin_cpu_supports("avx2") &&
                          __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
  return has;
#else
  return false;
#endif
}

// AVX-512 (F, BW, VL, DQ; Intel Skylake-SP / AMD Zen 4 and later): the attention kernels' widest path.
inline bool cpu_has_avx512() {
#if defined(__x86_64__)
  static const bool has = cpu_has_avx2_fma_f16c() && !cpu_isa_capped_at("avx2") &&
                          __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
#else
  return false;
#endif
}

// AVX-512 with BF16 dot products (AMD Zen 4+, Intel Sapphire Rapids+): the context-phase FP8 GEMM.
inline bool cpu_has_avx512_bf16() {
#if defined(__x86_64__)
  static const bool has = cpu_has_avx2_fma_f16c() && !cpu_isa_capped_at("avx2") &&
                          __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// AVX512-BF16 with AVX512-VBMI byte permutes (AMD Zen 4+, Intel Sapphire Rapids+; not Cooper Lake): the
// FP8 generation-phase GEMV, which converts E4M3 bytes to bfloat16 through VPERMI2B tables.
inline bool cpu_has_avx512_bf16_vbmi() {
#if defined(__x86_64__)
  static const bool has = cpu_has_avx512_bf16() && __builtin_cpu_supports("avx512vbmi");
  return has;
#else
  return false;
#endif
}

// AVX-512 with VNNI (VPDPBUSD; Intel Cascade Lake+, AMD Zen 4+): the int8_sq_linear context-phase GEMM.
// KILNLM_CPU_ISA=avx512 turns it off (to test the VPMADDWD path on every token count).
inline bool cpu_has_avx512_vnni() {
#if defined(__x86_64__)
  static const bool has = cpu_has_avx512() && !cpu_isa_capped_at("avx512") && __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

// AMX with BF16 tiles (Intel Sapphire Rapids and later), which Linux lends a process only on request:
// CPUID.(EAX=7, ECX=0):EDX bits 22 (AMX-BF16) and 24 (AMX-TILE), then arch_prctl(ARCH_REQ_XCOMP_PERM,
// XFEATURE_XTILEDATA) granting the tile data state (without it the first tile instruction raises SIGILL).
// The bfloat16 gemm at every token count (gemm.cpp), the quantized linears' bf16 context tiles and bf16
// paged attention. KILNLM_CPU_ISA=avx512 or avx512bf16 turns it off (and cpu_has_amx_int8).
inline bool cpu_has_amx_bf16() {
#if defined(__x86_64__)
  static const bool has = [] {
    if (!cpu_has_avx512_bf16() || cpu_isa_capped_at("avx512") || cpu_isa_capped_at("avx512bf16")) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
    if ((edx & (1u << 22)) == 0 || (edx & (1u << 24)) == 0) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // linux/arch/x86/include/uapi/asm/prctl.h
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return has;
#else
  return false;
#endif
}

// AMX-INT8 tiles (CPUID.(EAX=7, ECX=0):EDX bit 25; every CPU with AMX-BF16 so far has them too), wherever
// cpu_has_amx_bf16: int8_sq_linear's W8A8 GEMM (int8_amx_gemm.h). Off where that is.
inline bool cpu_has_amx_int8() {
#if defined(__x86_64__)
  static const bool has = [] {
    if (!cpu_has_amx_bf16()) return false;
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    return __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) != 0 && (edx & (1u << 25)) != 0;
  }();
  return has;
#else
  return false;
#endif
}

// KILNLM_BATCH_INVARIANT=1 (or "true"; read at every call, so a process may set it at any time): every
// linear op sums each output row in one order whatever the token count, on every ISA path -- the bf16
// direct kernel (gemm.cpp) past its 64 tokens, a float32 GEMV instead of at::linear, each weight-only
// quantized linear's GEMV instead of tiles that sum in another order (quant_linear.h). A row's result is
// then the same bits however many rows the call has: a request's greedy tokens do not depend on what else
// is in the batch (batch invariance; vLLM's VLLM_BATCH_INVARIANT is the same switch). It costs context-phase
// speed, and int4 some decode speed (docs/reliability.md). The ops that are invariant anyway (paged_attention, int8_sq_linear,
// fp8 with AVX512-BF16 and VBMI) keep their paths.
inline bool batch_invariant_requested() {
  const char* value = std::getenv("KILNLM_BATCH_INVARIANT");
  return value != nullptr && (std::strcmp(value, "1") == 0 || std::strcmp(value, "true") == 0);
}

}  // namespace kiln
