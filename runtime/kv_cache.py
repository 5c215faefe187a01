"""KV-block accounting: the one owner of the paged KV pool's blocks.

The pool holds ``num_blocks`` blocks of ``tokens_per_block`` token slots. A sequence's block table lists
the physical block of each of its logical blocks; token at position ``p`` lives in slot
``block_table[p // tokens_per_block] * tokens_per_block + p % tokens_per_block``.

Prefix reuse (automatic prefix caching, as in vLLM's v1 KV-cache manager and SGLang's radix cache): every
*full* block of computed tokens gets a hash chained with its parent block's hash, so equal hashes mean equal
token prefixes. A new request whose prompt starts with cached blocks shares them (ref count + 1) and skips
computing those tokens. Freed blocks keep their hash and stay reusable until evicted::

    free queue (allocation pops from the left)
    | uncached free blocks ... | cached free blocks, least recently freed ... most recently freed |
      ^ taken first                ^ evicted next (its hash forgotten)

Requests that arrive together share a prefix too (as SGLang's radix cache lets them): at allocation each
block a request must compute is marked as *being computed* by it, unless another request already computes
the same hash. A request whose next block another request is computing waits for it
(:meth:`KVCacheManager.waits_for_prefix`), and once that block is cached takes it in place of its own
(:meth:`KVCacheManager.reuse_computed_prefix`), so a prefix shared by a burst of requests is computed once.

A sequence's blocks are freed tail first, so of one sequence the blocks furthest from the shared prefix are
evicted first. The scheduler never sees block ids: it asks ``allocate / append_slots / free`` and, to plan
admissions, how many free blocks a request would take (:meth:`KVCacheManager.num_blocks_to_allocate`,
:meth:`KVCacheManager.num_missing_blocks`); the input preparation reads ``block_table``. Speculative decoding
appends slots for draft tokens and trims those of rejected ones (:meth:`KVCacheManager.trim_slots`); a block
is hashed only once all its tokens are computed and accepted (:meth:`KVCacheManager.cache_computed_blocks`).

Reuse is counted cumulatively (TensorRT-LLM's ``reusedBlocks`` / ``allocTotalBlocks``): ``num_reused_blocks``
blocks came from the prefix cache, at allocation or taken later in place of a block a request had not yet
computed, out of ``num_needed_blocks`` the allocations needed (reused + newly allocated), so
``num_reused_blocks / num_needed_blocks`` is the prefix-cache hit rate.

How many blocks the pool has is decided here too (:func:`num_kv_cache_blocks`), from a byte budget or a
token count (TensorRT-LLM's ``max_tokens_in_paged_kv_cache``) and the engine's bytes per block.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from kilnlm.runtime.errors import KilnError

DEFAULT_MAX_KV_CACHE_BYTES = 2 << 30  # cap of the default KV pool (2 GiB)


@dataclass(frozen=True)
class KVCacheConfig:
    num_blocks: int
    tokens_per_block: int
    enable_kv_cache_reuse: bool = True


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_kv_cache_blocks(kv_cache_bytes: int | None, bytes_per_block: int, max_batch_size: int, max_seq_len: int,
                        tokens_per_block: int, max_tokens_in_paged_kv_cache: int | None = None) -> int:
    """Blocks of the paged KV pool.

    ``kv_cache_bytes`` (bytes) given: as many blocks of ``bytes_per_block`` bytes as fit in it.
    ``max_tokens_in_paged_kv_cache`` (tokens, TensorRT-LLM's name) given: enough blocks of
    ``tokens_per_block`` tokens to hold that many tokens (rounded up to a whole block). Neither:
    enough for ``max_batch_size`` sequences of ``max_seq_len`` tokens each, capped at
    :data:`DEFAULT_MAX_KV_CACHE_BYTES` but never below one full ``max_seq_len`` sequence (a smaller pool
    still serves every request: the scheduler admits what fits and preempts when generation outgrows it).

    Raises:
        KilnError: both sizes are given, ``kv_cache_bytes`` holds no block, or
            ``max_tokens_in_paged_kv_cache`` is below 1.
    """
    max_blocks_per_seq = _cdiv(max_seq_len, tokens_per_block)
    if kv_cache_bytes is not None and max_tokens_in_paged_kv_cache is not None:
        raise KilnError(f"both kv_cache_bytes={kv_cache_bytes:,} and max_tokens_in_paged_kv_cache="
                        f"{max_tokens_in_paged_kv_cache:,} size the KV pool: give only one")
    if max_tokens_in_paged_kv_cache is not None:
        if max_tokens_in_paged_kv_cache < 1:
            raise KilnError(f"max_tokens_in_paged_kv_cache={max_tokens_in_paged_kv_cache} must be >= 1: raise it "
                            "(or leave it unset for the default pool)")
        return _cdiv(max_tokens_in_paged_kv_cache, tokens_per_block)
    if kv_cache_bytes is None:
        num_cap_blocks = DEFAULT_MAX_KV_CACHE_BYTES // bytes_per_block
        return max(min(max_batch_size * max_blocks_per_seq, num_cap_blocks), max_blocks_per_seq)
    num_blocks = kv_cache_bytes // bytes_per_block
    if num_blocks < 1:
        raise KilnError(f"kv_cache_bytes={kv_cache_bytes:,} holds no KV block (one block is {bytes_per_block:,} bytes): "
                        "raise kv_cache_bytes")
    return num_blocks


class KVCacheManager:
    """Free list, ref counts, block tables per request and the prefix-hash map of the KV pool.

    Not thread-safe: only the executor's loop thread calls it.
    """

    def __init__(self, config: KVCacheConfig) -> None:
        if config.num_blocks < 1 or config.tokens_per_block < 1:
            raise ValueError(f"KV cache needs num_blocks >= 1 and tokens_per_block >= 1, got {config}")
        self.config = config
        self.tokens_per_block = config.tokens_per_block
        self.num_total_blocks = config.num_blocks
        self._ref_counts = [0] * config.num_blocks
        self._block_hash: list[bytes | None] = [None] * config.num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(config.num_blocks))
        self._tables: dict[int, list[int]] = {}  # request id -> block ids
        self._hashes: dict[int, list[bytes]] = {}  # request id -> hashes of its cached full blocks
        self._prompt_hashes: dict[int, list[bytes]] = {}  # request id -> hashes of its allocation's full blocks
        self._computing: dict[bytes, int] = {}  # block hash -> the request computing the block that will hold it
        self.num_reused_blocks = 0  # since start: blocks requests took from the prefix cache
        self.num_needed_blocks = 0  # since start: blocks allocations needed (reused + newly allocated)

    # ----------------------------------------------------------------------------------------- queries
    @property
    def num_free_blocks(self) -> int:
        """Blocks not referenced by any request (including cached ones that may be evicted)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def block_table(self, request_id: int) -> list[int]:
        """Physical block ids of the request's logical blocks, in order. Do not mutate."""
        return self._tables[request_id]

    def num_tokens_capacity(self, request_id: int) -> int:
        return len(self._tables[request_id]) * self.tokens_per_block

    def has_blocks(self, request_id: int) -> bool:
        return request_id in self._tables

    def can_allocate(self, token_ids: list[int]) -> bool:
        """Whether :meth:`allocate` would succeed for a new request with these tokens now."""
        return self.num_blocks_to_allocate(token_ids) <= len(self._free)

    def num_blocks_to_allocate(self, token_ids: list[int], num_tokens: int | None = None) -> int:
        """Free blocks a new request with prompt ``token_ids`` takes from the free queue to hold
        ``num_tokens`` tokens (default ``len(token_ids)``): its blocks minus its prefix hits, plus the hits
        that sit in the free queue (reviving a cached free block takes it from the queue too)."""
        hits, _ = self._lookup_prefix(self._block_hashes(token_ids))
        num_tokens = len(token_ids) if num_tokens is None else max(num_tokens, len(token_ids))
        num_hits_in_free = sum(1 for b in hits if self._ref_counts[b] == 0)
        return _cdiv(num_tokens, self.tokens_per_block) - len(hits) + num_hits_in_free

    def num_missing_blocks(self, request_id: int, num_tokens: int) -> int:
        """Blocks the request's table still lacks to hold ``num_tokens`` tokens in total (0 if it does)."""
        return max(0, _cdiv(num_tokens, self.tokens_per_block) - len(self._tables[request_id]))

    # ------------------------------------------------------------------------------------- operations
    def allocate(self, request_id: int, token_ids: list[int]) -> int | None:
        """Give a new request blocks for all of ``token_ids``, reusing cached prefix blocks.

        Returns the number of leading tokens whose K/V is already in the pool (a multiple of
        ``tokens_per_block``; always < ``len(token_ids)`` so at least one token is computed and yields
        logits), or ``None`` if the free blocks do not suffice (nothing changes then).
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id} already holds KV blocks")
        prompt_hashes = list(self._block_hashes(token_ids))
        hits, hashes = self._lookup_prefix(prompt_hashes)
        num_new_blocks = _cdiv(len(token_ids), self.tokens_per_block) - len(hits)
        if num_new_blocks + sum(1 for b in hits if self._ref_counts[b] == 0) > len(self._free):
            return None
        self._prompt_hashes[request_id] = prompt_hashes
        for block_hash in prompt_hashes[len(hits):]:
            self._computing.setdefault(block_hash, request_id)
        self.num_reused_blocks += len(hits)
        self.num_needed_blocks += len(hits) + num_new_blocks
        for block in hits:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
        self._tables[request_id] = hits + [self._pop_free() for _ in range(num_new_blocks)]
        self._hashes[request_id] = hashes
        return len(hits) * self.tokens_per_block

    def waits_for_prefix(self, request_id: int, num_computed_tokens: int) -> bool:
        """Whether the request's next block (it has computed ``num_computed_tokens`` tokens, at a block
        boundary) holds tokens another request is computing now: computing them too would only duplicate
        what the pool is about to cache, so its context should wait a step."""
        if num_computed_tokens % self.tokens_per_block:
            return False
        prompt_hashes = self._prompt_hashes.get(request_id, [])
        index = num_computed_tokens // self.tokens_per_block
        return index < len(prompt_hashes) and self._computing.get(prompt_hashes[index], request_id) != request_id

    def reuse_computed_prefix(self, request_id: int, num_computed_tokens: int) -> int:
        """For a request that has computed ``num_computed_tokens`` tokens: the blocks right after them that
        other requests have computed since this one was allocated (their hashes now cached) replace its own
        uncomputed blocks, which go back to the free queue. Returns its number of computed tokens after that
        (unchanged off a block boundary or without a newly cached block; always short of its last token)."""
        if num_computed_tokens % self.tokens_per_block:
            return num_computed_tokens
        prompt_hashes = self._prompt_hashes.get(request_id, [])
        table, hashes = self._tables[request_id], self._hashes[request_id]
        index = num_computed_tokens // self.tokens_per_block
        while index < len(prompt_hashes) and len(hashes) == index:
            block = self._cached.get(prompt_hashes[index])
            if block is None:
                break
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1
            self._release(table[index])
            table[index] = block
            hashes.append(prompt_hashes[index])
            self.num_reused_blocks += 1
            index += 1
        return max(num_computed_tokens, index * self.tokens_per_block)

    def can_append_slots(self, request_id: int, num_tokens: int) -> bool:
        return self.num_missing_blocks(request_id, num_tokens) <= len(self._free)

    def append_slots(self, request_id: int, num_tokens: int) -> bool:
        """Grow the request's block table to hold ``num_tokens`` tokens in total. Returns False (and changes
        nothing) if the free blocks do not suffice."""
        num_missing = self.num_missing_blocks(request_id, num_tokens)
        if num_missing > len(self._free):
            return False
        self._tables[request_id].extend(self._pop_free() for _ in range(num_missing))
        return True

    def trim_slots(self, request_id: int, num_tokens: int) -> None:
        """Shrink the request's block table to the blocks ``num_tokens`` tokens need, releasing the rest (tail
        first): the slots of rejected draft tokens (speculative decoding). Blocks holding only computed tokens
        of the request are never released here: it keeps at least the blocks of ``num_tokens``."""
        table = self._tables[request_id]
        num_kept = _cdiv(num_tokens, self.tokens_per_block)
        if num_kept < len(self._hashes[request_id]):
            raise ValueError(f"request {request_id}: trimming to {num_tokens} tokens would release cached blocks")
        while len(table) > num_kept:
            self._release(table.pop())

    def cache_computed_blocks(self, request_id: int, token_ids: list[int], num_computed_tokens: int) -> None:
        """Register the request's full blocks of computed tokens (``token_ids[:num_computed_tokens]``) for
        prefix reuse. Call after each step; a no-op without prefix caching."""
        if not self.config.enable_kv_cache_reuse:
            return
        hashes = self._hashes[request_id]
        prompt_hashes = self._prompt_hashes[request_id]  # hashed at allocation: not hashed again here
        table = self._tables[request_id]
        num_full = num_computed_tokens // self.tokens_per_block
        for i in range(len(hashes), num_full):
            if i < len(prompt_hashes):
                block_hash = prompt_hashes[i]
            else:  # a block of generated tokens
                parent = hashes[i - 1] if i else b""
                block_hash = self._hash_block(parent, token_ids[i * self.tokens_per_block : (i + 1) * self.tokens_per_block])
            hashes.append(block_hash)
            block = table[i]
            if block_hash not in self._cached and self._block_hash[block] is None:
                self._cached[block_hash] = block
                self._block_hash[block] = block_hash
            if self._computing.get(block_hash) == request_id:
                del self._computing[block_hash]

    def free(self, request_id: int) -> None:
        """Release the request's blocks (tail first). Blocks no one references go back to the free queue:
        uncached ones to its front, cached ones to its back (reusable until evicted). Idempotent."""
        table = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        for block_hash in self._prompt_hashes.pop(request_id, []):
            if self._computing.get(block_hash) == request_id:
                del self._computing[block_hash]
        if table is None:
            return
        for block in reversed(table):
            self._release(block)

    # ------------------------------------------------------------------------------------- internals
    def _release(self, block: int) -> None:
        """One reference less; unreferenced, the block goes back to the free queue: uncached to its front,
        cached to its back."""
        self._ref_counts[block] -= 1
        if self._ref_counts[block] == 0:
            self._free[block] = None
            if self._block_hash[block] is None:
                self._free.move_to_end(block, last=False)

    def _pop_free(self) -> int:
        block, _ = self._free.popitem(last=False)
        block_hash = self._block_hash[block]
        if block_hash is not None:  # evict: the block's old contents are about to be overwritten
            del self._cached[block_hash]
            self._block_hash[block] = None
        self._ref_counts[block] = 1
        return block

    def _block_hashes(self, token_ids: list[int]) -> Iterator[bytes]:
        """The chained hashes of the full blocks of ``token_ids[:-1]``, computed as they are taken (none
        without prefix caching)."""
        if not self.config.enable_kv_cache_reuse:
            return
        parent = b""
        for i in range((len(token_ids) - 1) // self.tokens_per_block):
            parent = self._hash_block(parent, token_ids[i * self.tokens_per_block : (i + 1) * self.tokens_per_block])
            yield parent

    def _lookup_prefix(self, hashes: Iterable[bytes]) -> tuple[list[int], list[bytes]]:
        """Cached blocks of the longest prefix of blocks with these chained ``hashes`` (:meth:`_block_hashes`;
        taken only up to the first miss), and their hashes."""
        hits: list[int] = []
        hit_hashes: list[bytes] = []
        for block_hash in hashes:
            block = self._cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
            hit_hashes.append(block_hash)
        return hits, hit_hashes

    @staticmethod
    def _hash_block(parent_hash: bytes, token_ids: list[int]) -> bytes:
        """SHA-256 over the parent block's hash and this block's token ids (int64 little-endian)."""
        return hashlib.sha256(parent_hash + np.asarray(token_ids, dtype="<i8").tobytes()).digest()
