"""The Triton kernels of ``kilnlm::paged_attention`` (kilnlm.plugins.gpu) against the plain-torch reference,
run by Triton's interpreter on CPU tensors, and compiled ahead of time for sm_80 / sm_89 / sm_90.

The interpreter runs in one subprocess with ``TRITON_INTERPRET=1`` (Triton reads it when ``@triton.jit``
runs, at import; another test may already have imported triton in this process). The subprocess builds
every case with this directory's packed-batch factory, runs the kernels and the reference on separate
copies of the pool, and hands the tensors back; the tests below compare them.

Tolerances:
- Pools: bit-exact, for every format. Both sides rotate with the same float32 cos / sin (the launcher
  computes them with torch, as the reference does) and the same float32 operations (no FMA contraction,
  IEEE division), and round to bfloat16 / FP8 / int8 to nearest even.
- Outputs, float32 activations: atol = rtol = 1e-5 (float32 arithmetic in another order: the online
  softmax in the exp2 domain, the scales folded into q and the output; measured max 1e-6).
- Outputs, bfloat16 activations over a bfloat16 pool: atol 1e-5, rtol 2^-7. Under the interpreter these
  dots take float32 operands (its bfloat16 dots are broken, see kilnlm.plugins.gpu), so both sides round
  float32 results ~1e-6 apart to bfloat16: at most one rounding step apart (<= 2^-7 relative).
- Outputs, bfloat16 activations over an 8-bit pool: atol 2e-3, rtol 2^-7. These dots take float16
  operands, as on the GPU: q and the probabilities rounded to float16 (2^-11 relative) move outputs of
  magnitude ~1 by up to ~1e-3 (measured max 9.8e-4), then one bfloat16 step.
- Position-0 sweeps (RoPE is the identity there) read back every stored code: their outputs must be
  bit-exact too (q = 0 over one position: probability 1, exact in any operand dtype).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="the GPU kernels are Triton-language kernels: pip install 'kilnlm[gpu]'")

# By (activations, the attention dots' operand dtype under the interpreter).
OUT_TOLERANCE = {("float32", "float32"): dict(atol=1e-5, rtol=1e-5),
                 ("bfloat16", "float32"): dict(atol=1e-5, rtol=2**-7),
                 ("bfloat16", "float16"): dict(atol=2e-3, rtol=2**-7)}

# (num_cached, num_new): a first context chunk, generation tokens (one at a block boundary), a context chunk
# after cached KV that spans two query tiles, lengths that no block size here divides.
MIXED = [(0, 11), (9, 1), (5, 40), (6, 7), (23, 1), (15, 1)]
SMALL = dict(num_heads=4, num_kv_heads=2, head_dim=32, tokens_per_block=8, num_blocks=40)


def batch_case(seqs, act, kv, **shape):
    return dict(kind="batch", seqs=seqs, act=act, kv=kv, shape={**SMALL, **shape})


CASES = {
    **{f"mixed-{act}-pool-{kv}": batch_case(MIXED, act, kv)
       for act in ("float32", "bfloat16") for kv in (act, "fp8", "int8")},
    # Generation only (T == B: the 16-row tile), GQA group 3 as SmolLM2 (9 / 3 heads), head_dim 64.
    "decode-gqa3-bfloat16": batch_case([(13, 1), (30, 1), (7, 1), (64, 1)], "bfloat16", "bfloat16",
                                       num_heads=9, num_kv_heads=3, head_dim=64, tokens_per_block=16),
    "decode-gqa3-fp8": batch_case([(13, 1), (30, 1), (7, 1), (64, 1)], "float32", "fp8",
                                  num_heads=9, num_kv_heads=3, head_dim=64, tokens_per_block=16),
    # Multi-head attention (group 1) and group 4, one context chunk spanning several query tiles.
    "mha-float32": batch_case([(3, 20), (17, 1)], "float32", "float32", num_heads=2, num_kv_heads=2),
    "gqa4-int8": batch_case([(0, 37), (12, 1)], "bfloat16", "int8", num_heads=8, num_kv_heads=2),
    # One sequence: a context chunk alone, a first token alone.
    "single-context-chunk-bfloat16-fp8": batch_case([(0, 45)], "bfloat16", "fp8"),
    "single-first-token-float32": batch_case([(0, 1)], "float32", "float32"),
    # head_dim not a power of two (padded tiles, rotate_half across the padding), 20-token blocks.
    "head-dim-40-fp8": batch_case(MIXED, "float32", "fp8", head_dim=40, tokens_per_block=20),
    "head-dim-40-bfloat16": batch_case(MIXED, "bfloat16", "bfloat16", head_dim=40, tokens_per_block=20),
    # q, k, v slices of one fused QKV projection (non-contiguous rows).
    "strided-qkv-bfloat16": {**batch_case(MIXED, "bfloat16", "bfloat16"), "strided": True},
    "strided-qkv-int8": {**batch_case(MIXED, "float32", "int8"), "strided": True},
    # Every FP8 value, the midpoints between neighbours and the floats either side of them, values past
    # ±448 and below the smallest subnormal, written at position 0 and read back (kv_scale 1 and 0.37).
    # Float32 activations: float32 dots; bfloat16 activations (the sweep rounded to bfloat16): float16 dots
    # and the integer-only FP8 / int8 -> float16 decoders.
    **{f"sweep-{kv}-scale{scale}-{act}": dict(kind="sweep", kv=kv, scale=scale, act=act)
       for kv in ("fp8", "int8") for scale in (1.0, 0.37) for act in ("float32", "bfloat16")},
}
# The TensorRT plugins' kernels (paged_kv_write, paged_attention_core), launched with TensorRT's AOT ABI as a
# plan launches them (paged_attention_tensorrt_abi): every pool format, both activation dtypes, GQA 3, a
# head_dim that is not a power of two, fused-QKV slices (made contiguous, as TensorRT hands them over).
TENSORRT_ABI_CASES = ("mixed-float32-pool-float32", "mixed-bfloat16-pool-bfloat16", "mixed-float32-pool-fp8",
                      "mixed-bfloat16-pool-int8", "decode-gqa3-bfloat16", "head-dim-40-fp8", "strided-qkv-bfloat16")
CASES.update({f"tensorrt-abi-{name}": {**CASES[name], "abi": "tensorrt"} for name in TENSORRT_ABI_CASES})

INTERPRETER_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from conftest import _make_packed_batch
from kilnlm.plugins.gpu import paged_attention_tensorrt_abi, paged_attention_triton
from kilnlm.plugins.reference import KV_CACHE_QMAX, paged_attention_reference

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int8": torch.int8}

def batch(spec):
    act, kv = DTYPES[spec["act"]], spec["kv"]
    b = _make_packed_batch([tuple(s) for s in spec["seqs"]], dtype=torch.float32, **spec["shape"])
    kv_scale = None
    if DTYPES[kv] in KV_CACHE_QMAX:
        kv_scale = b.to_8bit_pool(DTYPES[kv])
    else:
        b.kv_cache = b.kv_cache.to(act)
    b.q, b.k, b.v = b.q.to(act), b.k.to(act), b.v.to(act)
    if spec.get("strided"):
        t = b.q.shape[0]
        fused = torch.cat([x.reshape(t, -1) for x in (b.q, b.k, b.v)], dim=1)
        q, k, v = fused.split([b.q[0].numel(), b.k[0].numel(), b.v[0].numel()], dim=1)
        b.q, b.k, b.v = q.view(b.q.shape), k.view(b.k.shape), v.view(b.v.shape)
        assert not b.q.is_contiguous()
    return b, kv_scale

def sweep_values(kv):
    if kv == "fp8":
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
        values = codes.view(torch.float8_e4m3fn).float()
        values = values[values.isfinite()].unique()  # 253 values: -448..448, one zero
        mids = (values[1:] + values[:-1]) / 2
        extra = torch.tensor([449.0, 464.0, 480.0, 1e6, 1e30, 2.0**-10, 3 * 2.0**-10, 2.0**-12, 1e-30])
        extra = torch.cat([extra, -extra])
    else:
        mids = torch.arange(-130, 131, dtype=torch.float32) + 0.5
        values = torch.arange(-130, 131, dtype=torch.float32)
        extra = torch.tensor([1e6, -1e6, 1e-30, -1e-30])
    ups, downs = torch.nextafter(mids, torch.tensor(float("inf"))), torch.nextafter(mids, torch.tensor(float("-inf")))
    return torch.cat([values, mids, ups, downs, extra])

def sweep(spec):
    # One sequence per token, each token at position 0 (cos 1, sin 0: k is written unrotated) over 2 KV
    # heads of head_dim 64; q = 0, so each output row is the token's own V read back. Values times the
    # scale, so the division by it lands on (or next to) the listed values.
    kv = spec["kv"]
    values = sweep_values(kv)
    per_token = 2 * 64
    num_tokens = -(-values.numel() // per_token)
    values = torch.cat([values, values.new_zeros(num_tokens * per_token - values.numel())])
    b = _make_packed_batch([(0, 1)] * num_tokens, num_heads=2, num_kv_heads=2, head_dim=64, tokens_per_block=8,
                           num_blocks=num_tokens, num_layers=1, layer_idx=0)
    act = DTYPES[spec["act"]]
    b.v = (values * spec["scale"]).view(num_tokens, 2, 64).to(act)
    b.k = (values * spec["scale"]).flip(0).view(num_tokens, 2, 64).contiguous().to(act)
    b.q = torch.zeros_like(b.q).to(act)
    b.kv_cache = torch.zeros(b.kv_cache.shape, dtype=DTYPES[kv])
    return b, torch.tensor([spec["scale"], spec["scale"]])

results = {}
for name, spec in json.loads(sys.argv[3]).items():
    b, kv_scale = batch(spec) if spec["kind"] == "batch" else sweep(spec)
    pool_kernel, pool_ref = b.kv_cache.clone(), b.kv_cache.clone()
    kernel = paged_attention_tensorrt_abi if spec.get("abi") == "tensorrt" else paged_attention_triton
    out = kernel(*b.args(pool_kernel), kv_scale)
    expected = paged_attention_reference(*b.args(pool_ref), kv_scale)
    results[name] = dict(out=out, expected=expected, pool_kernel=pool_kernel, pool_ref=pool_ref,
                         pool_before=b.kv_cache)
# The CUDA registration, here rather than in the pytest process (whose dispatcher other tests share).
from kilnlm.plugins.gpu import register_cuda_kernels
register_cuda_kernels()
register_cuda_kernels()  # idempotent
results["cuda_kernel_registered"] = torch._C._dispatch_has_kernel_for_dispatch_key("kilnlm::paged_attention", "CUDA")
torch.save(results, sys.argv[2])
print("ok")
"""


@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> dict:
    """Runs every case of CASES under TRITON_INTERPRET=1 in one subprocess; returns case -> tensors."""
    path = tmp_path_factory.mktemp("triton_interpret") / "results.pt"
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", INTERPRETER_SCRIPT, str(Path(__file__).parent), str(path),
                             json.dumps(CASES)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-4000:]
    return torch.load(path)


def assert_pools_equal(pool_kernel: torch.Tensor, pool_ref: torch.Tensor) -> None:
    """Bit-exact, every element (compares the bytes: FP8 has no equality kernel, NaN codes compare too)."""
    assert pool_kernel.dtype == pool_ref.dtype and pool_kernel.shape == pool_ref.shape
    a, b = pool_kernel.view(torch.uint8), pool_ref.view(torch.uint8)
    diff = (a != b).sum().item()
    assert diff == 0, f"{diff} of {a.numel()} pool bytes differ"


def dot_dtype(spec) -> str:
    """The attention dots' operand dtype the launcher picks for this case under the interpreter."""
    from kilnlm.plugins.gpu import AttentionShape, attention_dot_dtype

    shape = AttentionShape(spec["shape"]["num_heads"], spec["shape"]["num_kv_heads"], spec["shape"]["head_dim"],
                           spec["shape"]["tokens_per_block"], act_dtype=spec["act"], kv_format=spec["kv"])
    return attention_dot_dtype(shape, interpreted=True)


@pytest.mark.parametrize("case", [name for name, spec in CASES.items() if spec["kind"] == "batch"])
def test_packed_batch_matches_reference(interpreted, case):
    result, spec = interpreted[case], CASES[case]
    out, expected = result["out"], result["expected"]
    assert out.dtype == expected.dtype and out.shape == expected.shape
    torch.testing.assert_close(out, expected, **OUT_TOLERANCE[spec["act"], dot_dtype(spec)])
    assert_pools_equal(result["pool_kernel"], result["pool_ref"])
    # The write touched the pool (so the comparison above is not vacuous).
    assert not torch.equal(result["pool_kernel"].view(torch.uint8), result["pool_before"].view(torch.uint8))


@pytest.mark.parametrize("case", [name for name, spec in CASES.items() if spec["kind"] == "sweep"])
def test_every_code_quantizes_and_reads_back_exactly(interpreted, case):
    """Round to nearest even at every tie, saturation, subnormals; each output row is the stored V read
    back (q = 0 over one position), so the decode is checked exactly too."""
    result = interpreted[case]
    assert_pools_equal(result["pool_kernel"], result["pool_ref"])
    assert torch.equal(result["out"], result["expected"])


def test_cuda_kernel_registers_idempotently(interpreted):
    """register_cuda_kernels (called twice in the subprocess) gives kilnlm::paged_attention a CUDA kernel."""
    assert interpreted["cuda_kernel_registered"] is True


def test_interpreted_cases_cover_phases_formats_and_groups():
    """The matrix this file promises: both phases in one batch, every pool format with both activation
    dtypes, GQA groups 1 to 4, a head_dim that is not a power of two."""
    batches = [s for s in CASES.values() if s["kind"] == "batch"]
    assert {(s["act"], s["kv"]) for s in batches} >= {(a, k) for a in ("float32", "bfloat16")
                                                       for k in (a, "fp8", "int8")}
    assert {s["shape"]["num_heads"] // s["shape"]["num_kv_heads"] for s in batches} >= {1, 2, 3, 4}
    mixed = [s for s in batches if any(n == 1 for _, n in s["seqs"]) and any(n > 1 for _, n in s["seqs"])]
    assert mixed and any(s["shape"]["head_dim"] & (s["shape"]["head_dim"] - 1) for s in batches)


# ---------------------------------------------------------------------------------------------------------
# In this process: no interpreter, no GPU
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", [80, 89, 90])
def test_compiles_ahead_of_time_for_each_arch(arch):
    """``triton.compile`` for sm_80 / sm_89 / sm_90 without a GPU (Triton's wheel ships ptxas): PTX for the
    arch and a cubin (an ELF) per kernel, for the bfloat16, FP8 and int8 pools (FP8 decoded in software:
    Triton has no float8e4nv type on sm_80)."""
    import dataclasses

    from kilnlm.plugins.gpu import DEFAULT_AOT_SHAPE, compile_for

    for kv_format in ("bfloat16", "fp8", "int8"):
        compiled = compile_for(arch, dataclasses.replace(DEFAULT_AOT_SHAPE, kv_format=kv_format))
        assert set(compiled) == {"rope_kv_write", "paged_attention_decode", "paged_attention_prefill"}
        for name, kernel in compiled.items():
            assert f".target sm_{arch}" in kernel["ptx"], (name, kv_format)
            assert kernel["cubin"][:4] == b"\x7fELF" and len(kernel["cubin"]) > 1000, (name, kv_format)
            assert kernel["metadata"]["arch"] == arch and kernel["metadata"]["num_warps"] == 4
    # Bfloat16 activations use tensor-core dots: mma.sync (sm_80 / sm_89), wgmma (sm_90) for the prefill tile.
    prefill_ptx = compiled["paged_attention_prefill"]["ptx"]
    assert ("wgmma.mma_async" if arch == 90 else "mma.sync.aligned") in prefill_ptx


@pytest.mark.parametrize("arch", [80, 89, 90])
def test_tensorrt_plugin_kernels_compile_with_tensorrts_parameter_order(arch):
    """The TensorRT plugins' kernels compile for each arch, and each PTX entry takes exactly the plugin's
    input pointers, its int32 scalars and its output pointers (TensorRT's AOT launch order), then Triton's two
    scratch pointers, with no global scratch to allocate (TensorRT would not)."""
    import dataclasses
    import re

    from kilnlm.plugins.gpu import DEFAULT_AOT_SHAPE, tensorrt_kernels

    abi = {"paged_kv_write": (7, 1, 1), "paged_attention_core": (8, 2, 1)}  # (inputs, int32 scalars, outputs)
    for kv_format in ("bfloat16", "fp8", "int8"):
        kernels = tensorrt_kernels(dataclasses.replace(DEFAULT_AOT_SHAPE, kv_format=kv_format), 0.125, 64)
        assert set(kernels) == set(abi)
        for name, kernel in kernels.items():
            compiled = kernel.compile(arch)
            assert f".target sm_{arch}" in compiled["ptx"] and compiled["cubin"][:4] == b"\x7fELF", (name, kv_format)
            entry = re.search(r"\.entry\s+(\w+)\s*\((.*?)\)", compiled["ptx"], re.S)
            assert entry.group(1) == compiled["name"]
            inputs, scalars, outputs = abi[name]
            assert entry.group(2).count(".param") == inputs + scalars + outputs + 2, (name, kv_format)
            assert entry.group(2).count(".param .u32") == scalars, (name, kv_format)
            assert compiled["global_scratch_bytes"] == 0 and compiled["num_warps"] == 4


def test_float32_activations_compile_with_ieee_dots():
    import dataclasses

    from kilnlm.plugins.gpu import DEFAULT_AOT_SHAPE, compile_for

    compiled = compile_for(80, dataclasses.replace(DEFAULT_AOT_SHAPE, act_dtype="float32", kv_format="float32"))
    ptx = compiled["paged_attention_prefill"]["ptx"]
    assert "mma" not in ptx and "fma.rn.f32" in ptx  # IEEE float32 dots (no TF32 tensor cores)
    write_ptx = compiled["rope_kv_write"]["ptx"]
    assert "fma" not in write_ptx  # the rotation is not contracted (bit-exact pool writes)




@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda a: a.update(q=a["q"].double()), "q must be float32 or bfloat16"),
        (lambda a: a.update(k=a["k"].to(torch.bfloat16)), "k and v must be q's dtype"),
        (lambda a: a.update(kv_cache=a["kv_cache"].to(torch.bfloat16)), "kv_cache must be q's dtype"),
        (lambda a: a.update(kv_scale=torch.ones(2)), "must be an 8-bit pool"),
        (lambda a: a.update(kv_cache=a["kv_cache"].to(torch.int8), kv_scale=torch.ones(3)), r"kv_scale must be \[2\]"),
        (lambda a: a.update(slot_mapping=a["slot_mapping"].int()), "slot_mapping must be"),
        (lambda a: a.update(layer_idx=2), "layer_idx 2 is out of range"),
        (lambda a: a.update(inv_freq=a["inv_freq"][:10]), "inv_freq must have head_dim / 2"),
        (lambda a: a.update(kv_cache=a["kv_cache"].transpose(4, 5)), "kv_cache must be"),
    ],
    ids=["q-dtype", "k-dtype", "pool-dtype", "scale-without-8-bit-pool", "scale-shape", "slot-dtype", "layer",
         "inv-freq", "pool-layout"],
)
def test_bad_inputs_raise_before_any_launch(make_packed_batch, mutate, message):
    from kilnlm.plugins.gpu import paged_attention_triton

    batch = make_packed_batch([(0, 5), (10, 1)], num_heads=4, num_kv_heads=2, head_dim=32, num_blocks=8)
    names = ["q", "k", "v", "kv_cache", "layer_idx", "positions", "inv_freq", "cu_seqlens_q", "seq_lens_kv",
             "block_tables", "slot_mapping", "scale"]
    args = dict(zip(names, batch.args()), kv_scale=None)
    mutate(args)
    with pytest.raises(ValueError, match=message):
        paged_attention_triton(**args)
