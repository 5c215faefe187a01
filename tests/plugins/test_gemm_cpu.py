"""The C++ kilnlm::gemm kernel (the 16/32-bit float linear layers and the LM head).

bfloat16 with in_features a multiple of 32 runs on AMX tiles at every token count where the CPU has AMX-BF16
(Intel Sapphire Rapids and later; each row's bits then do not depend on the token count, checked below); else,
up to 64 tokens, kilnlm's own AVX512-BF16 kernel where the CPU has it (KILNLM_CPU_ISA=avx512bf16 forces it on
an AMX machine), float32 with up to 64 tokens kilnlm's AVX2 GEMV; more tokens or other shapes go to
at::linear: the token sweep crosses those boundaries. On AVX2 CPUs without AVX512-BF16, bfloat16 runs kilnlm's AVX2 GEMV up to 48 tokens and float32
tiles through at::mm beyond; the capped-ISA test checks those paths on any x86-64 machine. Both are checked against exact float64 dot products of the same
bfloat16 operands: float32 accumulation in another summation order (a few float32 ulps of the
accumulated magnitude) plus the output's rounding to bfloat16 (half a bfloat16 ulp, <= 2^-8 relative).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kilnlm.plugins.reference import gemm_reference
from factories import cpu_has

pytestmark = pytest.mark.usefixtures("cpu_kernels")

gemm = torch.ops.kilnlm.gemm

SHAPES = [(960, 576), (3072, 576), (576, 1536), (37, 64), (40, 200)]  # SmolLM2 QKV / gate-up / down, odd ones
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]


def check_against_exact(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    bound = 2e-6 * (x.double().abs() @ w.double().abs().T) + 1e-7
    if x.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs()
    assert y.dtype == x.dtype and y.shape == exact.shape
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"max error {float(err.max()):.3g}, max excess {float((err - bound).max()):.3g}"


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 5, 7, 16, 17, 64, 65])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_gemm_matches_exact_dot_products(shape, num_tokens, dtype, with_bias):
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(num_tokens * 7 + out_features)
    x = (torch.randn(num_tokens, in_features, generator=gen) * 3).to(dtype)
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
    y = gemm(x, w, bias)
    check_against_exact(y, x, w, bias)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y, gemm_reference(x, w, bias), **tol)


def test_strided_rows_and_the_tied_lm_head_layout():
    """x may be a row-strided view (a slice of a fused projection); the weight is the plain [out, in]
    tensor the embedding also gathers rows from."""
    gen = torch.Generator().manual_seed(5)
    fused = torch.randn(3, 2 * 576, generator=gen).bfloat16()
    x = fused[:, :576]  # stride (1152, 1)
    table = (torch.randn(1000, 576, generator=gen) * 0.05).bfloat16()
    y = gemm(x, table, None)
    check_against_exact(y, x.contiguous(), table, None)
    assert torch.equal(y, gemm(x.contiguous(), table, None))


@pytest.mark.parametrize("args, message", [
    ((torch.randn(2, 8), torch.randn(4, 8).bfloat16(), None), "weight must be a 2-D"),
    ((torch.randn(2, 8), torch.randn(4, 6), None), "x has 8 features but weight expects 6"),
    ((torch.randn(2, 8), torch.randn(4, 8), torch.randn(3)), "bias must be"),
    ((torch.randn(2, 3, 8), torch.randn(4, 8), None), "x must be"),
    ((torch.randn(2, 8).half(), torch.randn(4, 8).half(), None), "float32 or bfloat16"),
], ids=["dtype-mismatch", "in-features", "bias-shape", "x-rank", "half"])
def test_bad_inputs_are_refused_with_a_message(args, message):
    with pytest.raises(RuntimeError, match=message):
        gemm(*args)


ISA_SCRIPT = r"""
import torch
from kilnlm.plugins import load_cpu_kernels
load_cpu_kernels()
for out_features, in_features in ((960, 576), (37, 64), (40, 200), (13, 20)):
    for num_tokens in (1, 2, 3, 5, 16, 17, 48, 49, 70):
        for with_bias, dtype in ((False, torch.bfloat16), (True, torch.bfloat16), (True, torch.float32)):
            gen = torch.Generator().manual_seed(num_tokens * 7 + out_features)
            x = (torch.randn(num_tokens, in_features, generator=gen) * 3).to(dtype)
            w = (torch.randn(out_features, in_features, generator=gen) * 0.05).to(dtype)
            bias = torch.randn(out_features, generator=gen).to(dtype) if with_bias else None
            y = torch.ops.kilnlm.gemm(x, w, bias)
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            bound = 2e-6 * (x.double().abs() @ w.double().abs().T) + 1e-7
            if dtype == torch.bfloat16:
                bound = bound + 2.0 ** -8 * exact.abs()
            assert y.dtype == dtype and y.shape == exact.shape
            err = (y.double() - exact).abs()
            assert (err <= bound).all(), (out_features, in_features, num_tokens, float((err - bound).max()))
print("ok")
"""


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512bf16"])
def test_capped_isa_paths_match_exact_dot_products(isa):
    """bfloat16 through the AVX2 GEMV and float32 tiles, float32 through the same GEMV up to 64 tokens
    (KILNLM_CPU_ISA=avx2: 960x576 and 37x64 take the vector loop, 40x200 and 13x20 its 8-column and scalar
    tails) and through at::linear (generic), and the AVX512-BF16 direct kernel up to 64 tokens with AMX
    turned off (avx512bf16, on CPUs with AVX512-BF16), in a fresh process, whatever the machine has."""
    env = dict(os.environ, KILNLM_CPU_ISA=isa)
    result = subprocess.run([sys.executable, "-c", ISA_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


@pytest.mark.skipif(not cpu_has("amx_bf16", "amx_tile"), reason="this CPU has no AMX-BF16 tiles (or KILNLM_CPU_ISA caps them)")
@pytest.mark.parametrize("shape", [(960, 576), (200, 64), (49155, 576), (37, 1536)], ids=lambda s: "x".join(map(str, s)))
def test_amx_rows_get_their_bits_alone_at_every_token_count(shape):
    """On AMX every token count takes the tiles, without KILNLM_BATCH_INVARIANT: a row of x gives the same
    bits alone, in any batch (across the 16-token B tiles, the 32-token pairs of them, the k chunks of
    several pairs and the 256-token chunks, past the direct kernel's 64 and at::linear's range), and from a
    row-strided view; the rows of a partial last 32-row weight block (960 = 30 x 32; 200, 49155 and 37 are
    not multiples of 32) included. An outlier channel makes the float32 sums' order show in the bfloat16
    output."""
    out_features, in_features = shape
    gen = torch.Generator().manual_seed(out_features)
    x = torch.randn(300, in_features, generator=gen) * 3
    x[:, 5] *= 40
    x = x.bfloat16()
    w = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16()
    rows = list(range(40)) + [255, 256, 257, 299]
    alone = torch.cat([gemm(x[i:i + 1], w, bias) for i in rows])
    for num_tokens in (2, 4, 5, 16, 17, 31, 32, 33, 64, 65, 150, 256, 300):
        batch = gemm(x[:num_tokens], w, bias)
        seen = [j for j, i in enumerate(rows) if i < num_tokens]
        differ = (batch[[rows[j] for j in seen]] != alone[seen]).any(1)
        assert not differ.any(), f"{num_tokens} tokens: rows {[rows[seen[j]] for j in differ.nonzero().flatten().tolist()]}"
    check_against_exact(gemm(x, w, bias), x, w, bias)
    wide = torch.zeros(300, 2 * in_features).bfloat16()
    wide[:, :in_features] = x
    assert torch.equal(gemm(wide[:, :in_features], w, bias)[rows], alone)
