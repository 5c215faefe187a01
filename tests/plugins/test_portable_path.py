"""The kernels' portable paths against the references, forced in a subprocess (the ISA choice is made
once per process) with KILNLM_CPU_ISA: "generic" (scalar, for CPUs without AVX2/FMA/F16C) and "avx2"
(no AVX-512: the context-phase FP8 GEMM through float32 at::mm)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.usefixtures("cpu_kernels")

SCRIPT = r"""
import torch
from kilnlm.plugins import load_cpu_kernels, fp8_linear_reference, gemm_reference, paged_attention_reference
load_cpu_kernels()
gen = torch.Generator().manual_seed(0)
for num_tokens in (1, 5):
    x = torch.randn(num_tokens, 192, generator=gen).bfloat16()
    w = torch.randn(48, 192, generator=gen).bfloat16()
    torch.testing.assert_close(torch.ops.kilnlm.gemm(x, w, None), gemm_reference(x, w, None), atol=2e-2, rtol=1e-2)
for num_tokens in (1, 5, 40):
    x = torch.randn(num_tokens, 200, generator=gen)
    w = (torch.randn(72, 200, generator=gen) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
    s_w, s_x = torch.tensor(0.01), torch.tensor(0.05)
    torch.testing.assert_close(torch.ops.kilnlm.fp8_linear(x, w, s_w, s_x, None),
                               fp8_linear_reference(x, w, s_w, s_x, None), atol=1e-4, rtol=1e-5)
for dtype in (torch.float32, torch.bfloat16):
    H, Hkv, D, tpb = 6, 2, 64, 16
    pool = torch.randn(1, 2, 12, tpb, Hkv, D, generator=gen).to(dtype)
    q, k, v = (torch.randn(21, h, D, generator=gen).to(dtype) for h in (H, Hkv, Hkv))
    positions = torch.cat([torch.arange(0, 20), torch.tensor([33])])
    block_tables = torch.tensor([[5, 2, 0], [7, 1, 9]], dtype=torch.int32)
    slots = [int(block_tables[0, p // tpb]) * tpb + p % tpb for p in range(20)] + [9 * tpb + 1]
    args = (0, positions, 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)),
            torch.tensor([0, 20, 21], dtype=torch.int32), torch.tensor([20, 34], dtype=torch.int32),
            block_tables, torch.tensor(slots), D ** -0.5)
    pool_ref = pool.clone()
    out = torch.ops.kilnlm.paged_attention(q, k, v, pool, *args)
    expected = paged_attention_reference(q, k, v, pool_ref, *args)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, expected, atol=tol, rtol=tol)
    torch.testing.assert_close(pool, pool_ref, atol=tol, rtol=tol)
print("ok")
"""


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_capped_isa_paths_match_reference(isa):
    env = dict(os.environ, KILNLM_CPU_ISA=isa)
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
