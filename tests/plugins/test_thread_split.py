"""The linear ops hand their weight rows to the threads in chunks that the layer alone fixes
(plugins/csrc/row_blocks.h: each thread takes its own share's chunks, then what is left of the others'), so
a row's bits never depend on the thread count or on which thread ran its chunk. A layer of 1,000 rows has
many chunks and a partial last 16- or 32-row block; the token counts cover the GEMVs (1, 2, 5) and the
context tiles (40). kilnlm::gemm hands x to at::linear, whose split is torch's, on a CPU without AVX2 or
with the portable code forced (KILNLM_CPU_ISA=generic): there it is left out."""

from __future__ import annotations

import os

import pytest
import torch

from factories import cpu_has, random_linear_ops

pytestmark = pytest.mark.usefixtures("cpu_kernels")

OUT_FEATURES, IN_FEATURES, GROUP = 1000, 576, 64


def gemm_runs_kilnlm_kernels() -> bool:
    cap = os.environ.get("KILNLM_CPU_ISA", "").lower()
    return cap != "generic" and (cap == "avx2" or cpu_has("avx2", "fma"))


def linears() -> dict:
    cases, _, _ = random_linear_ops(OUT_FEATURES, IN_FEATURES, GROUP, torch.Generator().manual_seed(11))
    if not gemm_runs_kilnlm_kernels():
        del cases["gemm"]
    return cases


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_linear_gives_the_same_bits_at_any_thread_count(num_threads, dtype):
    gen = torch.Generator().manual_seed(12)
    failures = []
    for name, run in linears().items():
        for num_tokens in (1, 2, 5, 40):
            x = (torch.randn(num_tokens, IN_FEATURES, generator=gen) * 3.0).to(dtype)
            results = {}
            for threads in (1, 2, 3):
                num_threads(threads)
                results[threads] = run(x)
            for threads in (2, 3):
                differing = (~(results[threads] == results[1]).all(0)).nonzero().flatten().tolist()
                if differing:
                    failures.append(f"{name} T={num_tokens} {threads} threads: rows {differing[:8]}")
    assert not failures, failures
