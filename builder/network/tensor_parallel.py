"""Tensor parallelism: one rank's shard of the fused network (Megatron-LM's layout, Shoeybi et al. 2019).

Per decoder layer, rank r of ``tp_size`` keeps::

    qkv       column-parallel: its num_heads / tp_size query heads and num_kv_heads / tp_size KV heads
              (contiguous head groups, so query head h still reads KV head h // (num_heads / num_kv_heads))
    o_proj    row-parallel: the input columns of its query heads, then kilnlm::all_reduce
    gate_up   column-parallel: its intermediate_size / tp_size rows of gate and of up
    down      row-parallel: the matching input columns, then kilnlm::all_reduce
    norms     replicated

and the vocabulary is split into ``tp_size`` contiguous ranges of ceil(vocab_size / tp_size) rows (the last
one padded with zero rows): the embedding looks up the ids in its range (zero rows elsewhere) and
all-reduces; the LM head computes its range's logits and all-gathers them, so every rank returns the full
``[N, vocab_size]`` logits. The paged KV pool of a rank holds its KV heads only.

A shard is cut from the finished network -- quantized, calibrated and with its KV-cache scales -- so every
rank runs exactly tp=1's weights and scales: per-tensor, per-channel and per-group scales are sliced with
their rows or groups. What changes is the summation order of the row-parallel layers (each rank's partial
sum, rounded to the activation dtype, then summed by the all-reduce) and, for formats with run-time
per-token activation scales (fp8_rowwise, int8_sq ``--per-token``), the scale of a row-parallel layer's
input, which each rank computes over its own columns.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn

from kilnlm.builder.errors import BuildError
from kilnlm.runtime.manifest import ModelConfig

# Per-output-row buffers of the linear modules (kilnlm.builder.network.layers) and, for row-parallel
# slicing, the dimension of each buffer that runs along in_features (the int4 formats' packed weight holds
# two columns per byte; group-wise scales and zero points one entry per group).
_ROW_BUFFERS = ("weight", "weight_scale", "zero_point", "bias")
_COLUMN_DIMS = {"weight": 1, "pre_quant_scale": 0}
_GROUP_BUFFERS = ("weight_scale", "zero_point")


@dataclass(frozen=True)
class Mapping:
    """Where a rank sits in the tensor-parallel group (TensorRT-LLM's ``Mapping``: ``tp_size``, ``tp_rank``)."""

    tp_size: int = 1
    tp_rank: int = 0

    def __post_init__(self):
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} is outside 0..{self.tp_size - 1}")

    def split(self, total: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``total`` items split evenly (``total`` divisible by tp_size)."""
        size = total // self.tp_size
        return self.tp_rank * size, (self.tp_rank + 1) * size


def check_tensor_parallel(model: ModelConfig, tp_size: int) -> None:
    """Refuse a ``--tp-size`` that does not divide the attention heads, the KV heads or the MLP width (before
    anything is built; ``tp_size`` >= 1, as :func:`kilnlm.builder.config.resolve` checks). Raises
    :class:`BuildError` naming the dimension and the sizes that would work."""
    dims = {"num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
            "intermediate_size": model.intermediate_size}
    for name, value in dims.items():
        if value % tp_size:
            sizes = [n for n in range(1, max(dims.values()) + 1) if all(v % n == 0 for v in dims.values())]
            raise BuildError(f"--tp-size {tp_size} does not divide the model's {name} ({value}): tensor parallelism splits "
                             f"heads, KV heads and the MLP width evenly; choose --tp-size {' / '.join(map(str, sizes))}")


class RowParallel(nn.Module):
    """A row-parallel linear: the rank's partial product ``linear(x)`` summed over the ranks
    (``kilnlm::all_reduce``). x ``[T, in_features / tp_size]``; returns ``[T, out_features]``, equal on every
    rank."""

    def __init__(self, linear: nn.Module):
        super().__init__()
        self.linear = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kilnlm.all_reduce(self.linear(x))


def _slice_linear(module: nn.Module, rows: torch.Tensor | None = None, columns: tuple[int, int] | None = None,
                  pad_rows: int = 0) -> nn.Module:
    """A copy of linear ``module`` (any of kilnlm's linear modules) keeping output ``rows`` (int64 indices)
    and/or the input ``columns`` range ``[start, stop)``, then ``pad_rows`` zero output rows. Per-tensor
    buffers (0-dim scales) are kept. Raises :class:`BuildError` when an int4 group straddles the column cut."""
    shard = copy.copy(module)
    shard._buffers = dict(module._buffers)
    out_features = module.weight.shape[0]
    if columns is not None:
        start, stop = columns
        in_features = module.weight.shape[1] * (2 if module.weight.dtype == torch.uint8 else 1)
        for name, dim in _COLUMN_DIMS.items():
            buf = shard._buffers.get(name)
            if buf is None:
                continue
            per_entry = in_features // buf.shape[dim]  # 2 columns per byte of a packed int4 weight
            shard._buffers[name] = buf.narrow(dim, start // per_entry, (stop - start) // per_entry).contiguous()
        group_size = getattr(module, "group_size", None)
        if group_size is not None:
            if start % group_size or stop % group_size:
                raise BuildError(f"tensor parallelism cuts a linear's {in_features} input columns at {start}..{stop}, "
                                 f"inside int4 groups of {group_size}: build with a --group-size that divides "
                                 f"{stop - start}, or another --tp-size")
            for name in _GROUP_BUFFERS:
                buf = shard._buffers.get(name)
                if buf is not None:
                    shard._buffers[name] = buf[:, start // group_size:stop // group_size].contiguous()
    if rows is not None or pad_rows:
        for name in _ROW_BUFFERS:
            buf = shard._buffers.get(name)
            if buf is None or buf.dim() == 0 or buf.shape[0] != out_features:
                continue  # absent, or a per-tensor scale
            shard._buffers[name] = _pad_rows(buf if rows is None else buf.index_select(0, rows), pad_rows)
    return shard


def _pad_rows(tensor: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``tensor`` with ``num_rows`` zero rows appended (a vocabulary range padded to ceil(vocab / tp_size)), contiguous."""
    if num_rows:
        tensor = torch.cat([tensor, tensor.new_zeros((num_rows, *tensor.shape[1:]))])
    return tensor.contiguous()


def _head_rows(start: int, stop: int, head_dim: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(offset + start * head_dim, offset + stop * head_dim)


def vocab_range(vocab_size: int, mapping: Mapping) -> tuple[int, int, int]:
    """``(start, stop, padding)``: the rank's vocabulary rows ``[start, stop)`` of ceil(vocab_size / tp_size)
    per rank, and how many zero rows pad the last range to that size."""
    per_rank = -(-vocab_size // mapping.tp_size)
    start = min(mapping.tp_rank * per_rank, vocab_size)
    stop = min(start + per_rank, vocab_size)
    return start, stop, per_rank - (stop - start)


def _vocab_rows(tensor: torch.Tensor, mapping: Mapping) -> torch.Tensor:
    start, stop, padding = vocab_range(tensor.shape[0], mapping)
    return _pad_rows(tensor[start:stop], padding)


def shard_network(network: nn.Module, mapping: Mapping) -> nn.Module:
    """Rank ``mapping.tp_rank``'s shard of a finished :class:`~kilnlm.builder.network.llama.LlamaNetwork`
    (see the module docstring), sharing no mutable state with it: the input network is unchanged and can be
    sharded again for the next rank. Raises :class:`BuildError` for a shape tensor parallelism cannot split
    (:func:`check_tensor_parallel`, an int4 group cut in two)."""
    cfg = network.cfg
    check_tensor_parallel(cfg, mapping.tp_size)
    if mapping.tp_size == 1:
        return network
    shard = copy.copy(network)
    shard._buffers = dict(network._buffers)
    shard._modules = dict(network._modules)
    shard.mapping = mapping
    head_dim = cfg.head_dim
    q0, q1 = mapping.split(cfg.num_heads)
    kv0, kv1 = mapping.split(cfg.num_kv_heads)
    f0, f1 = mapping.split(cfg.intermediate_size)
    qkv_rows = torch.cat([_head_rows(q0, q1, head_dim), _head_rows(kv0, kv1, head_dim, cfg.num_heads * head_dim),
                          _head_rows(kv0, kv1, head_dim, (cfg.num_heads + cfg.num_kv_heads) * head_dim)])
    gate_up_rows = torch.cat([torch.arange(f0, f1), cfg.intermediate_size + torch.arange(f0, f1)])
    layers = []
    for layer in network.layers:
        new = copy.copy(layer)
        new._modules = dict(layer._modules)
        attn = copy.copy(layer.attn)
        attn._modules = dict(layer.attn._modules)
        attn.shape = dataclasses.replace(attn.shape, num_heads=q1 - q0, num_kv_heads=kv1 - kv0)
        attn.qkv = _slice_linear(layer.attn.qkv, rows=qkv_rows)
        attn.o_proj = RowParallel(_slice_linear(layer.attn.o_proj, columns=(q0 * head_dim, q1 * head_dim)))
        mlp = copy.copy(layer.mlp)
        mlp._modules = dict(layer.mlp._modules)
        mlp.gate_up = _slice_linear(layer.mlp.gate_up, rows=gate_up_rows)
        mlp.down = RowParallel(_slice_linear(layer.mlp.down, columns=(f0, f1)))
        new.attn, new.mlp = attn, mlp
        layers.append(new)
    shard.layers = nn.ModuleList(layers)
    start, stop, padding = vocab_range(cfg.vocab_size, mapping)
    for name in ("lm_head_weight", "embed_tokens"):
        if network._buffers.get(name) is not None:
            shard._buffers[name] = _vocab_rows(network._buffers[name], mapping)
    if network.lm_head is not None:
        shard.lm_head = _slice_linear(network.lm_head, rows=torch.arange(start, stop), pad_rows=padding)
    return shard
