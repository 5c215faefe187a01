"""The C++ int4_linear kernel (W4A16) against exact float64 arithmetic on the reference's dequantized
weight and against ``int4_linear_reference``: generation-phase GEMV (up to 8 tokens with AVX512-BF16, 24
with AVX2's int16 GEMV, 16 for float32 x) and the context-phase tiled path beyond, SmolLM2-shaped and odd
small layers, group sizes 32 / 64 / 128 / per-channel / odd, pre_quant_scale, bias and zero points
(asymmetric groups), float32 and float16 scales, every nibble value, every ISA path (the AOTInductor test of
all three quantized GEMMs is in test_int8_linear_cpu.py).

Tolerances: float32 outputs must lie within 2e-6 x sum_c |x_c * w_c| of the float64 dot product of the
same float32 operands (the kernel only sums in another order: with in_features <= 1536 that is a few
float32 ulps of the accumulated magnitude). bfloat16 outputs are one rounding of such a float32 result:
within half a bfloat16 ulp (at most 2^-8 relative) of the exact value, plus the float32 bound; in the
context phase (T > 8) on CPUs with AVX512-BF16 the kernel multiplies bfloat16 tiles of (q - zero) * scale
with bfloat16 x * pre_quant_scale (VDPBF16PS), each operand rounded once (at most 2^-8 relative, bfloat16's
unit roundoff): another 2^-7 of the accumulated magnitude. On AVX2 CPUs the generation GEMV takes bfloat16 x as
block floating point int16 per group (15 significant bits for the group's largest values, finer than
bfloat16's 8): within the same bound for these activations.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kilnlm.plugins.reference import int4_linear_reference, pack_int4, unpack_int4
from factories import cpu_has

pytestmark = pytest.mark.usefixtures("cpu_kernels")

int4_linear = torch.ops.kilnlm.int4_linear


def make_layer(out_features: int, in_features: int, group_size: int, *, with_pqs: bool, with_bias: bool, seed: int):
    """Random packed weight (every nibble value), AWQ-like scales, optional pre_quant_scale and bias."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (out_features, in_features), generator=gen)
    scales = torch.rand(out_features, in_features // group_size, generator=gen) * 0.02 + 1e-3
    pqs = torch.rand(in_features, generator=gen) * 1.5 + 0.25 if with_pqs else None
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    return pack_int4(q), scales, pqs, bias


def make_zero_points(out_features: int, num_groups: int, seed: int) -> torch.Tensor:
    """Zero points of asymmetric groups: every value of [-8, 7]."""
    return torch.randint(-8, 8, (out_features, num_groups), generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


def dequantize(weight, scales, group_size, zero_point=None):
    """The reference's float32 weight (q - zero) * scale."""
    q = unpack_int4(weight).float()
    if zero_point is not None:
        q = q - zero_point.float().repeat_interleave(group_size, dim=1)
    return q * scales.repeat_interleave(group_size, dim=1)


def exact_and_magnitude(x, weight, scales, pqs, bias, group_size, zero_point=None):
    """float64 result of the float32 operands the kernel sees, and sum |x_c w_c| per output."""
    w = dequantize(weight, scales, group_size, zero_point).double()  # f32-rounded (q - zero) * s
    xs = (x.float() if pqs is None else x.float() * pqs).double()
    exact = xs @ w.T
    if bias is not None:
        exact = exact + bias.double()
    return exact, xs.abs() @ w.abs().T


def assert_matches(y, x, weight, scales, pqs, bias, group_size, zero_point=None):
    exact, magnitude = exact_and_magnitude(x, weight, scales, pqs, bias, group_size, zero_point)
    assert y.dtype == x.dtype and y.shape == exact.shape
    bound = 2e-6 * magnitude + 1e-7
    if y.dtype == torch.bfloat16:
        # the output rounding, and (context phase on AVX512-BF16 CPUs) the weight (q - zero) * scale and
        # the activation x * pre_quant_scale each rounded once to bfloat16: <= 2^-7 of the magnitude together
        bound = bound + 2.0 ** -8 * exact.abs() + 2.0 ** -7 * magnitude
    err = (y.double() - exact).abs()
    assert (err <= bound).all(), f"max error {float(err.max()):.3g}, max excess {float((err - bound).max()):.3g}"


SHAPES = [  # (out_features, in_features, group_size)
    (1728, 576, 64),    # SmolLM2 q/k/v-ish, AWQ group 64
    (3072, 576, 32),    # SmolLM2 gate_up
    (576, 1536, 128),   # SmolLM2 down
    (576, 1536, 1536),  # per-channel (group_size == in_features)
    (40, 200, 40),      # groups with a 8-column tail after a 32-column block, 40 rows
    (33, 352, 32),      # rows of 2.75 x 128 columns (a partial last load in the bf16 GEMV), 33 rows
    (7, 6, 6),          # smaller than one vector block
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("num_tokens", [1, 3, 5, 17, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("extras", ["plain", "pqs+bias", "zero-point", "float16-scales"])
def test_matches_exact_dot_products(shape, num_tokens, dtype, extras):
    """float16-scales: what the builder stores (with zero points, pre_quant_scale and bias); the exact
    result uses the same float16 values, widened. bfloat16 at 5 tokens: the AVX512-BF16 GEMV on CPUs that
    have it without AMX (up to 3 tokens take the int16 GEMV there too; with AMX, the tiles take 5), with
    rows split between threads."""
    out_features, in_features, group_size = shape
    with_pqs = extras != "plain"
    weight, scales, pqs, bias = make_layer(out_features, in_features, group_size, with_pqs=with_pqs, with_bias=with_pqs,
                                           seed=num_tokens + out_features)
    if extras == "float16-scales":
        scales = scales.half()
    with_zero_points = extras in ("zero-point", "float16-scales")
    zero_point = make_zero_points(out_features, in_features // group_size, num_tokens) if with_zero_points else None
    x = torch.randn(num_tokens, in_features, generator=torch.Generator().manual_seed(num_tokens)).to(dtype)
    y = int4_linear(x, weight, scales, pqs, bias, group_size, zero_point)
    assert_matches(y, x, weight, scales, pqs, bias, group_size, zero_point)
    if dtype == torch.float32:  # and the reference oracle itself (bf16: the bound above is the statement)
        torch.testing.assert_close(y, int4_linear_reference(x, weight, scales, pqs, bias, group_size, zero_point),
                                   atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 2, 4, 7, 16, 17, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero-point"])
@pytest.mark.parametrize("group_size", [32, 64])
@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float16])
def test_every_nibble_decodes_exactly(num_tokens, dtype, zero_points, group_size, scale_dtype):
    """One-hot activations read the weight back: (q - zero) * scale for all 16 values in both nibble
    positions, through the generation GEMV (bfloat16, up to 8 tokens, 3 with AMX: a 16-row block and 8
    tail rows) and the context tiles. Group 32: both 32-column halves of a 64-column GEMV load have their
    own scale and zero point; group 64: they share one table (and the bfloat16 tiles come straight from the
    nibbles, in chunk64 order)."""
    in_features = 128
    num_groups = in_features // group_size
    q = torch.arange(16).repeat(24, in_features // 16) - 8  # [24, 128]
    q = torch.stack([row.roll(i) for i, row in enumerate(q)])
    scales = torch.tensor([0.5, 0.25, 2.0, 0.125])[:num_groups].repeat(24, 1).to(scale_dtype)  # [24, num_groups]
    zero_point = None
    if zero_points:  # the extremes and different values in each 64-column chunk, varying by row
        zero_point = (torch.tensor([-8, 7, 3, -1])[:num_groups] + torch.arange(24)[:, None]) % 16 - 8
        zero_point = zero_point.to(torch.int8)
    expected = dequantize(pack_int4(q), scales, group_size, zero_point).T  # [128, 24]
    eye = torch.eye(in_features, dtype=dtype)
    for c0 in range(0, in_features, num_tokens):
        y = int4_linear(eye[c0:c0 + num_tokens], pack_int4(q), scales, None, None, group_size, zero_point)  # [T, 24]
        assert torch.equal(y, expected[c0:c0 + num_tokens].to(dtype))


@pytest.mark.skipif(not cpu_has("amx_bf16"), reason="the AMX context tiles (4 tokens on) sum each (token, row) in one "
                    "order at every token count; the other ISAs' context paths do not promise it")
@pytest.mark.parametrize("shape", [(72, 576, 64), (40, 1536, 128), (33, 384, 192)], ids=lambda s: "x".join(map(str, s)))
def test_amx_tiles_give_a_token_the_same_bits_at_every_token_count(shape):
    """The AMX path dequantizes a 32-row block's k chunk at a time (two columns steps when the block has one
    token pair, six when it has several; groups of 64 / 128 / 192 columns, so a chunk may start inside a
    group) and carries its sums across chunks in tile registers or in memory: each token's outputs must be
    the same bits whether it comes with 3 others or with 299 (part-filled 16-token blocks, one and several
    token pairs, past the 256-token pass), with float16 scales (widened per block) and zero points, in full
    blocks, a 40-row layer's 8-row last block and a 33-row layer's single-row one."""
    out_features, in_features, group_size = shape
    weight, scales, pqs, bias = make_layer(out_features, in_features, group_size, with_pqs=True, with_bias=True,
                                           seed=11)
    zero_point = make_zero_points(out_features, in_features // group_size, seed=12)
    x = torch.randn(300, in_features, generator=torch.Generator().manual_seed(13)).to(torch.bfloat16)
    y_all = int4_linear(x, weight, scales.half(), pqs, bias, group_size, zero_point)
    assert_matches(y_all, x, weight, scales.half(), pqs, bias, group_size, zero_point)
    for num_tokens in (4, 5, 16, 17, 32, 33, 64, 65, 200, 257):
        y = int4_linear(x[:num_tokens], weight, scales.half(), pqs, bias, group_size, zero_point)
        assert torch.equal(y, y_all[:num_tokens]), num_tokens


@pytest.mark.parametrize("num_tokens", [1, 2])
@pytest.mark.parametrize("zero_points", [False, True], ids=["symmetric", "zero-point"])
def test_largest_int16_group_sums_without_overflow(num_tokens, zero_points):
    """The AVX2 bfloat16 GEMV sums u * x16 in int32 over a whole group (u = q + 8 in [0, 15], |x16| < 2^15).
    At its largest group, 32768 columns, with every weight 7 (u = 15) and every activation at the group's
    maximum, a lane's sum is ~2.0e9, just under 2^31: the result must still be right (a wrapped sum would be
    off by its sign). Rows: all 7, all -8, alternating, and (with zero points) the extremes' offsets."""
    in_features = group_size = 32768
    q = torch.full((4, in_features), 7)
    q[1] = -8
    q[2, 1::2] = -8
    q[3, ::3] = -8
    scales = torch.tensor([[0.01], [0.02], [0.005], [0.03]])
    zero_point = torch.tensor([[-8], [7], [0], [-1]], dtype=torch.int8) if zero_points else None
    x = torch.full((num_tokens, in_features), 1.9921875, dtype=torch.bfloat16)  # x16 = 32640 for every column
    x[1:] = -x[1:]
    y = int4_linear(x, pack_int4(q), scales, None, None, group_size, zero_point)
    assert_matches(y, x, pack_int4(q), scales, None, None, group_size, zero_point)


@pytest.mark.parametrize("num_tokens", [1, 20])
def test_odd_group_size_takes_the_scalar_path(num_tokens):
    """group_size 3 splits bytes between groups: only the portable path handles it, still correctly."""
    weight, scales, pqs, bias = make_layer(10, 12, 3, with_pqs=True, with_bias=True, seed=5)
    x = torch.randn(num_tokens, 12)
    assert_matches(int4_linear(x, weight, scales, pqs, bias, 3), x, weight, scales, pqs, bias, 3)
    zero_point = make_zero_points(10, 4, seed=6)
    assert_matches(int4_linear(x, weight, scales, pqs, bias, 3, zero_point), x, weight, scales, pqs, bias, 3, zero_point)


@pytest.mark.parametrize("num_tokens", [1, 3])
def test_non_finite_activations_propagate(num_tokens):
    """An inf or NaN in x reaches every output it multiplies, as in the reference (the AVX2 bfloat16 GEMV
    turns x into int16 per group, which cannot hold them, and must hand such calls to the float32 kernel)."""
    weight, scales, pqs, bias = make_layer(24, 128, 64, with_pqs=False, with_bias=False, seed=9)
    x = torch.randn(num_tokens, 128, generator=torch.Generator().manual_seed(9))
    x[0, 5] = float("inf")
    x[-1, 100] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        y = int4_linear(x.to(dtype), weight, scales, None, None, 64).float()
        expected = int4_linear_reference(x.to(dtype).float(), weight, scales, None, None, 64)
        assert torch.equal(y.isnan(), expected.isnan()) and torch.equal(y.isinf(), expected.isinf())
        assert y.isnan().any()


def test_non_contiguous_x_and_bf16_bias():
    weight, scales, _, _ = make_layer(64, 128, 32, with_pqs=False, with_bias=False, seed=2)
    x = torch.randn(128, 5).T  # [5, 128], not contiguous
    bias = torch.randn(64).to(torch.bfloat16)
    y = int4_linear(x, weight, scales, None, bias, 32)
    assert_matches(y, x, weight, scales, None, bias.float(), 32)


def test_empty_batch():
    weight, scales, _, _ = make_layer(8, 32, 32, with_pqs=False, with_bias=False, seed=0)
    assert int4_linear(torch.zeros(0, 32), weight, scales, None, None, 32).shape == (0, 8)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(x=torch.zeros(2, 64, dtype=torch.float64)), "x must be float32 or bfloat16"),
        (dict(weight=torch.zeros(8, 32, dtype=torch.int8)), "weight must be a 2-D uint8 tensor"),
        (dict(x=torch.zeros(2, 62)), "x has 62 features but the packed weight holds 64"),
        (dict(group_size=48), "group_size 48 must be positive and divide in_features 64"),
        (dict(group_size=0), "group_size 0 must be positive"),
        (dict(weight_scale=torch.ones(8, 3)),
         "weight_scale must be float32 or float16 \\[out_features=8, in_features / group_size=2\\]"),
        (dict(weight_scale=torch.ones(8, 2, dtype=torch.float64)), "weight_scale must be float32 or float16"),
        (dict(pre_quant_scale=torch.ones(63)), "pre_quant_scale must be \\[in_features=64\\]"),
        (dict(bias=torch.zeros(7)), "bias must be \\[out_features=8\\]"),
        (dict(weight=torch.zeros(32, 8, dtype=torch.uint8).T), "weight must be contiguous"),
        (dict(weight_zero_point=torch.zeros(8, 2, dtype=torch.uint8)), "weight_zero_point must be int8"),
        (dict(weight_zero_point=torch.zeros(8, 1, dtype=torch.int8)),
         "weight_zero_point must be int8 \\[out_features=8, in_features / group_size=2\\]"),
    ],
    ids=["x-dtype", "weight-dtype", "in-features", "group-divides", "group-zero", "scale-shape", "scale-dtype",
         "pqs-shape", "bias-shape", "weight-contiguous", "zero-point-dtype", "zero-point-shape"],
)
def test_bad_inputs_raise_clear_errors(kwargs, message):
    args = dict(x=torch.zeros(2, 64), weight=torch.zeros(8, 32, dtype=torch.uint8), weight_scale=torch.ones(8, 2),
                pre_quant_scale=None, bias=None, group_size=32, weight_zero_point=None)
    args.update(kwargs)
    with pytest.raises(RuntimeError, match=message):
        int4_linear(*args.values())


ISA_SCRIPT = r"""
import torch
from kilnlm.plugins import load_cpu_kernels, pack_int4, int4_linear_reference
load_cpu_kernels()
gen = torch.Generator().manual_seed(0)
for out_features, in_features, group_size in ((72, 200, 40), (96, 576, 64), (16, 128, 128)):
    q = torch.randint(-8, 8, (out_features, in_features), generator=gen)
    s = torch.rand(out_features, in_features // group_size, generator=gen) * 0.02
    pqs, bias = torch.rand(in_features, generator=gen) + 0.5, torch.randn(out_features, generator=gen)
    zeros = torch.randint(-8, 8, (out_features, in_features // group_size), generator=gen, dtype=torch.int8)
    # any int8 zero point, beyond what q - zero's byte tables hold (|zero| > 120), the extremes in row 0
    wide_zeros = torch.randint(-128, 128, zeros.shape, generator=gen, dtype=torch.int8)
    wide_zeros[0, :] = torch.tensor([-128, 127, -121, 121])[torch.arange(zeros.shape[1]) % 4].to(torch.int8)
    for num_tokens in (1, 2, 5, 24, 25, 40):
        for dtype in (torch.float32, torch.bfloat16):
            for z, scales in ((None, s), (zeros, s), (zeros, s.half()), (wide_zeros, s)):
                x = torch.randn(num_tokens, in_features, generator=gen).to(dtype)
                y = torch.ops.kilnlm.int4_linear(x, pack_int4(q), scales, pqs, bias, group_size, z)
                tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=4e-2, rtol=1e-2)
                expected = int4_linear_reference(x, pack_int4(q), scales, pqs, bias, group_size, z)
                torch.testing.assert_close(y, expected, **tol)
print("ok")
"""


@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512bf16"])
def test_capped_isa_paths_match_reference(isa):
    """The scalar, AVX2 and AVX512-BF16 paths (forced with KILNLM_CPU_ISA in a fresh process; the default
    run above takes the widest path the CPU has), with zero points in [-8, 7] and anywhere in int8.
    avx512bf16 on an AMX CPU: the bf16 GEMV at 5 tokens and the AVX512-BF16 tiles at 40, which AMX takes
    otherwise."""
    env = dict(os.environ, KILNLM_CPU_ISA=isa)
    result = subprocess.run([sys.executable, "-c", ISA_SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")


INT16_COPIES_SCRIPT = r"""
import sys, torch
from kilnlm.plugins import load_cpu_kernels, pack_int4
load_cpu_kernels()
gen = torch.Generator().manual_seed(3)
outputs = []
for out_features, in_features, group_size in ((96, 576, 64), (40, 1536, 64), (40, 1536, 128), (24, 384, 192)):
    q = torch.randint(-8, 8, (out_features, in_features), generator=gen)
    s = torch.rand(out_features, in_features // group_size, generator=gen) * 0.02 + 1e-3
    pqs, bias = torch.rand(in_features, generator=gen) + 0.5, torch.randn(out_features, generator=gen)
    zeros = torch.randint(-8, 8, (out_features, in_features // group_size), generator=gen, dtype=torch.int8)
    for num_tokens in (1, 2, 3):
        x = (torch.randn(num_tokens, in_features, generator=gen) * 3).to(torch.bfloat16)
        for z, scales in ((None, s), (zeros, s), (zeros, s.half())):
            outputs.append(torch.ops.kilnlm.int4_linear(x, pack_int4(q), scales, pqs, bias, group_size, z))
torch.save(outputs, sys.argv[1])
"""


@pytest.mark.skipif(not cpu_has("avx512_bf16", "avx512_vnni"),
                    reason="the int16 GEMV's AVX512-VNNI copy serves bfloat16 x on CPUs with AVX512-BF16 and VNNI")
def test_int16_gemv_vnni_copy_sums_as_the_avx2_copy(tmp_path):
    """The int16 GEMV's AVX512-VNNI copy (VPDPWSSD) makes the same int32 sums as its AVX2 copy (VPMADDWD and
    VPADDD; KILNLM_CPU_ISA=avx2), so their outputs are bitwise equal: 1-3 tokens (where it serves bfloat16
    x), group sizes 64 (an odd and an even number of chunks: the 512-bit loop takes pairs) / 128 / 192,
    with and without zero points, float32 and float16 scales."""
    results = {}
    for name, cap in (("vnni", None), ("avx2", "avx2")):
        env = {k: v for k, v in os.environ.items() if k != "KILNLM_CPU_ISA"}
        if cap:
            env["KILNLM_CPU_ISA"] = cap
        path = tmp_path / f"{name}.pt"
        result = subprocess.run([sys.executable, "-c", INT16_COPIES_SCRIPT, str(path)], env=env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, result.stderr
        results[name] = torch.load(path)
    assert len(results["vnni"]) == 36
    for vnni, avx2 in zip(results["vnni"], results["avx2"]):
        assert torch.equal(vnni, avx2)
