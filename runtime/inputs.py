"""Input preparation: one :class:`ScheduledBatch` -> the packed :class:`EngineInputs` of one forward.

Everything is written into buffers allocated once, at their maximum size (``max_num_tokens`` tokens,
``max_batch_size`` sequences): by a few vectorised numpy calls, or for a batch of one token per sequence
(a generation step) by scalar writes. The tensors handed to the engine are views of those buffers, valid
until the next :meth:`InputBuilder.build`. For sequence b with ``start`` computed tokens and ``n`` new
ones::

    positions     start, start+1, ..., start+n-1                 (absolute, per token)
    slot_mapping  block_table[b][p // tokens_per_block] * tokens_per_block + p % tokens_per_block
    seq_lens_kv   start + n
    logits row    cu_seqlens_q[b+1] - 1                          (the sequence's last new token)

A speculating sequence (speculative decoding) packs its ``k`` draft tokens after its new token and gets
``k + 1`` logits rows, one per position it verifies.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kilnlm.runtime.abi import EngineInputs
from kilnlm.runtime.kv_cache import KVCacheManager
from kilnlm.runtime.scheduler import ScheduledBatch


@dataclass(frozen=True)
class InputLimits:
    max_num_tokens: int
    max_batch_size: int
    max_blocks_per_seq: int
    tokens_per_block: int


class InputBuilder:
    def __init__(self, limits: InputLimits) -> None:
        self.limits = limits
        self._input_ids = np.zeros(limits.max_num_tokens, dtype=np.int64)
        self._positions = np.zeros(limits.max_num_tokens, dtype=np.int64)
        self._slot_mapping = np.zeros(limits.max_num_tokens, dtype=np.int64)
        self._cu_seqlens_q = np.zeros(limits.max_batch_size + 1, dtype=np.int32)
        self._seq_lens_kv = np.zeros(limits.max_batch_size, dtype=np.int32)
        self._logits_indices = np.zeros(limits.max_num_tokens, dtype=np.int64)  # draft tokens add rows
        self._block_tables = np.zeros((limits.max_batch_size, limits.max_blocks_per_seq), dtype=np.int32)
        self._table_lens = [0] * limits.max_batch_size  # row b of _block_tables is 0 from this column on
        # One-token-per-sequence batches (generation steps): cu_seqlens_q and logits_indices are constant
        # ranges, and the EngineInputs of views for each B are made once.
        self._one_token_cu_seqlens = np.arange(limits.max_batch_size + 1, dtype=np.int32)
        self._one_token_logits_indices = np.arange(limits.max_batch_size, dtype=np.int64)
        self._one_token_inputs: dict[int, EngineInputs] = {}

    def build(self, batch: ScheduledBatch, kv_cache: KVCacheManager) -> EngineInputs:
        """Pack ``batch`` (B sequences, T tokens; B <= max_batch_size, T <= max_num_tokens). Raises
        ValueError if the batch exceeds those limits (a scheduler bug, never a client error)."""
        num_seqs, num_tokens = len(batch.seqs), batch.num_tokens
        lim = self.limits
        if not (0 < num_seqs <= lim.max_batch_size and num_tokens <= lim.max_num_tokens):
            raise ValueError(f"batch of {num_seqs} sequences / {num_tokens} tokens exceeds the engine's limits {lim}")
        if num_tokens == num_seqs and all(s.num_new_tokens == 1 for s in batch.seqs):
            return self._build_one_token_each(batch, kv_cache)
        starts = np.fromiter((s.request.num_computed_tokens for s in batch.seqs), np.int64, num_seqs)
        num_new = np.fromiter((s.num_scheduled_tokens for s in batch.seqs), np.int64, num_seqs)

        cu_seqlens_q = self._cu_seqlens_q[: num_seqs + 1]
        cu_seqlens_q[0] = 0
        np.cumsum(num_new, out=cu_seqlens_q[1:])
        seq_lens_kv = self._seq_lens_kv[:num_seqs]
        np.add(starts, num_new, out=seq_lens_kv, casting="unsafe")
        num_drafts = batch.num_draft_tokens
        logits_indices = self._logits_indices[: num_seqs + num_drafts]
        if num_drafts:  # a speculating sequence's rows: its new token's and each draft token's
            logits_indices[:] = np.concatenate([np.arange(cu_seqlens_q[b + 1] - 1 - len(s.draft_token_ids), cu_seqlens_q[b + 1])
                                                for b, s in enumerate(batch.seqs)])
        else:
            np.subtract(cu_seqlens_q[1:], 1, out=logits_indices, casting="unsafe")

        block_tables = self._block_tables[:num_seqs]
        block_tables.fill(0)
        input_ids = self._input_ids[:num_tokens]
        for b, seq in enumerate(batch.seqs):
            table = kv_cache.block_table(seq.request.request_id)
            block_tables[b, : len(table)] = table
            self._table_lens[b] = len(table)
            start, first = int(starts[b]), int(cu_seqlens_q[b])
            input_ids[first : first + seq.num_new_tokens] = seq.request.token_ids[start : start + seq.num_new_tokens]
            if seq.draft_token_ids:
                input_ids[first + seq.num_new_tokens : cu_seqlens_q[b + 1]] = seq.draft_token_ids

        # seq_index [T]: which sequence each packed token belongs to; positions = start + offset in chunk.
        seq_index = np.repeat(np.arange(num_seqs), num_new)
        positions = self._positions[:num_tokens]
        np.add(starts[seq_index], np.arange(num_tokens) - cu_seqlens_q[seq_index], out=positions)
        tpb = lim.tokens_per_block
        slot_mapping = self._slot_mapping[:num_tokens]
        np.add(block_tables[seq_index, positions // tpb].astype(np.int64) * tpb, positions % tpb, out=slot_mapping)

        return EngineInputs(
            input_ids=torch.from_numpy(input_ids),
            positions=torch.from_numpy(positions),
            cu_seqlens_q=torch.from_numpy(cu_seqlens_q),
            seq_lens_kv=torch.from_numpy(seq_lens_kv),
            block_tables=torch.from_numpy(block_tables),
            slot_mapping=torch.from_numpy(slot_mapping),
            logits_indices=torch.from_numpy(logits_indices),
        )

    def _build_one_token_each(self, batch: ScheduledBatch, kv_cache: KVCacheManager) -> EngineInputs:
        """:meth:`build` for a batch whose every sequence brings one token (a generation step), by scalar
        writes into the buffers: a decode step runs right after a forward has streamed the weights through
        the caches, where each numpy call of the general path costs several times its warm time (the
        general path measured ~0.22 ms in the executor's loop for one sequence)."""
        num_seqs = len(batch.seqs)
        tpb = self.limits.tokens_per_block
        input_ids, positions, slot_mapping = self._input_ids, self._positions, self._slot_mapping
        seq_lens_kv, block_tables, table_lens = self._seq_lens_kv, self._block_tables, self._table_lens
        for b, seq in enumerate(batch.seqs):
            request = seq.request
            position = request.num_computed_tokens
            table = kv_cache.block_table(request.request_id)
            num_blocks = len(table)
            block_tables[b, :num_blocks] = table
            if table_lens[b] > num_blocks:
                block_tables[b, num_blocks : table_lens[b]] = 0
            table_lens[b] = num_blocks
            input_ids[b] = request.token_ids[position]
            positions[b] = position
            seq_lens_kv[b] = position + 1
            slot_mapping[b] = table[position // tpb] * tpb + position % tpb
        inputs = self._one_token_inputs.get(num_seqs)
        if inputs is None:
            inputs = self._one_token_inputs[num_seqs] = EngineInputs(
                input_ids=torch.from_numpy(input_ids[:num_seqs]),
                positions=torch.from_numpy(positions[:num_seqs]),
                cu_seqlens_q=torch.from_numpy(self._one_token_cu_seqlens[: num_seqs + 1]),
                seq_lens_kv=torch.from_numpy(seq_lens_kv[:num_seqs]),
                block_tables=torch.from_numpy(block_tables[:num_seqs]),
                slot_mapping=torch.from_numpy(slot_mapping[:num_seqs]),
                logits_indices=torch.from_numpy(self._one_token_logits_indices[:num_seqs]),
            )
        return inputs
