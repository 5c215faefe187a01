"""The engine ABI: the one forward call every target implements, once per scheduler iteration.

The runtime packs every scheduled sequence -- context (prefill) chunks and generation (decode) tokens
alike -- into one flat batch without padding and calls the engine once::

    packed tokens   | seq 0: context chunk (5) | seq 1: decode (1) | seq 2: context chunk (3) |
    input_ids [T=9] | t0 t1 t2 t3 t4           | u0                | w0 w1 w2                 |
    cu_seqlens_q    | 0                          5                   6                          9
    seq_lens_kv     | 5 (first chunk)            | 17 (16 cached+1)  | 11 (8 cached + 3)         |

- ``input_ids``      ``[T] int64``   -- token ids of the T packed new tokens of B sequences;
- ``positions``      ``[T] int64``   -- absolute position of each new token in its sequence;
- ``cu_seqlens_q``   ``[B+1] int32`` -- sequence b's new tokens are rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``;
- ``seq_lens_kv``    ``[B] int32``   -- sequence b's total KV length *after* this step (cached + new);
- ``block_tables``   ``[B, max_blocks_per_seq] int32`` -- physical KV block of each logical block;
  entries past a sequence's last block are never read (the runtime fills them with 0);
- ``slot_mapping``   ``[T] int64``   -- where each new token's K/V is written in the pool:
  ``slot = block_id * tokens_per_block + offset_in_block``;
- ``logits_indices`` ``[N] int64``   -- the N packed rows whose logits come back, 1 <= N <= max_num_tokens,
  in any order (the executor asks for each sequence's last new token, N = B; perplexity evaluation asks
  for every scored row of a context chunk, N up to T -- TensorRT-LLM's gather_context_logits);
- ``kv_cache``       ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``, the
  engine's activation dtype (float32 or bfloat16) -- the paged KV pool, allocated and owned by the
  runtime, mutated in place by the attention plugin (index 0 of dim 1 holds K, index 1 holds V);
- returns ``logits [N, vocab_size] float32`` (row i is the logits of packed row ``logits_indices[i]``).

Positions are absolute, so a query token at position p attends to KV positions ``0..p`` of its own
sequence (causal). RoPE is applied inside the attention plugin from ``positions``.

The dynamic dimensions are T (1..max_num_tokens), B (1..max_batch_size), N (1..max_num_tokens) and
num_blocks; every other dimension is fixed at build time. The argument order below is the order of the compiled forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

ABI_VERSION = 1

# Manifest dtype names -> torch dtypes, for every target: build.dtype (activations) and build.kv_cache_dtype
# (the paged pool: the activation dtype, or "fp8" / "int8" for an 8-bit pool with per-layer scales baked
# into the engine; see kilnlm::paged_attention).
ACTIVATION_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
KV_CACHE_DTYPES = {**ACTIVATION_DTYPES, "fp8": torch.float8_e4m3fn, "int8": torch.int8}

# Names in the order the compiled forward takes them (after them comes kv_cache).
INPUT_NAMES = (
    "input_ids",
    "positions",
    "cu_seqlens_q",
    "seq_lens_kv",
    "block_tables",
    "slot_mapping",
    "logits_indices",
)


@dataclass
class EngineInputs:
    """One packed batch for one engine forward. Shapes and dtypes are given in the module docstring; all
    tensors live on the engine's device (CPU for the CPU target)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    cu_seqlens_q: torch.Tensor  # [B+1] int32
    seq_lens_kv: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [T] int64
    logits_indices: torch.Tensor  # [N] int64

    def as_args(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The positional arguments of the compiled forward, ``kv_cache`` last."""
        return tuple(getattr(self, f.name) for f in fields(self)) + (kv_cache,)

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_kv.shape[0])

    @property
    def num_logits(self) -> int:
        return int(self.logits_indices.shape[0])


def pack_sequences(seqs: Sequence[tuple[Sequence[int], int, Sequence[int]]], tokens_per_block: int,
                   max_blocks_per_seq: int) -> EngineInputs:
    """One :class:`EngineInputs` packing ``seqs`` in order, each ``(new_token_ids, num_cached, blocks)``: the
    new tokens sit at positions ``num_cached ...`` after ``num_cached`` tokens already in the pool, and
    ``blocks`` are the sequence's physical blocks in position order, covering every position up to its last
    new token (at most ``max_blocks_per_seq``; the block table's other entries are 0). Logits come back for
    each sequence's last new token. For callers that drive an engine directly (tests, a draft model); the
    executor's :mod:`kilnlm.runtime.inputs` packs its batches itself."""
    ids, positions, slots, cu, seq_lens = [], [], [], [0], []
    block_tables = torch.zeros(len(seqs), max_blocks_per_seq, dtype=torch.int32)
    for b, (new_ids, num_cached, blocks) in enumerate(seqs):
        pos = torch.arange(num_cached, num_cached + len(new_ids), dtype=torch.int64)
        table = torch.as_tensor(blocks, dtype=torch.int64)
        block_tables[b, : len(table)] = table.to(torch.int32)
        ids += new_ids
        positions.append(pos)
        slots.append(table[pos // tokens_per_block] * tokens_per_block + pos % tokens_per_block)
        cu.append(cu[-1] + len(new_ids))
        seq_lens.append(num_cached + len(new_ids))
    return EngineInputs(
        input_ids=torch.tensor(ids, dtype=torch.int64), positions=torch.cat(positions),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), seq_lens_kv=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables, slot_mapping=torch.cat(slots), logits_indices=torch.tensor(cu[1:], dtype=torch.int64) - 1)


def kv_cache_shape(
    num_layers: int, num_blocks: int, tokens_per_block: int, num_kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    """Shape of the paged KV pool: ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]``."""
    return (num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim)


def kv_cache_bytes_per_block(num_layers: int, tokens_per_block: int, num_kv_heads: int, head_dim: int,
                             kv_cache_dtype: torch.dtype) -> int:
    """Bytes one KV block takes over all layers, K and V: ``num_layers * 2 * tokens_per_block * num_kv_heads
    * head_dim`` elements of ``kv_cache_dtype`` (1 byte for an 8-bit KV cache, half of bfloat16's)."""
    return num_layers * 2 * tokens_per_block * num_kv_heads * head_dim * kv_cache_dtype.itemsize
