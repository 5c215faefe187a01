"""The C++ paged-attention kernel with an 8-bit KV pool (float8_e4m3fn / int8 with per-layer
``kv_scale = [k_scale, v_scale]``) against the plain-torch reference.

What is compared: the stored bytes of the written slots (kernel vs reference quantization of the same
rotated keys and values) and the attention output. Tolerances: a stored element may differ by one
quantization step where RoPE's float32 cos/sin (libm vs torch) differ by an ulp right at a rounding
boundary (allowed for at most 0.5% of the written elements); outputs atol/rtol 2e-5 in float32 (the
kernel folds the scales: scores ``(q * k_scale) . stored_k`` instead of ``q . (stored_k * k_scale)``, a
float32 rounding difference; measured max 8e-7) and 1e-2 in bfloat16 (as the 16-bit pool tests).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kilnlm.plugins.reference import KV_CACHE_QMAX, fitting_kv_scale, paged_attention_reference, quantize_kv_pool_reference

pytestmark = pytest.mark.usefixtures("cpu_kernels")

KV_DTYPES = list(KV_CACHE_QMAX)  # float8_e4m3fn, int8
OUT_TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}

# (num_cached, num_new): context chunks (first, after cached KV, longer than a 16-token query chunk),
# generation tokens (one at a block boundary): the kernel's context (AVX-512, block conversion) and
# generation (AVX2, direct 8-bit loads) paths in one batch.
MIXED = [(0, 20), (37, 1), (20, 13), (5, 40), (63, 1), (31, 1)]


def quantized_batch(make_packed_batch, seqs, kv_dtype, act_dtype, **kwargs):
    """A packed batch whose pool holds quantized random K/V, with scales that fit its new K/V."""
    batch = make_packed_batch(seqs, dtype=torch.float32, **kwargs)
    kv_scale = batch.to_8bit_pool(kv_dtype)
    batch.q, batch.k, batch.v = batch.q.to(act_dtype), batch.k.to(act_dtype), batch.v.to(act_dtype)
    return batch, kv_scale


def run_both(batch, kv_scale):
    pool_kernel, pool_ref = batch.kv_cache.clone(), batch.kv_cache.clone()
    out = torch.ops.kilnlm.paged_attention(*batch.args(pool_kernel), kv_scale)
    expected = paged_attention_reference(*batch.args(pool_ref), kv_scale)
    return out, expected, pool_kernel, pool_ref


def assert_pools_match(pool_kernel, pool_ref, kv_dtype):
    """Equal except for rare one-step rounding-boundary differences (see the module docstring)."""
    a, b = pool_kernel.view(torch.int8) if kv_dtype == torch.int8 else pool_kernel, pool_ref
    if kv_dtype == torch.float8_e4m3fn:
        # Adjacent E4M3 values of one sign have adjacent byte codes.
        a, b = pool_kernel.view(torch.uint8).to(torch.int16), pool_ref.view(torch.uint8).to(torch.int16)
    else:
        a, b = a.to(torch.int16), b.to(torch.int16)
    diff = (a - b).abs()
    assert int(diff.max()) <= 1, f"pool elements differ by up to {int(diff.max())} quantization steps"
    assert int((diff != 0).sum()) <= max(4, diff.numel() // 200)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["fp8", "int8"])
@pytest.mark.parametrize("act_dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("group", [1, 3], ids=["mha", "gqa3"])
def test_mixed_batch_matches_reference(make_packed_batch, kv_dtype, act_dtype, group):
    batch, kv_scale = quantized_batch(make_packed_batch, MIXED, kv_dtype, act_dtype, num_heads=3 * group,
                                      num_kv_heads=3, head_dim=64, tokens_per_block=16)
    out, expected, pool_kernel, pool_ref = run_both(batch, kv_scale)
    assert out.dtype == act_dtype and out.shape == batch.q.shape
    assert pool_kernel.dtype == kv_dtype
    assert_pools_match(pool_kernel, pool_ref, kv_dtype)
    torch.testing.assert_close(out, expected, **OUT_TOLERANCE[act_dtype])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["fp8", "int8"])
@pytest.mark.parametrize("seqs", [[(100 + 13 * b, 1) for b in range(12)], [(0, 100)]], ids=["decode-batch", "context"])
def test_generation_and_context_batches(make_packed_batch, kv_dtype, seqs):
    batch, kv_scale = quantized_batch(make_packed_batch, seqs, kv_dtype, torch.bfloat16, num_heads=9, num_kv_heads=3,
                                      num_blocks=160, tokens_per_block=32)
    out, expected, pool_kernel, pool_ref = run_both(batch, kv_scale)
    assert_pools_match(pool_kernel, pool_ref, kv_dtype)
    torch.testing.assert_close(out, expected, **OUT_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["fp8", "int8"])
def test_split_kv_decode(make_packed_batch, num_threads, kv_dtype):
    """A batch-1 decode step on 2 threads: the 3 KV-head items are split along their KV blocks (split-KV)
    and the parts merged; the 8-bit pools' v_scale applies once, at the merge."""
    num_threads(2)
    batch, kv_scale = quantized_batch(make_packed_batch, [(200, 1)], kv_dtype, torch.bfloat16, num_heads=9,
                                      num_kv_heads=3, num_blocks=160, tokens_per_block=16)
    out, expected, pool_kernel, pool_ref = run_both(batch, kv_scale)
    assert_pools_match(pool_kernel, pool_ref, kv_dtype)
    torch.testing.assert_close(out, expected, **OUT_TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("head_dim", [40, 72], ids=["d40", "d72"])
def test_vector_tails(make_packed_batch, head_dim):
    """head_dim not a multiple of the 16-float vector: the scalar FP8 decode runs the tails."""
    batch, kv_scale = quantized_batch(make_packed_batch, [(0, 19), (29, 1), (5, 3)], torch.float8_e4m3fn,
                                      torch.float32, num_heads=4, num_kv_heads=2, head_dim=head_dim)
    out, expected, pool_kernel, pool_ref = run_both(batch, kv_scale)
    assert_pools_match(pool_kernel, pool_ref, torch.float8_e4m3fn)
    torch.testing.assert_close(out, expected, **OUT_TOLERANCE[torch.float32])


def test_saturation_and_rounding_rules(make_packed_batch):
    """Values beyond the calibrated range saturate (FP8 at ±448, int8 at [-128, 127]); int8 rounds half to
    even. A single token at position 0 (RoPE is the identity there) makes the written values exact."""
    for kv_dtype, expected_v in [(torch.float8_e4m3fn, [448.0, -448.0, 2.5, 0.0]),
                                 (torch.int8, [127.0, -128.0, 2.0, 0.0])]:
        batch = make_packed_batch([(0, 1)], num_heads=2, num_kv_heads=1, head_dim=4, dtype=torch.float32)
        batch.kv_cache = torch.zeros(batch.kv_cache.shape, dtype=kv_dtype)
        batch.v = torch.tensor([[[1000.0, -1000.0, 2.5, 0.0]]])
        pool = batch.kv_cache
        torch.ops.kilnlm.paged_attention(*batch.args(pool), torch.tensor([1.0, 1.0]))
        tpb = pool.shape[3]
        slot = int(batch.slot_mapping[0])
        stored = pool[batch.layer_idx, 1, slot // tpb, slot % tpb, 0].float()
        assert stored.tolist() == expected_v, (kv_dtype, stored)


# (activations, tokens per block, v_scale): float32 activations take the AVX-512 / AVX2 path; bfloat16 ones
# with 32-token blocks the AMX tiles where the CPU has them (its own FP8 -> bfloat16 conversion), with a
# power-of-two v_scale so that every decode(code) * v_scale / 2 is a bfloat16.
CODE_PATHS = [(torch.float32, 16, 0.375), (torch.bfloat16, 32, 0.25)]


@pytest.mark.parametrize("act_dtype, tpb, v_scale", CODE_PATHS, ids=["f32", "bf16-amx"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=["fp8", "int8"])
def test_every_stored_code_reads_back_exactly(kv_dtype, act_dtype, tpb, v_scale):
    """All 256 codes (FP8: the 254 finite ones, NaN codes replaced by 0) as cached V of a generation step
    with q = 0 and a zero new V: uniform weights over the two KV positions, so out = decode(code) * v_scale
    / 2 exactly -- the kernel's vector FP8 / int8 decode (with its folded 2^8) against torch's."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    if kv_dtype == torch.float8_e4m3fn:
        codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    num_kv_heads, head_dim = 4, 64
    pool = torch.zeros(1, 2, 2, tpb, num_kv_heads, head_dim, dtype=kv_dtype)
    pool.view(torch.uint8)[0, 1, 0, 0] = codes.reshape(num_kv_heads, head_dim)
    zeros = torch.zeros(1, num_kv_heads, head_dim, dtype=act_dtype)
    out = torch.ops.kilnlm.paged_attention(
        zeros, zeros, zeros, pool, 0, torch.tensor([1]), torch.ones(head_dim // 2), torch.tensor([0, 1], dtype=torch.int32),
        torch.tensor([2], dtype=torch.int32), torch.tensor([[0]], dtype=torch.int32), torch.tensor([1]), 0.125,
        torch.tensor([1.0, v_scale]))
    expected = codes.view(kv_dtype).float().reshape(num_kv_heads, head_dim) * v_scale / 2
    assert torch.equal(out[0].float(), expected)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, *KV_DTYPES], ids=["bf16", "fp8", "int8"])
def test_sequences_sharing_prefix_blocks_match_the_reference_and_each_alone(kv_dtype):
    """Decode tokens of sequences whose block tables share two full prefix blocks (as the prefix cache
    gives them), bf16 activations over 32-token blocks: the AMX path prepares a shared block once per thread
    and call (its K rows as bf16, its V tiles) and reuses it for every other sequence. Each sequence's
    output equals the reference and, bit for bit, the output of the same sequence decoded alone, where no
    block is seen twice."""
    gen = torch.Generator().manual_seed(3)
    H, Hkv, D, tpb, num_seqs, kv_len = 6, 2, 64, 32, 6, 100
    blocks_per_seq = (kv_len + tpb - 1) // tpb  # 2 shared + 2 of its own
    pool = torch.randn(1, 2, 2 + num_seqs * (blocks_per_seq - 2), tpb, Hkv, D, generator=gen)
    q, k, v = (torch.randn(num_seqs, h, D, generator=gen) for h in (H, Hkv, Hkv))
    kv_scale = None
    if kv_dtype != torch.bfloat16:
        kv_scale = fitting_kv_scale(torch.cat([pool[:, 0].flatten(), k.flatten()]),
                                    torch.cat([pool[:, 1].flatten(), v.flatten()]), kv_dtype)
        pool = quantize_kv_pool_reference(pool, kv_scale, kv_dtype)
    else:
        pool = pool.to(torch.bfloat16)
    q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
    tables = torch.tensor([[0, 1] + [2 + b * (blocks_per_seq - 2) + j for j in range(blocks_per_seq - 2)]
                           for b in range(num_seqs)], dtype=torch.int32)
    slots = torch.tensor([int(tables[b, (kv_len - 1) // tpb]) * tpb + (kv_len - 1) % tpb for b in range(num_seqs)])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))

    def attend(seqs, fn, kv_pool):
        n = len(seqs)
        return fn(q[seqs], k[seqs], v[seqs], kv_pool, 0, torch.full((n,), kv_len - 1), inv_freq,
                  torch.arange(n + 1, dtype=torch.int32), torch.full((n,), kv_len, dtype=torch.int32), tables[seqs],
                  slots[seqs], D ** -0.5, kv_scale)

    every = list(range(num_seqs))
    pool_kernel, pool_ref = pool.clone(), pool.clone()
    out = attend(every, torch.ops.kilnlm.paged_attention, pool_kernel)
    expected = attend(every, paged_attention_reference, pool_ref)
    torch.testing.assert_close(out.float(), expected.float(), **OUT_TOLERANCE[torch.bfloat16])
    for b in every:
        assert torch.equal(attend([b], torch.ops.kilnlm.paged_attention, pool.clone()), out[b:b + 1]), b


def test_sixteen_bit_pool_results_unchanged_by_the_new_argument(make_packed_batch):
    """kv_scale=None (and the 12-argument form older engines call) is the 16/32-bit pool, bit-identical."""
    batch = make_packed_batch(MIXED, dtype=torch.bfloat16)
    pool_a, pool_b = batch.kv_cache.clone(), batch.kv_cache.clone()
    out_a = torch.ops.kilnlm.paged_attention(*batch.args(pool_a))
    out_b = torch.ops.kilnlm.paged_attention(*batch.args(pool_b), None)
    assert torch.equal(out_a, out_b) and torch.equal(pool_a, pool_b)


def test_bad_combinations_are_refused(make_packed_batch):
    batch = make_packed_batch([(0, 3)], dtype=torch.bfloat16)
    fp8_pool = torch.zeros(batch.kv_cache.shape, dtype=torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="8-bit pool needs kv_scale"):
        torch.ops.kilnlm.paged_attention(*batch.args(fp8_pool))
    with pytest.raises(RuntimeError, match="must be an 8-bit pool"):
        torch.ops.kilnlm.paged_attention(*batch.args(), torch.tensor([1.0, 1.0]))
    with pytest.raises(RuntimeError, match=r"kv_scale must be \[2\]"):
        torch.ops.kilnlm.paged_attention(*batch.args(fp8_pool), torch.tensor([1.0, 1.0, 1.0]))
    with pytest.raises(RuntimeError, match="finite and positive"):
        torch.ops.kilnlm.paged_attention(*batch.args(fp8_pool), torch.tensor([0.0, 1.0]))


PORTABLE_SCRIPT = r"""
import torch
from kilnlm.plugins import KV_CACHE_QMAX, load_cpu_kernels, paged_attention_reference, quantize_kv_pool_reference
load_cpu_kernels()
gen = torch.Generator().manual_seed(0)
H, Hkv, D, tpb = 6, 2, 64, 16
for kv_dtype, qmax in KV_CACHE_QMAX.items():
    kv_scale = torch.tensor([4.0 / qmax, 3.0 / qmax])
    pool = quantize_kv_pool_reference(torch.randn(1, 2, 12, tpb, Hkv, D, generator=gen), kv_scale, kv_dtype)
    q, k, v = (torch.randn(21, h, D, generator=gen) for h in (H, Hkv, Hkv))
    positions = torch.cat([torch.arange(0, 20), torch.tensor([33])])
    block_tables = torch.tensor([[5, 2, 0], [7, 1, 9]], dtype=torch.int32)
    slots = [int(block_tables[0, p // tpb]) * tpb + p % tpb for p in range(20)] + [9 * tpb + 1]
    args = (0, positions, 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)),
            torch.tensor([0, 20, 21], dtype=torch.int32), torch.tensor([20, 34], dtype=torch.int32),
            block_tables, torch.tensor(slots), D ** -0.5, kv_scale)
    pool_ref = pool.clone()
    out = torch.ops.kilnlm.paged_attention(q, k, v, pool, *args)
    expected = paged_attention_reference(q, k, v, pool_ref, *args)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    assert (pool.view(torch.int8).int() - pool_ref.view(torch.int8).int()).abs().max() <= 1
print("ok")
"""


@pytest.mark.parametrize("isa", ["generic", "avx2"])
def test_capped_isa_paths_match_reference(isa):
    """The scalar (generic) and AVX2-only 8-bit paths, forced with KILNLM_CPU_ISA in a subprocess."""
    env = dict(os.environ, KILNLM_CPU_ISA=isa)
    result = subprocess.run([sys.executable, "-c", PORTABLE_SCRIPT], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("ok")
