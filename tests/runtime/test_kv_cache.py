"""Exact block accounting of the KV-cache manager on tiny pools (block ids, eviction order, ref counts), and
the pool's size in blocks from a byte budget."""

from __future__ import annotations

import pytest

from factories import make_kv_cache_manager
from kilnlm.runtime.errors import KilnError
from kilnlm.runtime.kv_cache import DEFAULT_MAX_KV_CACHE_BYTES, KVCacheConfig, KVCacheManager, num_kv_cache_blocks


def make_manager(num_blocks: int = 8, tokens_per_block: int = 4, prefix: bool = True) -> KVCacheManager:
    return make_kv_cache_manager(num_blocks, tokens_per_block, prefix)


def test_allocate_takes_blocks_in_order_and_free_returns_them():
    kv = make_manager()
    assert kv.allocate(1, list(range(10))) == 0  # 10 tokens -> 3 blocks, nothing cached yet
    assert kv.block_table(1) == [0, 1, 2]
    assert kv.allocate(2, list(range(100, 105))) == 0
    assert kv.block_table(2) == [3, 4]
    assert kv.num_free_blocks == 3
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 8
    kv.free(2)  # idempotent
    assert kv.num_free_blocks == 8


def test_allocate_refuses_without_side_effects_when_blocks_run_out():
    kv = make_manager(num_blocks=4)
    assert kv.allocate(1, list(range(12))) == 0
    assert kv.can_allocate(list(range(100, 104))) and not kv.can_allocate(list(range(100, 108)))
    assert kv.allocate(2, list(range(100, 108))) is None
    assert kv.num_free_blocks == 1 and not kv.has_blocks(2)


def test_append_slots_grows_block_table_at_block_boundaries():
    kv = make_manager(num_blocks=4)
    kv.allocate(1, [1, 2, 3, 4])
    assert kv.block_table(1) == [0]
    assert kv.append_slots(1, 4) and kv.block_table(1) == [0]
    assert kv.append_slots(1, 5) and kv.block_table(1) == [0, 1]
    assert kv.append_slots(1, 16) and kv.block_table(1) == [0, 1, 2, 3]
    assert not kv.append_slots(1, 17)
    assert kv.block_table(1) == [0, 1, 2, 3]


def test_prefix_hit_shares_blocks_and_skips_cached_tokens():
    kv = make_manager()
    prompt = list(range(10))  # blocks [0..3] [4..7] [8 9]
    kv.allocate(1, prompt)
    kv.cache_computed_blocks(1, prompt, 10)  # two full blocks become reusable
    assert kv.num_cached_blocks == 2
    # Same first 8 tokens, different tail: the two full blocks are shared.
    assert kv.allocate(2, prompt[:8] + [50, 51, 52]) == 8
    assert kv.block_table(2) == [0, 1, 3]
    # A prompt of exactly the cached blocks still computes its last token (needs its logits): 1 hit only.
    assert kv.allocate(3, prompt[:8]) == 4
    assert kv.block_table(3) == [0, 4]
    # A different first block: no hit even though the second block's tokens match.
    assert kv.allocate(4, [99, 1, 2, 3] + prompt[4:8] + [7]) == 0


def test_a_request_allocated_with_another_waits_for_the_shared_blocks_and_then_takes_them():
    """Requests that arrive together: the first allocated computes the shared blocks, the second waits for
    each of them and, once cached, takes them in place of its own (which return to the free queue)."""
    kv = make_manager(num_blocks=8)
    shared = list(range(8))  # two full blocks
    a, b = shared + [40, 41, 42], shared + [50, 51, 52, 53]
    kv.allocate(1, a)
    assert kv.allocate(2, b) == 0  # nothing cached yet: blocks [3, 4, 5]
    assert kv.num_free_blocks == 2
    assert not kv.waits_for_prefix(1, 0)  # request 1 computes the blocks
    assert kv.waits_for_prefix(2, 0)  # request 2's first block is being computed by request 1
    assert not kv.waits_for_prefix(2, 2)  # off a block boundary it has started its own
    kv.cache_computed_blocks(1, a, 4)  # request 1 computed its first block
    assert kv.reuse_computed_prefix(2, 0) == 4 and kv.block_table(2)[0] == kv.block_table(1)[0]
    assert kv.waits_for_prefix(2, 4)  # the second shared block is still being computed
    kv.cache_computed_blocks(1, a, 11)
    assert kv.reuse_computed_prefix(2, 4) == 8
    assert kv.block_table(2)[:2] == kv.block_table(1)[:2] and kv.num_free_blocks == 4  # its two back
    assert (kv.num_reused_blocks, kv.num_needed_blocks) == (2, 6)
    assert not kv.waits_for_prefix(2, 8) and kv.reuse_computed_prefix(2, 8) == 8  # its own tail
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 8


def test_a_request_stops_waiting_when_the_one_computing_its_prefix_goes():
    kv = make_manager(num_blocks=8)
    prompt = list(range(9))
    kv.allocate(1, prompt)
    kv.allocate(2, prompt + [9])
    assert kv.waits_for_prefix(2, 0)
    kv.free(1)  # cancelled or preempted before computing anything
    assert not kv.waits_for_prefix(2, 0) and kv.reuse_computed_prefix(2, 0) == 0
    kv.allocate(3, prompt + [10])  # request 2 registered nothing: no one computes for request 3 either
    assert not kv.waits_for_prefix(3, 0)


def test_freed_cached_blocks_are_reused_until_evicted_in_lru_order():
    kv = make_manager(num_blocks=7)
    a = list(range(9))  # 3 blocks, 2 of them full
    kv.allocate(1, a)
    kv.cache_computed_blocks(1, a, 9)
    kv.free(1)
    # Free queue: uncached block 2 at the front, cached blocks at the back, freed tail first:
    # [2, 3, 4, 5, 6, 1, 0]
    kv.allocate(2, list(range(100, 116)))  # 4 blocks: the cached ones survive
    assert kv.block_table(2) == [2, 3, 4, 5]
    assert kv.num_cached_blocks == 2
    assert kv.allocate(3, a) == 8  # both full blocks hit, revived from the free queue
    assert kv.block_table(3) == [0, 1, 6] and kv.num_free_blocks == 0
    kv.free(3)  # queue [6, 1, 0]
    kv.free(2)  # queue [2, 3, 4, 5, 6, 1, 0]
    kv.allocate(4, list(range(200, 221)))  # 6 blocks: evicts block 1 (the tail) before block 0
    assert kv.block_table(4) == [2, 3, 4, 5, 6, 1]
    assert kv.num_cached_blocks == 1
    kv.free(4)
    assert kv.allocate(5, a) == 4  # block 0 still cached: the first block hits, the second was evicted
    assert kv.block_table(5)[0] == 0


def test_shared_block_returns_to_pool_only_after_last_reference():
    kv = make_manager(num_blocks=4)
    a = list(range(5))
    kv.allocate(1, a)
    kv.cache_computed_blocks(1, a, 5)
    assert kv.allocate(2, a) == 4
    assert kv.block_table(2)[0] == kv.block_table(1)[0] == 0
    kv.free(1)
    assert 0 not in kv._free  # still referenced by request 2
    kv.free(2)
    assert kv.num_free_blocks == 4


def test_without_prefix_caching_nothing_is_shared():
    kv = make_manager(prefix=False)
    a = list(range(9))
    kv.allocate(1, a)
    kv.cache_computed_blocks(1, a, 9)
    assert kv.num_cached_blocks == 0
    assert kv.allocate(2, a) == 0
    assert set(kv.block_table(1)).isdisjoint(kv.block_table(2))


def test_duplicate_content_is_cached_once():
    kv = make_manager()
    a = list(range(8))
    kv.allocate(1, a)
    kv.allocate(2, a)  # nothing cached yet: separate blocks with equal content
    kv.cache_computed_blocks(1, a, 8)
    kv.cache_computed_blocks(2, a, 8)
    assert kv.num_cached_blocks == 2  # request 1's two blocks; request 2's copies stay uncached
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 8


@pytest.mark.parametrize("bad", [dict(num_blocks=0, tokens_per_block=4), dict(num_blocks=4, tokens_per_block=0)])
def test_invalid_config(bad):
    with pytest.raises(ValueError):
        KVCacheManager(KVCacheConfig(**bad))


def test_pool_size_from_a_byte_budget():
    assert num_kv_cache_blocks(1000, 64, max_batch_size=4, max_seq_len=128, tokens_per_block=4) == 15
    with pytest.raises(KilnError, match="holds no KV block.*raise kv_cache_bytes"):
        num_kv_cache_blocks(63, 64, max_batch_size=4, max_seq_len=128, tokens_per_block=4)


def test_default_pool_holds_every_sequence_up_to_the_cap_but_at_least_one():
    # 4 sequences of 128 tokens in blocks of 4: 4 * 32 blocks.
    assert num_kv_cache_blocks(None, 64, max_batch_size=4, max_seq_len=128, tokens_per_block=4) == 128
    # Blocks so large that the cap holds 2: still one whole max_seq_len sequence (32 blocks).
    huge = DEFAULT_MAX_KV_CACHE_BYTES // 2
    assert num_kv_cache_blocks(None, huge, max_batch_size=4, max_seq_len=128, tokens_per_block=4) == 32
    # Capped: 2 GiB of 1 MiB blocks = 2048 blocks, fewer than 64 sequences * 32 blocks.
    assert num_kv_cache_blocks(None, 1 << 20, max_batch_size=64, max_seq_len=4096, tokens_per_block=128) == 2048


def test_pool_size_from_a_token_count_and_never_from_both():
    # max_tokens_in_paged_kv_cache: whole blocks of 4 tokens holding at least that many tokens.
    assert num_kv_cache_blocks(None, 64, 4, 128, 4, max_tokens_in_paged_kv_cache=32) == 8
    assert num_kv_cache_blocks(None, 64, 4, 128, 4, max_tokens_in_paged_kv_cache=30) == 8
    with pytest.raises(KilnError, match="both kv_cache_bytes=1,000 and max_tokens_in_paged_kv_cache=32.*only one"):
        num_kv_cache_blocks(1000, 64, 4, 128, 4, max_tokens_in_paged_kv_cache=32)
    with pytest.raises(KilnError, match="max_tokens_in_paged_kv_cache=0 must be >= 1"):
        num_kv_cache_blocks(None, 64, 4, 128, 4, max_tokens_in_paged_kv_cache=0)


def test_reuse_is_counted_at_each_allocation():
    kv = make_manager(num_blocks=8)
    a = list(range(10))  # 3 blocks, 2 full
    kv.allocate(1, a)
    assert (kv.num_reused_blocks, kv.num_needed_blocks) == (0, 3)
    kv.cache_computed_blocks(1, a, 10)
    kv.allocate(2, a[:8] + [50, 51, 52, 53, 54])  # 13 tokens: 4 blocks, the first 2 reused
    assert (kv.num_reused_blocks, kv.num_needed_blocks) == (2, 7)
    assert kv.allocate(3, list(range(100, 120))) is None  # refused: nothing counted
    assert (kv.num_reused_blocks, kv.num_needed_blocks) == (2, 7)
    kv.append_slots(2, 17)  # growth is not an allocation's need
    assert (kv.num_reused_blocks, kv.num_needed_blocks) == (2, 7)


def test_blocks_to_allocate_count_new_blocks_and_revived_prefix_hits():
    kv = make_manager(num_blocks=8)
    a = list(range(9))
    kv.allocate(1, a)
    kv.cache_computed_blocks(1, a, 9)  # blocks 0 and 1 cached, held by request 1
    assert kv.num_blocks_to_allocate(list(range(100, 105))) == 2
    assert kv.num_blocks_to_allocate(list(range(100, 105)), 20) == 5  # grown to 20 tokens
    assert kv.num_blocks_to_allocate(a) == 1  # 2 hits in use: only the third block is new
    kv.free(1)
    assert kv.num_blocks_to_allocate(a) == 3  # the hits sit in the free queue: reviving takes them too
    assert kv.num_blocks_to_allocate(a, 16) == 4
    kv.allocate(2, a[:5])
    assert kv.num_missing_blocks(2, 5) == 0 and kv.num_missing_blocks(2, 13) == 2
