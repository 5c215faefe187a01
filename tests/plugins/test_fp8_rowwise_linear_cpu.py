"""The C++ fp8_rowwise_linear kernel (per-channel FP8 weights, per-token dynamic FP8 activations) against
its reference, on every ISA path: in this process the AVX512-VBMI generation-phase GEMV (T <= 4 with
in_features a multiple of 32 -- 64-column and 32-column loaders), the AVX2 GEMV (in_features not a multiple
of 32) and the AVX512-BF16 tiled context GEMM (T > 4) where the CPU has them; the scalar ("generic") and
AVX2-only paths (GEMV up to 16 tokens, float32 tiles beyond) in subprocesses with KILNLM_CPU_ISA.

Exactness as fp8_linear's tests state it: the per-token scales and the activation quantization are
bit-exact (identity weights give ``x_q * s_t`` exactly, NaN / all-zero rows included), every weight byte
decodes exactly, and the GEMM is within float32 rounding of the exact product of the quantized operands."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from factories import random_fp8_weight

from kilnlm.plugins.reference import fp8_rowwise_linear_reference, fp8_token_scales_reference, quantize_fp8_reference

pytestmark = pytest.mark.usefixtures("cpu_kernels")

fp8_rowwise_linear = torch.ops.kilnlm.fp8_rowwise_linear


def activations(num_tokens: int, in_features: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Rows of very different magnitudes (massive activations, tiny ones that quantize to E4M3 subnormals
    next to their row's maximum), an all-zero row and a row of signed zeros."""
    x = torch.randn(num_tokens, in_features, generator=gen) * torch.logspace(-3, 3, num_tokens)[:, None]
    if num_tokens > 2:
        x[1] = 0.0
        x[2, :3] = torch.tensor([1e4, -1e-6, 3e-7])  # subnormal x_q beside the row's amax
    if num_tokens > 3:
        x[3] = -0.0
    return x.to(dtype)


@pytest.mark.parametrize("num_tokens", [1, 3, 4, 5, 16, 17, 130])
@pytest.mark.parametrize("in_features", [64, 96, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_token_quantization_is_bit_exact(num_tokens, in_features, dtype):
    """With an identity weight and unit weight scales, y = x_q * s_t exactly: the kernel's per-token amax,
    scale (1 for an all-zero row), E4M3 rounding and subnormals equal the reference's."""
    gen = torch.Generator().manual_seed(num_tokens * in_features)
    x = activations(num_tokens, in_features, dtype, gen)
    eye = torch.eye(in_features).to(torch.float8_e4m3fn)
    y = fp8_rowwise_linear(x, eye, torch.ones(in_features), None)
    s = fp8_token_scales_reference(x)
    expected = (quantize_fp8_reference(x, s).float() * s).to(dtype)
    assert y.dtype == dtype
    assert torch.equal(y, expected)
    assert torch.equal(y, fp8_rowwise_linear_reference(x, eye, torch.ones(in_features), None))
    if num_tokens > 1:
        assert torch.equal(y[1], torch.zeros(in_features, dtype=dtype))


@pytest.mark.parametrize("num_tokens", [1, 5])
def test_nan_row_takes_scale_one(num_tokens):
    """A NaN in a row makes its amax NaN, and its scale 1 as the reference's (the other rows unaffected)."""
    x = torch.randn(num_tokens, 64) * 100
    x[0, 5] = float("nan")
    eye = torch.eye(64).to(torch.float8_e4m3fn)
    y = fp8_rowwise_linear(x, eye, torch.ones(64), None)
    torch.testing.assert_close(y, fp8_rowwise_linear_reference(x, eye, torch.ones(64), None), atol=0, rtol=0,
                               equal_nan=True)


@pytest.mark.parametrize("num_tokens", [1, 4, 16, 32])
def test_every_fp8_weight_byte_decodes_exactly(num_tokens):
    """One-hot activations of 448 (scale exactly 1) read every finite E4M3 weight back times 448, exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # the two NaN encodings
    rows = codes.reshape(8, 32)
    weight = torch.cat([rows, rows.flip(0), rows.flip(1)]).view(torch.float8_e4m3fn)  # [out=24, in=32]
    eye = torch.eye(32) * 448
    for c0 in range(0, 32, num_tokens):
        y = fp8_rowwise_linear(eye[c0:c0 + num_tokens], weight, torch.ones(24), None)  # [T, 24]
        assert torch.equal(y, weight.float().T[c0:c0 + num_tokens] * 448)


@pytest.mark.parametrize("num_tokens", [1, 2, 4, 5, 16, 17, 64])
@pytest.mark.parametrize("in_features", [256, 96, 200])  # 64-column / 32-column VBMI loaders, a scalar tail
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_fp32_matmul_of_quantized_operands(num_tokens, in_features, dtype, with_bias):
    gen = torch.Generator().manual_seed(7 * num_tokens + in_features + with_bias)
    out_features = 72  # 4 whole 16-row blocks and 8 tail rows
    x = activations(num_tokens, in_features, dtype, gen)
    weight = random_fp8_weight(out_features, in_features, gen)
    weight_scale = torch.rand(out_features, generator=gen) * 0.01 + 1e-4  # per output channel
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    y = fp8_rowwise_linear(x, weight, weight_scale, bias)
    s = fp8_token_scales_reference(x).double()
    x_q = quantize_fp8_reference(x, s.float())
    exact = (x_q.double() @ weight.double().T) * (s * weight_scale.double())
    if bias is not None:
        exact = exact + bias.double()
    assert y.dtype == dtype and y.shape == (num_tokens, out_features)
    # float32: a few ulps of the accumulated magnitude; bfloat16: the final rounding (~2 bf16 ulps).
    magnitude = (x_q.double().abs() @ weight.double().abs().T) * (s * weight_scale.double())
    if dtype == torch.float32:
        assert ((y.double() - exact).abs() <= 1e-6 * magnitude + 1e-6).all()
    else:
        expected = fp8_rowwise_linear_reference(x, weight, weight_scale, bias)
        torch.testing.assert_close(y.float(), expected.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("num_tokens", [1, 4, 16, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_parts_equal_the_parts_alone(num_tokens, dtype):
    """A fused QKV / gate-up weight is its parts' rows concatenated, each row with its own scale: every part
    of the output equals the part run alone (the per-token scales depend on x only), up to summation order."""
    gen = torch.Generator().manual_seed(13 * num_tokens)
    x = activations(num_tokens, 192, dtype, gen)
    parts = [random_fp8_weight(rows, 192, gen) for rows in (48, 16, 16)]
    scales = [torch.rand(p.shape[0], generator=gen) * 0.01 + 1e-4 for p in parts]
    y = fp8_rowwise_linear(x, torch.cat(parts), torch.cat(scales), None)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.0, rtol=2.0 ** -7)
    begin = 0
    for part, scale in zip(parts, scales):
        alone = fp8_rowwise_linear(x, part, scale, None)
        torch.testing.assert_close(y[:, begin:begin + part.shape[0]], alone, **tol)
        begin += part.shape[0]


def test_empty_batch():
    weight = torch.zeros(8, 16).to(torch.float8_e4m3fn)
    assert fp8_rowwise_linear(torch.zeros(0, 16), weight, torch.ones(8), None).shape == (0, 8)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(x=torch.zeros(2, 16, dtype=torch.float64)), "x must be float32 or bfloat16"),
        (dict(weight=torch.zeros(8, 16, dtype=torch.bfloat16)), "weight must be a 2-D float8_e4m3fn"),
        (dict(x=torch.zeros(2, 15)), "x has 15 features but weight expects 16"),
        (dict(weight_scale=torch.tensor(1.0)), "weight_scale must be a \\[out_features=8\\] float32"),
        (dict(weight_scale=torch.ones(8, dtype=torch.float64)), "weight_scale must be a \\[out_features=8\\] float32"),
        (dict(bias=torch.zeros(7)), "bias must be \\[out_features=8\\]"),
    ],
    ids=["x-dtype", "weight-dtype", "in-features", "scale-0-dim", "scale-dtype", "bias-shape"],
)
def test_bad_inputs_raise_clear_errors(kwargs, message):
    args = dict(x=torch.zeros(2, 16), weight=torch.zeros(8, 16).to(torch.float8_e4m3fn), weight_scale=torch.ones(8),
                bias=None)
    args.update(kwargs)
    with pytest.raises(RuntimeError, match=f"kilnlm::fp8_rowwise_linear: {message}"):
        fp8_rowwise_linear(args["x"], args["weight"], args["weight_scale"], args["bias"])


CAPPED_SCRIPT = r"""
import torch
from kilnlm.plugins import load_cpu_kernels, fp8_rowwise_linear_reference, fp8_token_scales_reference
load_cpu_kernels()
gen = torch.Generator().manual_seed(0)
for dtype in (torch.float32, torch.bfloat16):
    for num_tokens in (1, 5, 17, 40):
        for in_features in (64, 200):
            x = (torch.randn(num_tokens, in_features, generator=gen) * torch.logspace(-3, 3, num_tokens)[:, None])
            x[num_tokens // 2] = 0.0
            x = x.to(dtype)
            eye = torch.eye(in_features).to(torch.float8_e4m3fn)
            ones = torch.ones(in_features)
            assert torch.equal(torch.ops.kilnlm.fp8_rowwise_linear(x, eye, ones, None),
                               fp8_rowwise_linear_reference(x, eye, ones, None)), (dtype, num_tokens, in_features)
            w = (torch.randn(72, in_features, generator=gen) * 30).clamp(-448, 448).to(torch.float8_e4m3fn)
            s_w, bias = torch.rand(72, generator=gen) * 0.01 + 1e-4, torch.randn(72, generator=gen)
            y = torch.ops.kilnlm.fp8_rowwise_linear(x, w, s_w, bias)
            expected = fp8_rowwise_linear_reference(x, w, s_w, bias)
            tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
            torch.testing.assert_close(y.float(), expected.float(), **tol)
print("ok")
"""


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_capped_isa_paths_match_reference(isa):
    """The scalar and AVX2-only paths (forced with KILNLM_CPU_ISA in a fresh process: the ISA choice is made
    once per process): GEMV up to 16 tokens, float32 tiles beyond; bit-exact quantization, GEMM within
    float32 rounding."""
    env = dict(os.environ, KILNLM_CPU_ISA=isa)
    result = subprocess.run([sys.executable, "-c", CAPPED_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
