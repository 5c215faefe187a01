// The one per-ISA scaffold of the ops' CPU kernels: compiles an op's kernel header once per instruction
// set, each copy in its own namespace under its own `#pragma GCC target`, so that one build (plain -O3,
// never -march=native) carries every vector path and the op picks one at run time (cpu_features.h).
//
//   namespace kiln_fp8 {
//   #define KILN_ISA_KERNELS "fp8_kernels.h"
//   #include "isa_variants.h"   // kiln_fp8::generic::, avx2::, ..., avx512vnni::, amxbf16::
//   #undef KILN_ISA_KERNELS
//
// Inside the kernel header, KILN_ISA is the instruction set of the copy being compiled (one of the
// KILN_ISA_* levels below) and `#if KILN_ISA == KILN_ISA_AVX2` etc. choose what each copy holds; a header
// leaves the namespaces of the ISAs it has no kernel for empty. Kernel headers are included *inside* a
// namespace, after every system / torch header: they include nothing but other kernel headers and use raw
// pointers only (no std containers, no torch types), so that no inline function of another header is ever
// instantiated with a wider target than the CPU running it has.
//
//   level                  namespace    target                                           chosen when
//   KILN_ISA_GENERIC       generic      (none: portable scalar)                          always available
//   KILN_ISA_AVX2          avx2         avx2, fma, f16c                                  cpu_has_avx2_fma_f16c
//   KILN_ISA_AVX512        avx512       avx512 f/bw/vl/dq + avx2, fma, f16c              cpu_has_avx512
//   KILN_ISA_AVX512_BF16   avx512bf16   avx512 f/bw/vl/bf16, f16c                        cpu_has_avx512_bf16
//   KILN_ISA_AVX512_VBMI   avx512vbmi   avx512 f/bw/vl/bf16/vbmi, f16c                   cpu_has_avx512_bf16_vbmi
//   KILN_ISA_AVX512_VNNI   avx512vnni   avx512 f/bw/vl/dq/vnni + avx2, fma, f16c         cpu_has_avx512_vnni
//   KILN_ISA_AMX_BF16      amxbf16      avx512 f/bw/vl/bf16, amx-tile/bf16/int8, f16c    cpu_has_amx_bf16 (_int8)
//
// No include guard: an op file includes it once per kernel header.

#define KILN_ISA_GENERIC 0
#define KILN_ISA_AVX2 1
#define KILN_ISA_AVX512 2
#define KILN_ISA_AVX512_BF16 3
#define KILN_ISA_AVX512_VBMI 4
#define KILN_ISA_AVX512_VNNI 5
#define KILN_ISA_AMX_BF16 6

// Where the kernels' software prefetch puts the weight rows they stream next (the GEMVs read each weight
// once, from DRAM): the AVX-512 copies into L2 (prefetcht1), the AVX2 copies into L1 (prefetcht0). Into
// L1, the AVX-512 GEMVs' prefetch distance (up to 32 rows of 1,536 bf16 ahead, 96 KB) evicts the lines
// they are about to read; on an AMD EPYC (Zen 4, 32 KB L1D) prefetcht1 took batch-1 decode from 13.0-14.7
// to 10.9-11.0 ms a step (bf16), 11.4-11.6 to 7.1-7.5 (fp8), 9.3-9.7 to 7.3-7.4 (int8_sq); int4_awq and
// the AVX2 path (KILNLM_CPU_ISA=avx2) showed no difference beyond noise. prefetchnta in every copy, so
// that the streamed weights would not evict the step's other data from the caches, was slower on the same
// machine (alternating builds, batch-1 step: bf16 10.4-12.1 -> 12.2-15.1 ms, fp8 6.4-8.4 -> 9.5-10.6,
// int8_sq 7.3-9.7 -> 9.5-12.6; int4_awq + LM head 4.1-4.5 against 3.6-4.6). Evaluated where KILN_ISA is set.
#ifndef KILN_WEIGHT_PREFETCH
#define KILN_WEIGHT_PREFETCH static_cast<_mm_hint>(KILN_ISA == KILN_ISA_AVX2 ? _MM_HINT_T0 : _MM_HINT_T1)
#endif

// How far ahead, in bytes, of the weight they read the GEMVs that read their rows one after another
// prefetch (bf16_gemv.h's first token group up to kGemvInOrderMaxTokens, the AVX-512 W8A8 / W8A16 GEMVs
// of int8_kernels.h for one token, and every AVX2 GEMV: gemm_kernels.h, fp8_kernels.h, int8_kernels.h,
// int4_kernels.h): their weights stream as one sequential run per thread, which the hardware prefetchers
// follow, and the software prefetch runs this far ahead of it. The AVX2 GEMVs had prefetched the rows
// 4 * NR ahead (int4's int16 GEMV 8 rows): 2.3-12.3 KB on SmolLM2's rows. On an AMD EPYC Zen 3 (2 vCPUs,
// alternating builds, a busy host), SmolLM2 bf16's batch-1 decode step in the executor took 17.1-19.1
// against 18.5-21.3 ms (three pairs of runs, every one shorter); fp8, int8_sq and int4_awq + LM head moved
// within the host's noise. A standalone sweep of the bf16 engine's 269 MB in the AVX2 GEMV's loop: 15.0
// against 15.6 ms, a plain read of the same bytes 13.7. On an AMD EPYC Zen 5
// (2 vCPUs), the bf16 one-token tile's rows in order against 16 rows interleaved chunk by chunk (prefetched
// two 16-row blocks ahead): `bench_plugins.py --only gemm` T = 1 (269 MB cold, on huge pages) 6.8-8.1
// against 9.5 ms, SmolLM2 bf16's batch-1 decode step 6.3-8.2 against 8.0-11.1 ms (alternating builds). In
// a standalone sweep of the same bytes in order, 8 KB ahead read as fast as a plain read, 2 KB 16% and no
// prefetch 30% slower.
#ifndef KILN_WEIGHT_PREFETCH_BYTES
#define KILN_WEIGHT_PREFETCH_BYTES 8192
#endif

#ifndef KILN_ISA_KERNELS
#error "define KILN_ISA_KERNELS as the kernel header to compile per ISA before including isa_variants.h"
#endif

#define KILN_ISA KILN_ISA_GENERIC
namespace generic {
namespace {
#include KILN_ISA_KERNELS
}  // namespace
}  // namespace generic
#undef KILN_ISA

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#define KILN_ISA KILN_ISA_AVX2
namespace avx2 {
namespace {
#include KILN_ISA_KERNELS
}  // namespace
}  // namespace avx2
#undef KILN_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")
#define KILN_ISA KILN_ISA_AVX512
namespace avx512 {
namespace {
#include KILN_ISA_KERNELS
}  // namespace
}  // namespace avx512
#undef KILN_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,f16c")
#define KILN_ISA KILN_ISA_AVX512_BF16
namespace avx512bf16 {
namespace {
#include KILN_ISA_KERNELS
}  // namespace
}  // namespace avx512bf16
#undef KILN_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,f16c")
#define KILN_ISA KILN_ISA_AVX512_VBMI
namespace avx512vbmi {
namespace {
#include KILN_ISA_KERNELS
}  // namespace
}  // namespace avx512vbmi
#undef KILN_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")
#define KILN_ISA KILN_ISA_AVX512_VNNI
namespace avx512vnni {
namespace {
#include KILN_ISA_KERNELS
}  // namespace
}  // namespace avx512vnni
#undef KILN_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512bf16,amx-tile,amx-bf16,amx-int8,f16c")
#define KILN_ISA KILN_ISA_AMX_BF16
namespace amxbf16 {
namespace {
#include KILN_ISA_KERNELS
}  // namespace
}  // namespace amxbf16
#undef KILN_ISA
#pragma GCC pop_options
#endif
