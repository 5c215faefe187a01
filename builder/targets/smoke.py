"""The build's smoke test, shared by the targets: one token, at position 0, through the finished engine."""

from __future__ import annotations

import torch

from kilnlm.builder.errors import BuildError
from kilnlm.runtime.abi import EngineInputs


def one_token_inputs(max_blocks_per_seq: int) -> EngineInputs:
    """One sequence of one token (id 1) at position 0, written to slot 0 of block 0; its logits come back."""
    return EngineInputs(
        input_ids=torch.tensor([1], dtype=torch.int64), positions=torch.tensor([0], dtype=torch.int64),
        cu_seqlens_q=torch.tensor([0, 1], dtype=torch.int32), seq_lens_kv=torch.tensor([1], dtype=torch.int32),
        block_tables=torch.zeros(1, max_blocks_per_seq, dtype=torch.int32),
        slot_mapping=torch.tensor([0], dtype=torch.int64), logits_indices=torch.tensor([0], dtype=torch.int64),
    )


def check_logits(logits: torch.Tensor, vocab_size: int, what: str) -> None:
    """Raise :class:`BuildError` (``what`` names the test) unless ``logits`` are ``[1, vocab_size]`` and finite."""
    if logits.shape != (1, vocab_size) or not torch.isfinite(logits).all():
        raise BuildError(f"{what} failed: logits {tuple(logits.shape)}, finite={bool(torch.isfinite(logits).all())}; "
                         "report this as a kilnlm bug")
