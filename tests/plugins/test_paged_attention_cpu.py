"""The C++ paged-attention kernel against the plain-torch reference on packed, paged batches.

Tolerances: float32 atol/rtol 1e-5 (only summation order and libm cos/sin differ); bfloat16 atol/rtol
1e-2 on outputs (~2 bf16 ulps: both compute in float32, the kernel in another order, then round to bf16)
and on the written keys (RoPE's cos/sin may differ by a float32 ulp before rounding to bf16).
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kilnlm.plugins.reference import KV_CACHE_QMAX, paged_attention_reference

from factories import cpu_has

pytestmark = pytest.mark.usefixtures("cpu_kernels")

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}

# (num_cached, num_new): a first context chunk, generation tokens, context chunks after cached KV (one
# longer than the kernel's 16-token query chunk), a generation token at a block boundary.
MIXED = [(0, 20), (37, 1), (20, 13), (5, 40), (63, 1), (31, 1)]


def run_both(batch):
    """Runs the kernel and the reference on separate copies of the pool; returns both outputs and pools."""
    pool_kernel, pool_ref = batch.kv_cache.clone(), batch.kv_cache.clone()
    out = torch.ops.kilnlm.paged_attention(*batch.args(pool_kernel))
    expected = paged_attention_reference(*batch.args(pool_ref))
    return out, expected, pool_kernel, pool_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 3, 4, 8])  # the AVX2 kernel scores up to 3 heads of a group at once
@pytest.mark.parametrize("tokens_per_block", [16, 32])
def test_mixed_packed_batch_matches_reference(make_packed_batch, dtype, group, tokens_per_block):
    batch = make_packed_batch(MIXED, num_heads=3 * group, num_kv_heads=3, head_dim=64,
                              tokens_per_block=tokens_per_block, dtype=dtype)
    out, expected, pool_kernel, pool_ref = run_both(batch)
    assert out.dtype == dtype and out.shape == batch.q.shape
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(pool_kernel, pool_ref, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [2, 4, 5])
def test_decode_token_of_every_gqa_group_size(make_packed_batch, dtype, group):
    """One generation token over 71 cached positions (a partial last block): the group's heads are scored
    in threes and the rest."""
    batch = make_packed_batch([(71, 1)], num_heads=2 * group, num_kv_heads=2, head_dim=64, tokens_per_block=16,
                              dtype=dtype)
    out, expected, _, _ = run_both(batch)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_written_in_place_at_exactly_the_addressed_slots(make_packed_batch, dtype):
    batch = make_packed_batch(MIXED, dtype=dtype)
    pool = batch.kv_cache
    before = pool.clone()
    data_ptr = pool.data_ptr()
    torch.ops.kilnlm.paged_attention(*batch.args())
    assert pool.data_ptr() == data_ptr
    tpb = pool.shape[3]
    changed = (pool != before).any(dim=-1).any(dim=-1)  # [layers, 2, num_blocks, tpb]
    expected = torch.zeros_like(changed)
    slots = batch.slot_mapping
    expected[batch.layer_idx, :, slots // tpb, slots % tpb] = True
    assert torch.equal(changed, expected)
    # And what was written is v itself (unrotated, bit-exact) and k after RoPE.
    assert torch.equal(pool[batch.layer_idx, 1, slots // tpb, slots % tpb], batch.v)


def test_sequence_over_non_contiguous_blocks(make_packed_batch):
    batch = make_packed_batch([(60, 1), (50, 7)], tokens_per_block=16)
    # Scatter both sequences over hand-picked, interleaved, descending blocks.
    batch.block_tables[0, :4] = torch.tensor([41, 3, 17, 9], dtype=torch.int32)
    batch.block_tables[1, :4] = torch.tensor([30, 29, 2, 40], dtype=torch.int32)
    tpb = 16
    slots = [int(batch.block_tables[0, 60 // tpb]) * tpb + 60 % tpb]
    slots += [int(batch.block_tables[1, p // tpb]) * tpb + p % tpb for p in range(50, 57)]
    batch.slot_mapping = torch.tensor(slots, dtype=torch.int64)
    out, expected, pool_kernel, pool_ref = run_both(batch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(pool_kernel, pool_ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seqs", [[(100 + 13 * b, 1) for b in range(12)], [(0, 100)], [(0, 1)]],
                         ids=["decode-batch", "long-context-chunk", "first-token"])
def test_generation_only_and_context_only_batches(make_packed_batch, seqs):
    batch = make_packed_batch(seqs, num_heads=9, num_kv_heads=3, num_blocks=160)
    out, expected, _, _ = run_both(batch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_strided_q_k_v_from_a_fused_projection(make_packed_batch):
    batch = make_packed_batch(MIXED, num_heads=6, num_kv_heads=2)
    num_tokens = batch.q.shape[0]
    fused = torch.cat([batch.q.reshape(num_tokens, -1), batch.k.reshape(num_tokens, -1),
                       batch.v.reshape(num_tokens, -1)], dim=1)
    q, k, v = fused.split([6 * 64, 2 * 64, 2 * 64], dim=1)
    batch.q, batch.k, batch.v = q.view(num_tokens, 6, 64), k.view(num_tokens, 2, 64), v.view(num_tokens, 2, 64)
    assert not batch.q.is_contiguous()
    out, expected, _, _ = run_both(batch)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_prefill_then_generation_steps_match_reference(make_packed_batch):
    """A short generation loop: the kernel's and the reference's pools evolve identically step by step."""
    batch = make_packed_batch([(0, 19)], num_heads=6, num_kv_heads=2, tokens_per_block=16)
    pool_kernel, pool_ref = batch.kv_cache.clone(), batch.kv_cache.clone()
    gen = torch.Generator().manual_seed(5)
    for step in range(4):
        out = torch.ops.kilnlm.paged_attention(*batch.args(pool_kernel))
        expected = paged_attention_reference(*batch.args(pool_ref))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        # Next step: one generation token at the next position.
        position = int(batch.seq_lens_kv[0])
        batch.q, batch.k, batch.v = (torch.randn(1, h, 64, generator=gen) for h in (6, 2, 2))
        batch.positions = torch.tensor([position])
        batch.cu_seqlens_q = torch.tensor([0, 1], dtype=torch.int32)
        batch.seq_lens_kv = torch.tensor([position + 1], dtype=torch.int32)
        batch.slot_mapping = torch.tensor([int(batch.block_tables[0, position // 16]) * 16 + position % 16])
    torch.testing.assert_close(pool_kernel, pool_ref, atol=1e-5, rtol=1e-5)


# One sequence, at 2 and 4 threads (the thread count changes nothing): below split-KV's first cut at 256
# KV positions (decode at and across block boundaries, a context chunk after cached KV, a first chunk), and
# past it, where the parts' softmax states are merged: decode just before and past a cut, a context chunk
# across one, and a first chunk whose early queries see none of the later part's positions (a part whose
# max stays -inf for them).
SPLIT_CASES = [((63, 1), 16), ((64, 1), 16), ((199, 1), 16), ((300, 1), 32), ((100, 5), 16), ((0, 16), 4),
               ((255, 1), 16), ((511, 1), 32), ((250, 20), 16), ((0, 300), 4)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [2, 4])
@pytest.mark.parametrize("seq,tokens_per_block", SPLIT_CASES, ids=lambda c: str(c))
def test_split_kv_parts_merge_to_the_reference(make_packed_batch, num_threads, dtype, threads, seq, tokens_per_block):
    num_threads(threads)
    batch = make_packed_batch([seq], num_heads=9, num_kv_heads=3, tokens_per_block=tokens_per_block, num_blocks=160,
                              dtype=dtype)
    out, expected, pool_kernel, pool_ref = run_both(batch)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(pool_kernel, pool_ref, **TOLERANCE[dtype])


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda b: setattr(b, "q", b.q.double()), "q must be float32 or bfloat16"),
        (lambda b: setattr(b, "k", b.k.to(torch.bfloat16)), "k .* must be Float, got BFloat16"),
        (lambda b: setattr(b, "kv_cache", b.kv_cache.to(torch.bfloat16)), "kv_cache .* must be Float"),
        (lambda b: setattr(b, "slot_mapping", b.slot_mapping.to(torch.int32)), "slot_mapping .* must be Long"),
        (lambda b: b.slot_mapping.__setitem__(0, 64 * 16), "slot_mapping\\[0\\] = 1024 is out of range"),
        (lambda b: b.slot_mapping.__setitem__(1, -1), "slot_mapping\\[1\\] = -1 is out of range"),
        (lambda b: setattr(b, "layer_idx", 2), "layer_idx 2 is out of range"),
        (lambda b: b.block_tables.__setitem__((0, 0), 99), "block_tables\\[0, 0\\] = 99 is out of range"),
        (lambda b: b.seq_lens_kv.__setitem__(0, 2), "has 5 new tokens but seq_lens_kv = 2"),
        (lambda b: setattr(b, "inv_freq", b.inv_freq[:10]), "inv_freq must have head_dim / 2 = 32"),
        (lambda b: setattr(b, "kv_cache", b.kv_cache.transpose(2, 3)), "kv_cache must be"),
    ],
    ids=["q-dtype", "k-dtype", "pool-dtype", "slot-dtype", "slot-high", "slot-negative", "layer", "block",
         "kv-len", "inv-freq", "pool-layout"],
)
def test_bad_inputs_raise_clear_errors(make_packed_batch, mutate, message):
    batch = make_packed_batch([(0, 5), (10, 1)], num_blocks=64, tokens_per_block=16)
    mutate(batch)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.kilnlm.paged_attention(*batch.args())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,tokens_per_block", [(40, 16), (96, 8), (128, 20)])
def test_other_head_dims_and_block_sizes(make_packed_batch, dtype, head_dim, tokens_per_block):
    """Vector tails: head_dim not a multiple of 16 / 64, tokens_per_block not a multiple of 8."""
    batch = make_packed_batch(MIXED, num_heads=4, num_kv_heads=2, head_dim=head_dim,
                              tokens_per_block=tokens_per_block, num_blocks=64, dtype=dtype)
    out, expected, pool_kernel, pool_ref = run_both(batch)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])
    torch.testing.assert_close(pool_kernel, pool_ref, **TOLERANCE[dtype])


# Batch invariance (issue 26, item 4): long sequences that split-KV cuts into parts (1,000 KV positions
# = 4 parts of 256), sequences just either side of one cut, context chunks past 256 cached positions,
# generation tokens and a short first chunk, in one packed batch.
INVARIANCE_SEQS = [(1000, 1), (0, 40), (300, 17), (255, 1), (256, 1), (37, 1), (600, 33), (511, 2)]


def alone(batch, b: int):
    """Sequence ``b`` of ``batch`` as a batch of its own (same pool, same blocks)."""
    rows = slice(int(batch.cu_seqlens_q[b]), int(batch.cu_seqlens_q[b + 1]))
    return dataclasses.replace(
        batch, q=batch.q[rows], k=batch.k[rows], v=batch.v[rows], positions=batch.positions[rows],
        slot_mapping=batch.slot_mapping[rows], cu_seqlens_q=torch.tensor([0, rows.stop - rows.start], dtype=torch.int32),
        seq_lens_kv=batch.seq_lens_kv[b:b + 1], block_tables=batch.block_tables[b:b + 1])


# (activations, KV pool): the 16/32-bit pools and the 8-bit ones (to_8bit_pool).
INVARIANCE_POOLS = [(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, torch.int8),
                    (torch.bfloat16, torch.float8_e4m3fn)]


def to_8bit_pool(batch, kv_dtype: torch.dtype) -> tuple[torch.Tensor]:
    """Replaces batch's random pool by its kv_dtype codes, with scales that saturate its few values past 4
    standard deviations; returns the extra argument paged_attention then takes, ``(kv_scale,)``."""
    return (batch.to_8bit_pool(kv_dtype, torch.full((2,), 4.0 / KV_CACHE_QMAX[kv_dtype])),)


def check_batch_invariance(make_batch, thread_counts) -> None:
    """Every sequence's output rows are the same bits computed in the whole batch, alone, and at every
    thread count: what a sequence gets never depends on what else the call computes."""
    for dtype, kv_dtype in INVARIANCE_POOLS:
        for tokens_per_block in (16, 32):
            batch = make_batch(INVARIANCE_SEQS, num_heads=9, num_kv_heads=3, tokens_per_block=tokens_per_block,
                               num_blocks=256, dtype=dtype)
            kv_scale = () if kv_dtype is None else to_8bit_pool(batch, kv_dtype)
            results = []
            for threads in thread_counts:
                torch.set_num_threads(threads)
                whole = torch.ops.kilnlm.paged_attention(*batch.args(batch.kv_cache.clone()), *kv_scale)
                parts = [torch.ops.kilnlm.paged_attention(*alone(batch, b).args(batch.kv_cache.clone()), *kv_scale)
                         for b in range(len(INVARIANCE_SEQS))]
                results += [whole, torch.cat(parts)]
            for result in results[1:]:
                assert torch.equal(result, results[0]), (dtype, kv_dtype, tokens_per_block)


def test_a_sequence_gets_the_same_bits_alone_and_in_any_batch(make_packed_batch, num_threads):
    check_batch_invariance(make_packed_batch, (1, 2, 3))


def test_sequences_that_share_prefix_blocks_get_the_bits_they_get_alone(make_packed_batch, num_threads):
    """Cascade attention (paged_attention.cpp, share_prefixes): on AMX, decode and speculative-sized items whose
    first KV blocks are the same pool blocks go through those blocks together, 16 query vectors to a tile,
    and each goes on from its state there. Every sequence's rows must still be the bits it gets alone, at
    every thread count, and the reference's within the bf16 tolerance: sequences sharing 9 blocks (past
    split-KV's cut at 256 positions, so its second part is shared too), two sharing only 3 of them, a context
    chunk over the prefix (enough query vectors of its own: not grouped), and unrelated sequences."""
    tpb, shared_blocks = 32, 9
    seqs = ([(300 + 3 * b, 1) for b in range(12)] + [(295, 5)] * 3 + [(310, 1), (333, 1)] + [(288, 20)]
            + [(40 + 61 * b, 1) for b in range(4)])
    batch = make_packed_batch(seqs, num_heads=9, num_kv_heads=3, tokens_per_block=tpb, num_blocks=320,
                              dtype=torch.bfloat16)
    tables = batch.block_tables.clone()
    for b in range(1, 18):  # the first 18 sequences read sequence 0's first blocks (two of them only 3)
        n = 3 if seqs[b] in ((310, 1), (333, 1)) else shared_blocks
        tables[b, :n] = tables[0, :n]
    slots = [int(tables[b, p // tpb]) * tpb + p % tpb for b, (c, n) in enumerate(seqs) for p in range(c, c + n)]
    batch = dataclasses.replace(batch, block_tables=tables, slot_mapping=torch.tensor(slots, dtype=torch.int64))
    expected = paged_attention_reference(*batch.args(batch.kv_cache.clone()))
    results = []
    for threads in (1, 2, 3):
        torch.set_num_threads(threads)
        whole = torch.ops.kilnlm.paged_attention(*batch.args(batch.kv_cache.clone()))
        parts = [torch.ops.kilnlm.paged_attention(*alone(batch, b).args(batch.kv_cache.clone())) for b in range(len(seqs))]
        results += [whole, torch.cat(parts)]
    torch.testing.assert_close(results[0], expected, **TOLERANCE[torch.bfloat16])
    for result in results[1:]:
        assert torch.equal(result, results[0])


def one_token(batch, i: int):
    """Query token ``i`` of ``batch``'s one sequence as a decode step of its own (its KV positions up to and
    including it; same pool, same blocks)."""
    num_cached = int(batch.seq_lens_kv[0]) - len(batch.q)
    rows = slice(i, i + 1)
    return dataclasses.replace(
        batch, q=batch.q[rows], k=batch.k[rows], v=batch.v[rows], positions=batch.positions[rows],
        slot_mapping=batch.slot_mapping[rows], cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32),
        seq_lens_kv=torch.tensor([num_cached + i + 1], dtype=torch.int32))


# (cached, new): chunks across block boundaries (16 and 32 tokens) and across split-KV's cut at 256
CHUNK_SEQS = [(27, 6), (60, 9), (250, 12)]


@pytest.mark.parametrize("seq", CHUNK_SEQS, ids=str)
def test_a_chunk_gets_the_bits_of_decoding_its_tokens_one_at_a_time(make_packed_batch, num_threads, seq):
    """What speculative verification relies on: the output rows of k new tokens computed in one call (a
    context chunk, or a sequence's draft tokens) are the bits of k decode steps computing one each, for
    every pool, whatever kernel variant the CPU takes."""
    num_threads(2)
    for dtype, kv_dtype in INVARIANCE_POOLS:
        for tokens_per_block in (16, 32):
            batch = make_packed_batch([seq], num_heads=9, num_kv_heads=3, tokens_per_block=tokens_per_block,
                                      num_blocks=64, dtype=dtype)
            kv_scale = () if kv_dtype is None else to_8bit_pool(batch, kv_dtype)
            chunk = torch.ops.kilnlm.paged_attention(*batch.args(batch.kv_cache.clone()), *kv_scale)
            pool = batch.kv_cache.clone()
            steps = torch.cat([torch.ops.kilnlm.paged_attention(*one_token(batch, i).args(pool), *kv_scale)
                               for i in range(seq[1])])
            assert torch.equal(steps, chunk), (dtype, kv_dtype, tokens_per_block)


# What a fresh-process script needs first (KILNLM_CPU_ISA is read once per process): the kernels and this
# directory's fixtures.
SCRIPT_PREAMBLE = f"""
import importlib.util, sys, torch
import kilnlm.plugins as plugins
sys.path.insert(0, {str(Path(__file__).parents[1])!r})  # tests/: factories
plugins.load_cpu_kernels()
spec = importlib.util.spec_from_file_location("plugin_fixtures", {str(Path(__file__).with_name("conftest.py"))!r})
fixtures = importlib.util.module_from_spec(spec); sys.modules["plugin_fixtures"] = fixtures; spec.loader.exec_module(fixtures)
"""

INVARIANCE_SCRIPT = SCRIPT_PREAMBLE + f"""spec = importlib.util.spec_from_file_location("attention_tests", {str(Path(__file__))!r})
tests = importlib.util.module_from_spec(spec); sys.modules["attention_tests"] = tests; spec.loader.exec_module(tests)
tests.check_batch_invariance(fixtures._make_packed_batch, (1, 2))
print("ok")
"""


@pytest.mark.parametrize("isa", ["avx512bf16", "avx512", "avx2", "generic"])
def test_batch_invariance_on_the_capped_isa_paths(isa):
    """The VDPBF16PS kernel where the CPU also has AMX, the float32 AVX-512 kernel where it also has
    AVX512-BF16, the AVX2 kernel (a GQA group's heads scored 1-3 at a time) and the portable one, in a fresh
    process with KILNLM_CPU_ISA capping the paths (the ISA is chosen once per process)."""
    env = dict(os.environ, KILNLM_CPU_ISA=isa)
    result = subprocess.run([sys.executable, "-c", INVARIANCE_SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


def bf16_batch(make_batch, kv_dtype_name: str, tokens_per_block: int = 32):
    """The bf16-product tests' batch: bf16 activations and a bf16 pool or its 8-bit codes."""
    batch = make_batch(MIXED, num_heads=9, num_kv_heads=3, head_dim=64, tokens_per_block=tokens_per_block,
                       dtype=torch.bfloat16)
    return batch, () if kv_dtype_name == "bf16" else to_8bit_pool(batch, getattr(torch, kv_dtype_name))


BF16_SCRIPT = SCRIPT_PREAMBLE + f"""spec = importlib.util.spec_from_file_location("attention_tests", {str(Path(__file__))!r})
tests = importlib.util.module_from_spec(spec); sys.modules["attention_tests"] = tests; spec.loader.exec_module(tests)
batch, kv_scale = tests.bf16_batch(fixtures._make_packed_batch, sys.argv[2], int(sys.argv[3]))
torch.save(torch.ops.kilnlm.paged_attention(*batch.args(batch.kv_cache.clone()), *kv_scale), sys.argv[1])
"""


def outputs_under(isas: tuple[str, ...], tmp_path, kv_dtype_name: str, tokens_per_block: int) -> dict[str, torch.Tensor]:
    """bf16_batch's output in a fresh process per KILNLM_CPU_ISA cap (``native``: none)."""
    outputs = {}
    for isa in isas:
        env = {key: value for key, value in os.environ.items() if key != "KILNLM_CPU_ISA"}
        if isa != "native":
            env["KILNLM_CPU_ISA"] = isa
        path = tmp_path / f"{isa}.pt"
        result = subprocess.run([sys.executable, "-c", BF16_SCRIPT, str(path), kv_dtype_name, str(tokens_per_block)],
                                env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
        outputs[isa] = torch.load(path)
    return outputs


@pytest.mark.skipif(not cpu_has("amx_bf16", "amx_tile"), reason="this CPU has no AMX-BF16 tiles (or KILNLM_CPU_ISA caps them)")
@pytest.mark.parametrize("kv_dtype_name", ["bf16", "int8", "float8_e4m3fn"])
def test_bf16_attention_runs_on_amx_tiles(make_packed_batch, tmp_path, kv_dtype_name):
    """On AMX, bf16 activations with 32-token blocks of a bf16 or 8-bit pool take the AMX tiles (q and
    the probabilities rounded to bfloat16 into them, 8-bit codes converted exactly): within the bf16
    tolerance of the float32 reference, and neither the bits of the VDPBF16PS kernel (KILNLM_CPU_ISA=avx512bf16)
    nor those of the float32 AVX-512 kernel (=avx512), each picked in a fresh process -- so the path is there
    and is the one taken."""
    batch, kv_scale = bf16_batch(make_packed_batch, kv_dtype_name)
    out = torch.ops.kilnlm.paged_attention(*batch.args(batch.kv_cache.clone()), *kv_scale)
    expected = paged_attention_reference(*batch.args(batch.kv_cache.clone()), *kv_scale)
    torch.testing.assert_close(out, expected, **TOLERANCE[torch.bfloat16])
    outputs = outputs_under(("native", "avx512bf16", "avx512"), tmp_path, kv_dtype_name, 32)
    assert torch.equal(outputs["native"], out)
    for isa in ("avx512bf16", "avx512"):
        torch.testing.assert_close(outputs[isa], expected, **TOLERANCE[torch.bfloat16])
        assert not torch.equal(outputs["native"], outputs[isa]), isa


@pytest.mark.skipif(not cpu_has("avx512_bf16"), reason="this CPU has no AVX512-BF16 (or KILNLM_CPU_ISA caps it)")
@pytest.mark.parametrize("kv_dtype_name", ["bf16", "int8", "float8_e4m3fn"])
@pytest.mark.parametrize("tokens_per_block", [16, 32])
def test_bf16_attention_runs_on_vdpbf16ps(make_packed_batch, tmp_path, kv_dtype_name, tokens_per_block):
    """With AVX512-BF16 (KILNLM_CPU_ISA=avx512bf16 where the CPU also has AMX), bf16 activations over a bf16
    or 8-bit pool take the VDPBF16PS kernel (q and the probabilities rounded to bfloat16, float32 sums):
    within the bf16 tolerance of the float32 reference, and not the bits of the float32 AVX-512 kernel
    (KILNLM_CPU_ISA=avx512) -- so the path is there and is the one taken."""
    batch, kv_scale = bf16_batch(make_packed_batch, kv_dtype_name, tokens_per_block)
    expected = paged_attention_reference(*batch.args(batch.kv_cache.clone()), *kv_scale)
    outputs = outputs_under(("avx512bf16", "avx512"), tmp_path, kv_dtype_name, tokens_per_block)
    for isa in ("avx512bf16", "avx512"):
        torch.testing.assert_close(outputs[isa], expected, **TOLERANCE[torch.bfloat16])
    assert not torch.equal(outputs["avx512bf16"], outputs["avx512"])


# The kernel copies attention_kernels.h is compiled into (isa_variants.h's namespaces), each built on every x86-64.
ATTENTION_ISA_COPIES = ("generic", "avx2", "avx512", "avx512bf16", "amxbf16")


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the prefetches checked are x86-64 instructions")
def test_kv_block_prefetches_are_in_every_kernel_copy(cpu_kernels):
    """Each ISA copy of the attention kernel holds its KV block prefetches in the built library: prefetcht0
    (an item's first block, and the next block of an item of fewer than all KV heads) and prefetcht1 (the next
    block of an item of every KV head). GCC deletes a loop whose body only calls __builtin_prefetch, which once
    removed all of them without a trace (prefetch_l1 in plugins/csrc/attention_kernels.h)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed: nothing to disassemble the kernels' library with")
    listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", cpu_kernels], check=True, capture_output=True,
                             text=True).stdout
    found: dict[str, set[str]] = {isa: set() for isa in ATTENTION_ISA_COPIES}
    isa = None
    for line in listing.splitlines():
        symbol = re.match(r"[0-9a-f]+ <(.*)>:$", line)
        if symbol:
            copy = re.search(r"kiln_attn::(\w+)::\(anonymous namespace\)::attend", symbol.group(1))
            isa = copy.group(1) if copy else None
        elif isa in found:
            found[isa].update(re.findall(r"\bprefetcht[01]\b", line))
    assert found == {isa: {"prefetcht0", "prefetcht1"} for isa in ATTENTION_ISA_COPIES}
