"""InputBuilder: the packed EngineInputs of a batch, checked entry by entry against the ABI's definitions
(kilnlm.runtime.abi), for mixed batches (the vectorised path) and one-token-per-sequence batches (the
generation-step path), and for buffers reused across steps of both kinds."""

from __future__ import annotations

import numpy as np
import pytest

import factories
from kilnlm.runtime.inputs import InputBuilder, InputLimits
from kilnlm.runtime.kv_cache import KVCacheManager
from kilnlm.runtime.request import Request
from kilnlm.runtime.scheduler import ScheduledBatch, ScheduledSeq

TOKENS_PER_BLOCK = 4
LIMITS = InputLimits(max_num_tokens=64, max_batch_size=4, max_blocks_per_seq=8, tokens_per_block=TOKENS_PER_BLOCK)


def make_request(kv: KVCacheManager, request_id: int, num_tokens: int, num_computed: int) -> Request:
    """A request holding blocks for ``num_tokens`` tokens, ``num_computed`` of them already in the pool."""
    token_ids = [1000 + 7 * request_id + i for i in range(num_tokens)]
    request = factories.make_request(request_id, token_ids)
    assert kv.allocate(request_id, token_ids) is not None
    request.num_computed_tokens = num_computed
    return request


def expected(batch: ScheduledBatch, kv: KVCacheManager) -> dict[str, np.ndarray]:
    """The ABI's inputs for ``batch``, written out from their definitions one token at a time."""
    cu, ids, positions, slots, seq_lens, logits_rows = [0], [], [], [], [], []
    tables = np.zeros((len(batch.seqs), LIMITS.max_blocks_per_seq), dtype=np.int32)
    for b, seq in enumerate(batch.seqs):
        request, start = seq.request, seq.request.num_computed_tokens
        table = kv.block_table(request.request_id)
        tables[b, : len(table)] = table
        for p in range(start, start + seq.num_new_tokens):
            ids.append(request.token_ids[p])
            positions.append(p)
            slots.append(table[p // TOKENS_PER_BLOCK] * TOKENS_PER_BLOCK + p % TOKENS_PER_BLOCK)
        cu.append(cu[-1] + seq.num_new_tokens)
        seq_lens.append(start + seq.num_new_tokens)
        logits_rows.append(cu[-1] - 1)
    return dict(input_ids=np.array(ids), positions=np.array(positions), cu_seqlens_q=np.array(cu),
                seq_lens_kv=np.array(seq_lens), block_tables=tables, slot_mapping=np.array(slots),
                logits_indices=np.array(logits_rows))


def assert_inputs(builder: InputBuilder, batch: ScheduledBatch, kv: KVCacheManager) -> None:
    inputs = builder.build(batch, kv)
    dtypes = dict(input_ids=np.int64, positions=np.int64, cu_seqlens_q=np.int32, seq_lens_kv=np.int32,
                  block_tables=np.int32, slot_mapping=np.int64, logits_indices=np.int64)
    for name, want in expected(batch, kv).items():
        got = getattr(inputs, name).numpy()
        assert got.dtype == dtypes[name], name
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("num_seqs", [1, 3, 4])
def test_generation_step_batches(num_seqs):
    kv = factories.make_kv_cache_manager(64, TOKENS_PER_BLOCK)
    # Sequences of different lengths, the new token at a block's first, middle and last offset.
    requests = [make_request(kv, i + 1, n, n - 1) for i, n in enumerate([9, 6, 12, 3][:num_seqs])]
    assert_inputs(InputBuilder(LIMITS), ScheduledBatch([ScheduledSeq(r, 1) for r in requests]), kv)


def test_mixed_batches_then_generation_steps_reuse_the_buffers():
    """Steps of both kinds over the same builder: each step's inputs equal its own definition, whatever
    earlier steps left in the buffers (a longer block table in a row, other cu_seqlens_q)."""
    kv = factories.make_kv_cache_manager(64, TOKENS_PER_BLOCK)
    builder = InputBuilder(LIMITS)
    long_one = make_request(kv, 1, 29, 0)  # 8 blocks
    short = make_request(kv, 2, 5, 0)
    assert_inputs(builder, ScheduledBatch([ScheduledSeq(long_one, 16), ScheduledSeq(short, 5)]), kv)
    short.num_computed_tokens = 4
    third = make_request(kv, 3, 10, 9)
    # Row 0 now belongs to a 2-block sequence: the long table's other 6 entries must read 0 again.
    assert_inputs(builder, ScheduledBatch([ScheduledSeq(short, 1), ScheduledSeq(third, 1)]), kv)
    long_one.num_computed_tokens = 16
    assert_inputs(builder, ScheduledBatch([ScheduledSeq(third, 1), ScheduledSeq(long_one, 13)]), kv)
    long_one.num_computed_tokens = 28
    assert_inputs(builder, ScheduledBatch([ScheduledSeq(long_one, 1), ScheduledSeq(short, 1), ScheduledSeq(third, 1)]), kv)
    # A single-token context chunk is a one-token-per-sequence batch too.
    single = make_request(kv, 4, 1, 0)
    assert_inputs(builder, ScheduledBatch([ScheduledSeq(single, 1)]), kv)
