"""Fixtures of the plugin tests: the built C++ kernels and a factory of packed, paged batches."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch


@pytest.fixture(scope="session")
def cpu_kernels() -> str:
    """Builds (first session only; cached afterwards) and loads the C++ CPU kernels."""
    from kilnlm.plugins import load_cpu_kernels

    return load_cpu_kernels()


@pytest.fixture
def num_threads():
    """Sets torch's thread count for one test (call it with the count) and restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@dataclass
class PackedBatch:
    """Arguments of ``kilnlm::paged_attention`` for one packed batch (see kilnlm.runtime.abi)."""

    q: torch.Tensor  # [T, num_heads, head_dim]
    k: torch.Tensor  # [T, num_kv_heads, head_dim]
    v: torch.Tensor
    kv_cache: torch.Tensor  # [num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]
    layer_idx: int
    positions: torch.Tensor  # [T] int64
    inv_freq: torch.Tensor  # [head_dim // 2] float32
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens_kv: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    scale: float

    def args(self, kv_cache: torch.Tensor | None = None) -> tuple:
        return (self.q, self.k, self.v, self.kv_cache if kv_cache is None else kv_cache, self.layer_idx,
                self.positions, self.inv_freq, self.cu_seqlens_q, self.seq_lens_kv, self.block_tables,
                self.slot_mapping, self.scale)

    def to_8bit_pool(self, kv_dtype: torch.dtype, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Replace the pool by its ``kv_dtype`` codes (:func:`~kilnlm.plugins.reference.quantize_kv_pool_reference`)
        and return ``kv_scale`` ([2] float32), by default scales that store the new K/V without saturating
        (:func:`~kilnlm.plugins.reference.fitting_kv_scale`)."""
        from kilnlm.plugins.reference import fitting_kv_scale, quantize_kv_pool_reference

        if kv_scale is None:
            kv_scale = fitting_kv_scale(self.k, self.v, kv_dtype)
        self.kv_cache = quantize_kv_pool_reference(self.kv_cache.float(), kv_scale, kv_dtype)
        return kv_scale


def rope_inv_freq(head_dim: int, rope_theta: float = 10000.0) -> torch.Tensor:
    return 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))


def _make_packed_batch(seqs: list[tuple[int, int]], *, num_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 64,
                       tokens_per_block: int = 16, num_blocks: int = 64, num_layers: int = 2, layer_idx: int = 1,
                       max_blocks_per_seq: int | None = None, dtype: torch.dtype = torch.float32,
                       seed: int = 0) -> PackedBatch:
    """A packed batch of sequences given as ``(num_cached, num_new)``: ``num_new`` new tokens (a context
    chunk if > 1, a generation token if 1) after ``num_cached`` tokens already in the pool (random K/V).
    Each sequence's blocks are drawn at random without replacement from the pool, so they are
    non-contiguous and interleaved between sequences."""
    gen = torch.Generator().manual_seed(seed)
    kv_cache = torch.randn(num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim, generator=gen).to(dtype)
    blocks_per_seq = [-(-(c + n) // tokens_per_block) for c, n in seqs]
    if max_blocks_per_seq is None:
        max_blocks_per_seq = max(blocks_per_seq) + 1
    assert sum(blocks_per_seq) <= num_blocks, "pool too small for this batch"
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seqs), max_blocks_per_seq, dtype=torch.int32)
    positions, slots, used = [], [], 0
    for b, ((num_cached, num_new), nblk) in enumerate(zip(seqs, blocks_per_seq)):
        block_tables[b, :nblk] = perm[used:used + nblk].to(torch.int32)
        used += nblk
        for p in range(num_cached, num_cached + num_new):
            positions.append(p)
            slots.append(int(block_tables[b, p // tokens_per_block]) * tokens_per_block + p % tokens_per_block)
    num_tokens = len(positions)
    new_counts = torch.tensor([n for _, n in seqs])
    return PackedBatch(
        q=torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype),
        k=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype),
        v=torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype),
        kv_cache=kv_cache,
        layer_idx=layer_idx,
        positions=torch.tensor(positions, dtype=torch.int64),
        inv_freq=rope_inv_freq(head_dim),
        cu_seqlens_q=torch.cat([torch.zeros(1, dtype=torch.int64), new_counts.cumsum(0)]).to(torch.int32),
        seq_lens_kv=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        scale=head_dim ** -0.5,
    )


@pytest.fixture
def make_packed_batch():
    """Factory: ``make_packed_batch([(num_cached, num_new), ...], num_heads=..., dtype=...)``."""
    return _make_packed_batch
