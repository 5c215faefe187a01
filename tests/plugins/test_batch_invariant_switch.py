"""KILNLM_BATCH_INVARIANT=1 (plugins/csrc/cpu_features.h; issue 26, item 4): every linear op gives each row
the bits it gets alone, whatever the call's row count, on every ISA path: AVX512-BF16 / VBMI / VNNI where the
CPU has them, and AVX-512 without VNNI, AVX2 and the portable scalar code forced with KILNLM_CPU_ISA, each in
a fresh process. Row counts cross every boundary the kernels have (GEMV / tiles at 4-16 tokens, the bf16
direct kernel's 64, at::linear beyond) and go far past them. Activations carry an outlier channel; float32
outputs show any difference in the float32 sums, bfloat16 ones those that cross a rounding step. The float32
GEMV that replaces at::linear is also checked against float64 arithmetic."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("cpu_kernels")

SCRIPT = r"""
import torch
from factories import random_linear_ops
from kilnlm.plugins import load_cpu_kernels
load_cpu_kernels()
ops = torch.ops.kilnlm
in_features = 256
gen = torch.Generator().manual_seed(3)
linears, w, bias = random_linear_ops(200, in_features, 64, gen)
failures = []
for dtype in (torch.float32, torch.bfloat16):
    x = torch.randn(150, in_features, generator=gen) * 3.0
    x[:, 7] *= 40.0
    x = x.to(dtype)
    for name, run in linears.items():
        alone = torch.cat([run(x[i:i + 1]) for i in range(24)])
        for num_rows in (2, 3, 4, 5, 8, 9, 16, 17, 24, 64, 65, 150):
            n = min(num_rows, 24)
            differing = (~(run(x[:num_rows])[:n] == alone[:n]).all(1)).nonzero().flatten().tolist()
            if differing:
                failures.append(f"{name} {dtype} M={num_rows}: rows {differing}")
    exact = x.double() @ w.to(dtype).double().T + bias.to(dtype).double()
    magnitude = x.double().abs() @ w.to(dtype).double().abs().T
    error = (ops.gemm(x, w.to(dtype), bias.to(dtype)).double() - exact).abs()
    bound = 2e-6 * magnitude + (exact.abs() * 2 ** -8 if dtype == torch.bfloat16 else 0)
    if not (error <= bound).all():
        failures.append(f"gemm {dtype}: off the exact result by {float((error - bound).max())} past the bound")
print("\n".join(failures) or "ok")
"""


@pytest.mark.parametrize("isa", ["native", "avx512bf16", "avx512", "avx2", "generic"])
def test_every_linear_gives_each_row_its_bits_alone_on_every_isa_path(isa):
    env = dict(os.environ, KILNLM_BATCH_INVARIANT="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).parents[1]), env.get("PYTHONPATH")]))  # factories
    env.pop("KILNLM_CPU_ISA", None)
    if isa != "native":
        env["KILNLM_CPU_ISA"] = isa
    result = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok", result.stdout
