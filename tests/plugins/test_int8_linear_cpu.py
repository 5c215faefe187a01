"""The C++ int8_linear (W8A16 weight-only) and int8_sq_linear (SmoothQuant W8A8) kernels.

int8_linear against exact float64 arithmetic and ``int8_linear_reference`` on the generation-phase GEMV
(up to 4 tokens with AVX512-BF16, 16 for float32 x, every count for bfloat16 x on AVX2 CPUs) and the tiled
context-phase path; int8_sq_linear *bit-exactly* against
``int8_sq_linear_reference``: its activation quantization (IEEE division, round half to even, clamp) and
its int32 accumulation are exact, and the epilogue (one float32 conversion, one multiply by
``input_scale * weight_scale[o]``, one bias add, one cast) performs the reference's roundings in the
reference's order, so there is nothing left to tolerate. Also: every ISA path, bad inputs, and one
AOTInductor package calling all three quantized GEMMs (int4_linear too).

Tolerance of int8_linear: float32 outputs within 2e-6 x sum_c |x_c * w_c| of the float64 dot product of
the same operands (another summation order, and the per-row scale applied after the sum instead of to
each weight: a few float32 ulps of the accumulated magnitude); bfloat16 outputs additionally within half
a bfloat16 ulp (<= 2^-8 relative) of the exact value, the output rounding.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kilnlm.plugins.reference import (
    int8_linear_reference,
    int8_sq_linear_reference,
    pack_int4,
    quantize_int8_reference,
)

pytestmark = pytest.mark.usefixtures("cpu_kernels")

int8_linear = torch.ops.kilnlm.int8_linear
int8_sq_linear = torch.ops.kilnlm.int8_sq_linear


def test_cpu_kernels_are_registered():
    for op in ("int4_linear", "int8_linear", "int8_sq_linear"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"kilnlm::{op}", "CPU"), op


def make_layer(out_features: int, in_features: int, *, with_pqs: bool, with_bias: bool, seed: int):
    """Random int8 weight over the full range [-128, 127], per-channel scales, optional pqs and bias."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scales = torch.rand(out_features, generator=gen) * 0.01 + 1e-4
    pqs = torch.rand(in_features, generator=gen) * 1.5 + 0.25 if with_pqs else None
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    return q, scales, pqs, bias


SHAPES = [(1728, 576), (3072, 576), (576, 1536), (72, 640), (40, 200), (7, 6)]  # SmolLM2-like; rows past the
# last 32-row AMX block; odd small ones
SHAPE_IDS = ["x".join(map(str, s)) for s in SHAPES]


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True], ids=["plain", "bias"])
def test_int8_linear_matches_exact_dot_products(shape, num_tokens, dtype, with_bias):
    weight, scales, _, bias = make_layer(*shape, with_pqs=False, with_bias=with_bias, seed=num_tokens + shape[0])
    x = (torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens)) * 3).to(dtype)
    y = int8_linear(x, weight, scales, bias)
    w = (weight.float() * scales[:, None]).double()  # the reference's float32 dequantized weight
    exact = x.double() @ w.T + (0 if bias is None else bias.double())
    bound = 2e-6 * (x.double().abs() @ w.abs().T) + 1e-7
    if dtype == torch.bfloat16:
        # the output's rounding, and on AVX2 CPUs x as block floating point int16 (blocks of 64 columns,
        # at most 2^-16 of the block's max |x| per column)
        x_max = x.double().abs()
        if shape[1] % 64 == 0:
            x_max = x_max.reshape(num_tokens, -1, 64).amax(-1, keepdim=True).expand(-1, -1, 64).reshape(num_tokens, -1)
        bound = bound + 2.0 ** -8 * exact.abs() + 2.0 ** -16 * (x_max @ w.abs().T)
    assert y.dtype == dtype and y.shape == exact.shape
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"max error {float(err.max()):.3g}, max excess {float((err - bound).max()):.3g}"
    tol = dict(atol=1e-3, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(y, int8_linear_reference(x, weight, scales, bias), **tol)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("num_tokens", [1, 3, 17, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "pqs+bias"])
def test_int8_sq_linear_is_bit_exact(shape, num_tokens, dtype, extras):
    weight, scales, pqs, bias = make_layer(*shape, with_pqs=extras, with_bias=extras, seed=num_tokens + shape[1])
    x = (torch.randn(num_tokens, shape[1], generator=torch.Generator().manual_seed(num_tokens)) * 3).to(dtype)
    input_scale = torch.tensor(0.025)  # |x| / 0.025 reaches past 127: saturation is exercised too
    y = int8_sq_linear(x, weight, scales, input_scale, pqs, bias)
    expected = int8_sq_linear_reference(x, weight, scales, input_scale, pqs, bias)
    assert y.dtype == dtype
    assert torch.equal(y, expected)


@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
@pytest.mark.parametrize("num_tokens", [1, 3, 4, 17, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extras", [False, True], ids=["plain", "pqs+bias"])
def test_int8_sq_linear_per_token_is_bit_exact(shape, num_tokens, dtype, extras):
    """per_token (version 2): rows of very different magnitudes, one all zero, each quantized with its own
    amax / 127 -- bit-exact with the reference on the GEMV and the GEMM paths; input_scale is ignored."""
    weight, scales, pqs, bias = make_layer(*shape, with_pqs=extras, with_bias=extras, seed=num_tokens + shape[1])
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, shape[1], generator=gen) * torch.logspace(-3, 3, num_tokens)[:, None]
    x[num_tokens // 2] = 0.0
    x = x.to(dtype)
    y = int8_sq_linear(x, weight, scales, torch.tensor(0.025), pqs, bias, True)
    expected = int8_sq_linear_reference(x, weight, scales, torch.tensor(0.025), pqs, bias, per_token=True)
    assert y.dtype == dtype
    assert torch.equal(y, expected)
    assert torch.equal(y, int8_sq_linear(x, weight, scales, torch.tensor(7.0), pqs, bias, True))
    # Each row alone gives the same result (its scale depends on nothing else).
    assert torch.equal(y[-1:], int8_sq_linear(x[-1:].contiguous(), weight, scales, torch.tensor(1.0), pqs, bias, True))


def test_int8_sq_per_token_keeps_small_rows_that_a_tensor_scale_flushes():
    """The point of per-token scales: next to a row 1000x larger, a small row keeps ~8 bits with its own
    scale, while the shared per-tensor scale (set by the large row) rounds it to zero."""
    in_features = 64
    eye = torch.eye(in_features, dtype=torch.int8)
    x = torch.stack([torch.linspace(-1, 1, in_features) * 1000, torch.linspace(-1, 1, in_features)])
    per_tensor = int8_sq_linear(x, eye, torch.ones(in_features), x.abs().max() / 127, None, None)
    per_token = int8_sq_linear(x, eye, torch.ones(in_features), torch.tensor(1.0), None, None, True)
    assert torch.equal(per_tensor[1], torch.zeros(in_features))
    assert (per_token[1] - x[1]).abs().max() <= 0.5 / 127 + 1e-7


@pytest.mark.parametrize("num_tokens", [1, 5, 40])
def test_int8_sq_activation_rounding_ties_and_saturation(num_tokens):
    """x / input_scale landing exactly on .5 (both parities, both signs) and beyond +-128: an identity
    weight reads x_q * input_scale back, bit-exactly the reference's round-half-even and clamp."""
    in_features = 48
    base = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, 127.5, -127.5, -128.5, 300.0, -300.0, 0.0, -0.0,
                         3.25, -3.75])
    x = torch.stack([base.roll(t).repeat(3) for t in range(num_tokens)])  # [T, 48], all exactly representable
    input_scale = torch.tensor(0.5)
    x = x * input_scale  # x / input_scale gives back `base` exactly (a power-of-two scale)
    eye = torch.eye(in_features, dtype=torch.int8)
    y = int8_sq_linear(x, eye, torch.ones(in_features), input_scale, None, None)
    expected = quantize_int8_reference(x, input_scale).float() * input_scale
    assert torch.equal(y, expected)
    assert torch.equal(y, int8_sq_linear_reference(x, eye, torch.ones(in_features), input_scale, None, None))


def test_int8_sq_int32_accumulation_is_exact_at_the_extremes():
    """All products -128 x -128 over 1536 columns: 25,165,824 needs 25 bits -- exact in int32, and
    float32 holds it exactly too (a multiple of 2^14), so the output is exactly 25,165,824 * s."""
    in_features = 1536
    weight = torch.full((4, in_features), -128, dtype=torch.int8)
    x = torch.full((2, in_features), -1000.0)  # saturates to -128
    y = int8_sq_linear(x, weight, torch.ones(4), torch.tensor(1.0), None, None)
    assert torch.equal(y, torch.full((2, 4), 128.0 * 128.0 * in_features))


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_int8_linear_non_finite_activations_propagate(num_tokens):
    """An inf or NaN in x reaches every output it multiplies, as in the reference (the AVX2 bfloat16 GEMV
    turns x into int16 per block, which cannot hold them, and must hand such calls to the float32 kernel)."""
    weight, scales, _, _ = make_layer(24, 128, with_pqs=False, with_bias=False, seed=9)
    x = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(9))
    x[0, 5] = float("inf")
    x[-1, 100] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        y = int8_linear(x.to(dtype), weight, scales, None).float()
        expected = int8_linear_reference(x.to(dtype), weight, scales, None).float()
        assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.isinf(), expected.isinf())
        assert y.isnan().any()


def test_int8_linear_tiny_and_zero_activations():
    """Rows of x near float32's smallest normals (the AVX2 bfloat16 GEMV scales them by 2^134, past
    float32's largest power of two, in two exact steps) and all-zero rows: within a bfloat16 rounding of
    the reference, and exactly zero."""
    weight, scales, _, _ = make_layer(40, 128, with_pqs=False, with_bias=False, seed=12)
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 128, generator=gen)
    x[0] *= 1e-36
    x[1] = 0.0
    x[2, :64] *= 1e-30  # one tiny 64-column block beside a normal one
    x = x.bfloat16()
    y = int8_linear(x, weight, scales, None)
    expected = int8_linear_reference(x, weight, scales, None).float()
    torch.testing.assert_close(y[0].float() * 1e36, expected[0] * 1e36, atol=1e-2, rtol=2e-2)
    assert torch.equal(y[1], torch.zeros_like(y[1]))
    torch.testing.assert_close(y[2].float(), expected[2], atol=1e-2, rtol=2e-2)


def test_non_contiguous_x_and_empty_batch():
    weight, scales, pqs, bias = make_layer(64, 128, with_pqs=True, with_bias=True, seed=3)
    x = torch.randn(128, 5).T
    torch.testing.assert_close(int8_linear(x, weight, scales, bias), int8_linear_reference(x, weight, scales, bias),
                               atol=1e-4, rtol=1e-5)
    s_in = torch.tensor(0.01)
    assert torch.equal(int8_sq_linear(x, weight, scales, s_in, pqs, bias),
                       int8_sq_linear_reference(x, weight, scales, s_in, pqs, bias))
    assert int8_linear(torch.zeros(0, 128), weight, scales, None).shape == (0, 64)
    assert int8_sq_linear(torch.zeros(0, 128), weight, scales, s_in, None, None).shape == (0, 64)


BAD_INPUTS = [
    (dict(x=torch.zeros(2, 16, dtype=torch.float16)), "x must be float32 or bfloat16"),
    (dict(weight=torch.zeros(8, 16, dtype=torch.uint8)), "weight must be a 2-D int8 tensor"),
    (dict(x=torch.zeros(2, 15)), "x has 15 features but weight expects 16"),
    (dict(weight_scale=torch.ones(8, 1)), "weight_scale must be float32 \\[out_features=8\\]"),
    (dict(weight_scale=torch.ones(8, dtype=torch.float64)), "weight_scale must be float32"),
    (dict(bias=torch.zeros(9)), "bias must be \\[out_features=8\\]"),
    (dict(weight=torch.zeros(16, 8, dtype=torch.int8).T), "weight must be contiguous"),
]
BAD_IDS = ["x-dtype", "weight-dtype", "in-features", "scale-shape", "scale-dtype", "bias-shape", "weight-contiguous"]


def default_args():
    return dict(x=torch.zeros(2, 16), weight=torch.zeros(8, 16, dtype=torch.int8), weight_scale=torch.ones(8),
                bias=None)


@pytest.mark.parametrize("kwargs,message", BAD_INPUTS, ids=BAD_IDS)
def test_int8_linear_bad_inputs_raise_clear_errors(kwargs, message):
    args = {**default_args(), **kwargs}
    with pytest.raises(RuntimeError, match="kilnlm::int8_linear: " + message):
        int8_linear(args["x"], args["weight"], args["weight_scale"], args["bias"])


@pytest.mark.parametrize(
    "kwargs,message",
    BAD_INPUTS + [(dict(input_scale=torch.ones(2)), "input_scale must be a 0-dim float32"),
                  (dict(input_scale=torch.tensor(1.0, dtype=torch.float64)), "input_scale must be a 0-dim float32"),
                  (dict(pre_quant_scale=torch.ones(15)), "pre_quant_scale must be \\[in_features=16\\]")],
    ids=BAD_IDS + ["input-scale-shape", "input-scale-dtype", "pqs-shape"],
)
def test_int8_sq_linear_bad_inputs_raise_clear_errors(kwargs, message):
    args = {**default_args(), "input_scale": torch.tensor(1.0), "pre_quant_scale": None, **kwargs}
    with pytest.raises(RuntimeError, match="kilnlm::int8_sq_linear: " + message):
        int8_sq_linear(args["x"], args["weight"], args["weight_scale"], args["input_scale"], args["pre_quant_scale"],
                       args["bias"])


ISA_SCRIPT = r"""
import torch
from kilnlm.plugins import load_cpu_kernels, int8_linear_reference, int8_sq_linear_reference
load_cpu_kernels()
gen = torch.Generator().manual_seed(0)
for out_features, in_features in ((72, 200), (96, 576), (9, 40)):
    q = torch.randint(-128, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    s = torch.rand(out_features, generator=gen) * 0.01
    pqs, bias, s_in = torch.rand(in_features, generator=gen) + 0.5, torch.randn(out_features, generator=gen), torch.tensor(0.02)
    for num_tokens in (1, 2, 5, 40):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(num_tokens, in_features, generator=gen) * 2).to(dtype)
            tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)
            torch.testing.assert_close(torch.ops.kilnlm.int8_linear(x, q, s, bias), int8_linear_reference(x, q, s, bias), **tol)
            assert torch.equal(torch.ops.kilnlm.int8_sq_linear(x, q, s, s_in, pqs, bias),
                               int8_sq_linear_reference(x, q, s, s_in, pqs, bias))
print("ok")
"""


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "avx512bf16"])
def test_capped_isa_paths_match_reference(isa):
    """The scalar, AVX2, AVX-512-without-VNNI and AVX512-VNNI-without-AMX paths (forced with KILNLM_CPU_ISA
    in a fresh process; the tests above take the widest path the CPU has: AMX-INT8 tiles for int8_sq_linear
    from 3 tokens on CPUs with AMX, AVX512-VNNI from 4 on the others)."""
    env = dict(os.environ, KILNLM_CPU_ISA=isa)
    result = subprocess.run([sys.executable, "-c", ISA_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


class ToyQuantizedBlock(torch.nn.Module):
    """x -> int4 W4A16 projection (pre_quant_scale, bias) -> SmoothQuant W8A8 projection -> GELU -> weight-
    only W8A16 projection, weights as buffers: all three quantized GEMMs in one package."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(21)
        self.register_buffer("w_int4", pack_int4(torch.randint(-8, 8, (64, 64), generator=gen)))
        self.register_buffer("s_int4", torch.rand(64, 2, generator=gen) * 0.05)
        self.register_buffer("pqs_int4", torch.rand(64, generator=gen) + 0.5)
        self.register_buffer("b_int4", torch.randn(64, generator=gen))
        for prefix, (shape, extras) in {"sq": ((96, 64), True), "wo": ((64, 96), False)}.items():
            weight, scales, pqs, bias = make_layer(*shape, with_pqs=extras, with_bias=True, seed=len(prefix) + shape[0])
            self.register_buffer(f"w_{prefix}", weight)
            self.register_buffer(f"s_{prefix}", scales)
            self.register_buffer(f"b_{prefix}", bias)
            if pqs is not None:
                self.register_buffer(f"pqs_{prefix}", pqs)
        self.register_buffer("input_scale", torch.tensor(0.03))

    def forward(self, x):
        x = torch.ops.kilnlm.int4_linear(x, self.w_int4, self.s_int4, self.pqs_int4, self.b_int4, 32)
        h = torch.ops.kilnlm.int8_sq_linear(x, self.w_sq, self.s_sq, self.input_scale, self.pqs_sq, self.b_sq)
        return torch.ops.kilnlm.int8_linear(torch.nn.functional.gelu(h), self.w_wo, self.s_wo, self.b_wo)


def test_quantized_ops_compile_with_aot_inductor(tmp_path):
    """int4_linear, int8_sq_linear and int8_linear called from an AOTInductor package with a dynamic token
    count: the package equals eager execution for the export example, a generation step and a chunk."""
    model = ToyQuantizedBlock().eval()
    example = (torch.randn(5, 64),)
    with torch.no_grad():
        exported = torch.export.export(model, example, dynamic_shapes=({0: torch.export.Dim("num_tokens", max=512)},))
        package_path = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "quant.pt2"))
    compiled = torch._inductor.aoti_load_package(package_path)
    for num_tokens in (5, 1, 33):
        x = torch.randn(num_tokens, 64)
        with torch.no_grad():
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
