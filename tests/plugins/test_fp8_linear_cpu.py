"""The C++ fp8_linear kernel: bit-exact activation quantization and FP8 decoding, and the GEMM within
float32 rounding of ``(x_q.float() @ w.float().T) * scale`` -- on both the generation-phase GEMV path
(T <= 16) and the tiled context-phase path, with in_features not a multiple of the vector width."""

from __future__ import annotations

import pytest
import torch

from factories import BATCH_INVARIANT_CPU_FLAGS, BATCH_INVARIANT_SKIP_REASON, cpu_has, random_fp8_weight

from kilnlm.plugins.reference import fp8_linear_reference, quantize_fp8_reference

pytestmark = pytest.mark.usefixtures("cpu_kernels")

fp8_linear = torch.ops.kilnlm.fp8_linear


@pytest.mark.parametrize("num_tokens", [1, 3, 16, 17, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_is_bit_exact(num_tokens, dtype):
    """With an identity weight, y = x_q * input_scale exactly: the kernel's E4M3 rounding, saturation and
    subnormals equal torch's ``(x.float() / s).clamp(-448, 448).to(float8_e4m3fn)``."""
    gen = torch.Generator().manual_seed(num_tokens)
    in_features = 40
    x = torch.randn(num_tokens, in_features, generator=gen) * torch.logspace(-4, 3, in_features)
    x[0, :4] = torch.tensor([1e9, -1e9, 0.0, -0.0])  # saturation, signed zero
    x = x.to(dtype)
    input_scale, weight_scale = torch.tensor(0.37), torch.tensor(1.0)
    eye = torch.eye(in_features).to(torch.float8_e4m3fn)
    y = fp8_linear(x, eye, weight_scale, input_scale, None)
    expected = (quantize_fp8_reference(x, input_scale).float() * input_scale).to(dtype)
    assert y.dtype == dtype
    assert torch.equal(y, expected)
    assert torch.equal(y, fp8_linear_reference(x, eye, weight_scale, input_scale, None))


def e4m3_ties() -> torch.Tensor:
    """Every value exactly halfway between two neighbouring E4M3 magnitudes (round-to-nearest-even cases)."""
    codes = torch.arange(0, 0x7E, dtype=torch.uint8)  # finite, below the maximum 448 (0x7E)
    values = codes.view(torch.float8_e4m3fn).float()
    nxt = (codes + 1).view(torch.float8_e4m3fn).float()
    return (values + nxt) / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_bit_exact_over_a_sweep_of_float_bit_patterns(dtype):
    """~1.2M float32 bit patterns from 0 to 512 (every 1021st), both signs, all RNE ties, infinities."""
    patterns = torch.arange(0, int(torch.tensor(512.0).view(torch.int32)), 1021, dtype=torch.int32).view(torch.float32)
    special = torch.tensor([float("inf"), -float("inf"), 448.0, 464.0, 2.0 ** -6, 2.0 ** -9, 2.0 ** -10])
    x = torch.cat([patterns, -patterns, e4m3_ties(), -e4m3_ties(), special])
    x = torch.cat([x, x.new_zeros(-x.numel() % 64)]).reshape(-1, 64).to(dtype)  # [T, 64]
    one = torch.tensor(1.0)
    y = fp8_linear(x, torch.eye(64).to(torch.float8_e4m3fn), one, one, None)
    expected = quantize_fp8_reference(x, one).float().to(dtype)
    assert torch.equal(y, expected)
    # Generation-phase sizes take the vector path's scalar tail too.
    y_small = fp8_linear(x[:3, :37].contiguous(), torch.eye(37).to(torch.float8_e4m3fn), one, one, None)
    assert torch.equal(y_small, expected[:3, :37])


@pytest.fixture(params=[False, True], ids=["ieee", "flush_denormal"])
def flush_denormal(request):
    """Runs a test as is and with flush-to-zero / denormals-are-zero set in this thread's MXCSR
    (``torch.set_flush_denormal``): the AVX2 GEMV converts weights to (possibly denormal) float32 by
    shifts, and takes its F16C conversion where denormals would be flushed."""
    if request.param and not torch.set_flush_denormal(True):
        pytest.skip("this CPU has no flush-denormal mode")
    yield request.param
    torch.set_flush_denormal(False)


@pytest.mark.parametrize("num_tokens", [1, 4, 16, 32])
def test_every_fp8_weight_byte_decodes_exactly(num_tokens, flush_denormal):
    """One-hot activations read the weight back: all 254 finite E4M3 encodings decode bit-exactly, through
    the generation-phase GEMV (1 and 4 tokens: a whole 16-row block and 8 tail rows) and the context-phase
    tiles (16 and 32 tokens), also with denormals flushed (subnormal E4M3 values are normal float32)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[codes & 0x7F == 0x7F] = 0  # the two NaN encodings
    rows = codes.reshape(8, 32)
    weight = torch.cat([rows, rows.flip(0), rows.flip(1)]).view(torch.float8_e4m3fn)  # [out=24, in=32]
    eye = torch.eye(32)
    for c0 in range(0, 32, num_tokens):
        y = fp8_linear(eye[c0:c0 + num_tokens], weight, torch.tensor(1.0), torch.tensor(1.0), None)  # [T, 24]
        assert torch.equal(y, weight.float().T[c0:c0 + num_tokens])


@pytest.mark.parametrize("num_tokens", [1, 2, 5, 16, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("in_features", [200, 576])
def test_matches_fp32_matmul_of_quantized_operands(num_tokens, dtype, with_bias, in_features, flush_denormal):
    """in_features 200 = 6 x 32 + 8: the vector blocks and a scalar tail; 576 (SmolLM2's): the GEMV's
    64-column order, and on AMX CPUs the context tiles on AMX."""
    gen = torch.Generator().manual_seed(7 * num_tokens + with_bias)
    out_features = 72
    x = (torch.randn(num_tokens, in_features, generator=gen) * 3).to(dtype)
    weight = random_fp8_weight(out_features, in_features, gen)
    input_scale, weight_scale = torch.tensor(0.05), torch.tensor(0.003)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    y = fp8_linear(x, weight, weight_scale, input_scale, bias)
    x_q = quantize_fp8_reference(x, input_scale)
    exact = (x_q.double() @ weight.double().T) * (input_scale.double() * weight_scale.double())
    if bias is not None:
        exact = exact + bias.double()
    expected = fp8_linear_reference(x, weight, weight_scale, input_scale, bias)
    assert y.dtype == dtype and y.shape == (num_tokens, out_features)
    # float32: a few ulps of the accumulated magnitude; bfloat16: the final rounding (~2 bf16 ulps).
    magnitude = (x_q.double().abs() @ weight.double().abs().T) * float(input_scale * weight_scale)
    if dtype == torch.float32:
        assert ((y.double() - exact).abs() <= 1e-6 * magnitude + 1e-6).all()
    else:
        torch.testing.assert_close(y.float(), expected.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("num_tokens", [1, 16, 17, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_per_row_weight_scales_match_the_reference(num_tokens, dtype):
    """weight_scale [out_features] (version 2, the per-part scales of a fused linear): every output row
    is scaled by its own scale, on the GEMV and the tiled paths; float32 bit-exact with the reference's
    per-row product, and equal (up to summation order) to running each row block with its 0-dim scale."""
    gen = torch.Generator().manual_seed(11 * num_tokens)
    in_features, out_features = 200, 72
    x = (torch.randn(num_tokens, in_features, generator=gen) * 3).to(dtype)
    weight = random_fp8_weight(out_features, in_features, gen)
    weight_scale = torch.cat([torch.full((40,), 0.003), torch.full((32,), 0.0007)])
    input_scale = torch.tensor(0.05)
    y = fp8_linear(x, weight, weight_scale, input_scale, None)
    expected = fp8_linear_reference(x, weight, weight_scale, input_scale, None)
    if dtype == torch.float32:
        torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(y.float(), expected.float(), atol=1e-2, rtol=1e-2)
    # Equal up to the summation order: past the GEMV (T > 16 on CPUs without AVX512-BF16) the tiles go
    # through at::mm, whose blocking over K may differ between a 72-row and a 40-row weight.
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.0, rtol=2.0 ** -7)
    for rows, scale in ((slice(0, 40), 0.003), (slice(40, 72), 0.0007)):
        alone = fp8_linear(x, weight[rows].contiguous(), torch.tensor(scale), input_scale, None)
        torch.testing.assert_close(y[:, rows], alone, **tol)


def test_smollm2_shaped_generation_gemv():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 576, generator=gen)
    weight = random_fp8_weight(3072, 576, gen)
    scales = torch.tensor(0.02), torch.tensor(0.01)
    y = fp8_linear(x, weight, scales[1], scales[0], None)
    torch.testing.assert_close(y, fp8_linear_reference(x, weight, scales[1], scales[0], None), atol=1e-4, rtol=1e-5)


def test_empty_batch():
    weight = torch.zeros(8, 16).to(torch.float8_e4m3fn)
    y = fp8_linear(torch.zeros(0, 16), weight, torch.tensor(1.0), torch.tensor(1.0), None)
    assert y.shape == (0, 8)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(x=torch.zeros(2, 16, dtype=torch.float64)), "x must be float32 or bfloat16"),
        (dict(weight=torch.zeros(8, 16, dtype=torch.bfloat16)), "weight must be a 2-D float8_e4m3fn"),
        (dict(x=torch.zeros(2, 15)), "x has 15 features but weight expects 16"),
        (dict(input_scale=torch.tensor([1.0, 2.0])), "input_scale must be a 0-dim float32"),
        (dict(weight_scale=torch.tensor(1.0, dtype=torch.float64)), "weight_scale must be a 0-dim or \\[out_features=8\\] float32"),
        (dict(weight_scale=torch.ones(7)), "weight_scale must be a 0-dim or \\[out_features=8\\] float32"),
        (dict(bias=torch.zeros(7)), "bias must be \\[out_features=8\\]"),
    ],
    ids=["x-dtype", "weight-dtype", "in-features", "scale-shape", "scale-dtype", "weight-scale-rows", "bias-shape"],
)
def test_bad_inputs_raise_clear_errors(kwargs, message):
    args = dict(x=torch.zeros(2, 16), weight=torch.zeros(8, 16).to(torch.float8_e4m3fn),
                weight_scale=torch.tensor(1.0), input_scale=torch.tensor(1.0), bias=None)
    args.update(kwargs)
    with pytest.raises(RuntimeError, match=message):
        fp8_linear(args["x"], args["weight"], args["weight_scale"], args["input_scale"], args["bias"])


@pytest.mark.skipif(not cpu_has(*BATCH_INVARIANT_CPU_FLAGS), reason=BATCH_INVARIANT_SKIP_REASON)
@pytest.mark.parametrize("out_features,in_features", [(960, 576), (576, 1536), (48, 96)])
@pytest.mark.parametrize("op", ["fp8_linear", "fp8_rowwise_linear"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_alone_and_in_any_batch(op, out_features, in_features, dtype, monkeypatch):
    """Batch invariance (issue 26, item 4): each row of a call over M rows equals the same row computed
    alone, across the GEMV / tile boundary (4 / 5 tokens with AVX512-BF16) and far past it; SmolLM2's
    shapes (in_features a multiple of 64: the GEMV's interleaved column order, which the VDPBF16PS tiles
    take too) and one with in_features 96 (natural order). Activations with an outlier channel; float32
    outputs show any difference in the float32 sums, bfloat16 ones (the engines') only those that cross a
    rounding step. fp8_linear's context tiles run on AMX where the CPU has AMX-BF16, summing in the tiles'
    order: there it is invariant with KILNLM_BATCH_INVARIANT=1 (the VDPBF16PS tiles), which this sets."""
    if op == "fp8_linear" and cpu_has("amx_bf16"):
        monkeypatch.setenv("KILNLM_BATCH_INVARIANT", "1")
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(300, in_features, generator=gen) * 3.0
    x[:, 7] *= 60.0  # one channel far past the others: x_q spans E4M3's range, down to its finest steps
    x = x.to(dtype)
    w = torch.randn(out_features, in_features, generator=gen) * 0.05
    row_scale = w.abs().amax(1) / 448  # as the builder scales: every row spans E4M3's whole range
    weight = (w / row_scale[:, None]).to(torch.float8_e4m3fn)
    bias = torch.randn(out_features, generator=gen)
    if op == "fp8_linear":
        run = lambda rows: fp8_linear(rows, weight, row_scale, torch.tensor(0.5), bias)  # noqa: E731
    else:
        run = lambda rows: torch.ops.kilnlm.fp8_rowwise_linear(rows, weight, row_scale, bias)  # noqa: E731
    alone = torch.cat([run(x[i:i + 1]) for i in range(64)])
    for num_rows in (2, 4, 5, 8, 17, 64, 300):
        batch = run(x[:num_rows])[:64]
        n = min(num_rows, 64)
        differing = (~(batch[:n] == alone[:n]).all(1)).nonzero().flatten().tolist()
        assert not differing, f"M={num_rows}: rows {differing} differ from the same rows alone"
