"""Llama-family decoder (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) composed from the shared
layers, plus the Hugging Face weight-name mapping.

Per layer (pre-norm)::

    h = h + o_proj(paged_attention(rope(q), rope(k), v | kv_cache))    q, k, v = split(qkv(rms_norm(h)))
    h = h + down(silu(gate) * up)                                       gate, up = split(gate_up(rms_norm(h)))

then a final RMSNorm and the LM head on the ``logits_indices`` rows only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kilnlm.builder.errors import BuildError
from kilnlm.builder.formats import get_format
from kilnlm.builder.network.layers import (AttentionShape, Fp8Amax, GatedMLP, IntQuantization, PagedAttention, QuantizedWeights,
                                          RMSNorm, make_linear, rope_inv_freq)
from kilnlm.builder.network.tensor_parallel import Mapping
from kilnlm.runtime.manifest import ModelConfig

# Hugging Face linear names of one decoder layer, grouped by the fused linear they become.
QKV_PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
GATE_UP_PROJS = ("mlp.gate_proj", "mlp.up_proj")
O_PROJ = "self_attn.o_proj"
DOWN_PROJ = "mlp.down_proj"


def rope_parameters(hf_config: Any) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling or None) from a transformers config (v5 ``rope_parameters`` or v4
    ``rope_theta`` + ``rope_scaling``)."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(getattr(hf_config, "rope_theta", 10000.0))
        scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    return theta, scaling


def model_config_from_hf(hf_config: Any) -> ModelConfig:
    """The manifest's :class:`ModelConfig` from a transformers Llama / Mistral / Qwen2 config."""
    arch = hf_config.architectures[0]
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    theta, scaling = rope_parameters(hf_config)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise BuildError(f"hidden_act {hf_config.hidden_act!r} is not supported: kilnlm's Llama network uses silu")
    if getattr(hf_config, "mlp_bias", False):
        raise BuildError("mlp_bias=True is not supported: kilnlm's Llama network has bias-free MLPs")
    return ModelConfig(
        architecture=arch,
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        vocab_size=hf_config.vocab_size,
        max_position_embeddings=hf_config.max_position_embeddings,
        rope_theta=theta,
        rms_norm_eps=float(hf_config.rms_norm_eps),
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; Llama declares them with attention_bias.
        attention_bias=arch == "Qwen2ForCausalLM" or bool(getattr(hf_config, "attention_bias", False)),
        rope_scaling=scaling,
    )


class DecoderLayer(nn.Module):
    def __init__(self, input_norm: RMSNorm, attn: PagedAttention, post_norm: RMSNorm, mlp: GatedMLP):
        super().__init__()
        self.input_norm = input_norm
        self.attn = attn
        self.post_norm = post_norm
        self.mlp = mlp

    def forward(self, h, positions, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping, kv_cache):
        h = h + self.attn(self.input_norm(h), positions, inv_freq, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping, kv_cache)
        return h + self.mlp(self.post_norm(h))


class LlamaNetwork(nn.Module):
    """The whole decoder. ``forward`` takes the engine ABI (:mod:`kilnlm.runtime.abi`, in
    ``EngineInputs.as_args(kv_cache)`` order) and returns ``logits [B, vocab_size] float32``.

    ``dtype``: activation and KV-cache dtype. ``fp8_amax``: HF linear name (e.g.
    ``model.layers.0.self_attn.q_proj``) -> calibrated amax; when given, the decoder's linears are FP8
    and the embedding stays in ``dtype`` (bfloat16), the LM head too unless ``lm_head`` is there (fp8
    ``--quantize-lm-head``). ``quant``: linears quantized per linear (int4 / int8 / fp8_rowwise, see
    :class:`IntQuantization`);
    every linear named there is built from it instead of from ``state_dict`` (the LM head too when
    ``lm_head`` is there; the embedding then stays in ``dtype``). ``float_linears``: HF names of decoder
    linears kept in ``dtype`` although the format quantizes the others (``--auto-quantize-bits``); every
    part of a fused linear or none, and none of them in ``quant``."""

    def __init__(self, cfg: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                 fp8_amax: dict[str, Fp8Amax] | None = None, quant: IntQuantization | None = None,
                 float_linears: tuple[str, ...] = ()):
        super().__init__()
        self.cfg = cfg
        self.mapping = Mapping()  # a rank's shard has its own (kilnlm.builder.network.tensor_parallel.shard_network)
        self.float_linears = tuple(sorted(float_linears))
        shape = AttentionShape(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)
        sd = _WeightReader(state_dict)

        def linear(prefix: str, names: tuple[str, ...], bias: bool) -> nn.Module:
            full = [f"{prefix}.{n}" for n in names]
            kept_float = [n in float_linears for n in full]
            if any(kept_float) and not all(kept_float):
                raise BuildError(f"{', '.join(full)} form one fused linear: keep all of them in {dtype} or none")
            if quant is not None and full[0] in quant.linears and not kept_float[0]:
                return _quantized_linear([_quantized_of(quant, n) for n in full], quant, dtype)
            weights = [sd.take(f"{n}.weight") for n in full]
            biases = [sd.take(f"{n}.bias") if bias else None for n in full]
            amax = None if fp8_amax is None or kept_float[0] else [_amax_of(fp8_amax, n) for n in full]
            return make_linear(weights, biases, dtype, amax)

        layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            attn = PagedAttention(i, shape, linear(p, QKV_PROJS, cfg.attention_bias), linear(p, (O_PROJ,), False))
            mlp = GatedMLP(linear(p, GATE_UP_PROJS, False), linear(p, (DOWN_PROJ,), False))
            eps = cfg.rms_norm_eps
            layers.append(DecoderLayer(RMSNorm(sd.take(f"{p}.input_layernorm.weight"), eps, dtype), attn,
                                       RMSNorm(sd.take(f"{p}.post_attention_layernorm.weight"), eps, dtype), mlp))
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(sd.take("model.norm.weight"), cfg.rms_norm_eps, dtype)
        # The LM head is a [vocab, hidden] weight applied by kilnlm::gemm (rows read in place, no transposed
        # copy); tied embeddings look tokens up in that same tensor: one copy in the package.
        embed = sd.take("model.embed_tokens.weight").to(dtype)
        self.lm_head = None  # --quantize-lm-head: the head in the engine's format
        if quant is not None and "lm_head" in quant.linears:
            self.lm_head = _quantized_linear([quant.linears["lm_head"]], quant, dtype)
        elif fp8_amax is not None and "lm_head" in fp8_amax:  # tied: from the float embedding
            head = sd.take("model.embed_tokens.weight") if cfg.tie_word_embeddings else sd.take("lm_head.weight")
            self.lm_head = make_linear([head], [None], dtype, [fp8_amax["lm_head"]])
        if self.lm_head is not None:  # a 16-bit embedding of its own
            self.register_buffer("lm_head_weight", None)
            self.register_buffer("embed_tokens", embed.contiguous())
        elif cfg.tie_word_embeddings:
            self.register_buffer("lm_head_weight", embed.contiguous())
            self.register_buffer("embed_tokens", None)
        else:
            self.register_buffer("lm_head_weight", sd.take("lm_head.weight").to(dtype).contiguous())
            self.register_buffer("embed_tokens", embed.contiguous())
        self.register_buffer("inv_freq", rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
        sd.check_all_used()

    def forward(self, input_ids, positions, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping,
                logits_indices, kv_cache):
        embed = self.lm_head_weight if self.embed_tokens is None else self.embed_tokens  # tied: the LM head
        if self.mapping.tp_size == 1:
            h = F.embedding(input_ids, embed)  # [T, hidden]
        else:  # vocabulary-parallel: this rank's rows of the vocabulary, zeros for the other ids, summed
            local_ids = input_ids - self.mapping.tp_rank * embed.shape[0]
            inside = (local_ids >= 0) & (local_ids < embed.shape[0])
            h = F.embedding(local_ids.clamp(0, embed.shape[0] - 1), embed)
            h = torch.ops.kilnlm.all_reduce(torch.where(inside.unsqueeze(-1), h, torch.zeros_like(h)))
        for layer in self.layers:
            h = layer(h, positions, self.inv_freq, cu_seqlens_q, seq_lens_kv, block_tables, slot_mapping, kv_cache)
        h = self.norm(h.index_select(0, logits_indices))  # [B, hidden]
        if self.lm_head is not None:
            logits = self.lm_head(h)
        else:
            logits = torch.ops.kilnlm.gemm(h, self.lm_head_weight, None)
        if self.mapping.tp_size > 1:  # each rank's vocabulary range, in rank order, without the last one's padding
            logits = torch.ops.kilnlm.all_gather(logits, self.mapping.tp_size)[:, :self.cfg.vocab_size]
        return logits.float()  # [B, vocab]


def _quantized_linear(parts: list[QuantizedWeights], quant: IntQuantization, dtype: torch.dtype) -> nn.Module:
    """One quantized linear from the parts of a fused projection (or a single linear), of the module the
    format declares (:attr:`kilnlm.builder.formats.QuantFormat.linear_module`)."""
    return get_format(quant.qformat).linear_module.from_parts(parts, quant, dtype)


def _quantized_of(quant: IntQuantization, name: str):
    if name not in quant.linears:
        raise BuildError(f"{quant.qformat} quantization has no weights for {name} while the other parts of its "
                         "fused linear are quantized: report this as a kilnlm bug")
    return quant.linears[name]


def fold_smoothing_into_norms(state_dict: dict[str, torch.Tensor], quant: IntQuantization, num_layers: int) -> None:
    """Fold the shared ``pre_quant_scale`` of q/k/v into ``input_layernorm.weight``, that of gate/up into
    ``post_attention_layernorm.weight`` and a quantized LM head's into the final ``model.norm.weight``
    (``norm(x) * w * s == norm(x) * (w * s)``, exact in float32), in place, and clear it from the linears.
    o_proj / down_proj keep theirs (no norm precedes them). Raises :class:`BuildError` when the parts of a
    fused linear carry different scales."""
    groups = [(f"model.layers.{i}.{norm}", [f"model.layers.{i}.{n}" for n in names]) for i in range(num_layers)
              for norm, names in (("input_layernorm", QKV_PROJS), ("post_attention_layernorm", GATE_UP_PROJS))]
    groups.append(("model.norm", ["lm_head"]))  # the final norm feeds only the head
    for norm, names in groups:
        parts = [quant.linears.get(n) for n in names]
        if any(p is None for p in parts) or parts[0].pre_quant_scale is None:
            continue
        scale = parts[0].pre_quant_scale
        if any(p.pre_quant_scale is None or not torch.equal(p.pre_quant_scale, scale) for p in parts[1:]):
            raise BuildError(f"{', '.join(names)} carry different pre_quant_scales, so they cannot be folded into "
                             f"{norm}: quantize them with one shared smoothing scale")
        key = f"{norm}.weight"
        state_dict[key] = state_dict[key].float() * scale.float()
        for p in parts:
            p.pre_quant_scale = None


def _amax_of(fp8_amax: dict[str, Fp8Amax], name: str) -> Fp8Amax:
    if name not in fp8_amax:
        raise BuildError(f"FP8 calibration recorded no amax for {name}: the calibration did not reach this linear")
    return fp8_amax[name]


class _WeightReader:
    """Hands out checkpoint tensors by HF name and reports missing / unused ones as BuildErrors."""

    def __init__(self, state_dict: dict[str, torch.Tensor]):
        self._state = state_dict
        self._used: set[str] = set()

    def take(self, name: str) -> torch.Tensor:
        if name not in self._state:
            raise BuildError(f"checkpoint has no tensor {name!r}: it does not match its config.json (re-export it)")
        self._used.add(name)
        return self._state[name]

    def check_all_used(self) -> None:
        unused = sorted(n for n in self._state if n not in self._used and not n.endswith("rotary_emb.inv_freq"))
        if unused:
            raise BuildError(f"checkpoint tensors {unused[:3]} ({len(unused)} in all) are not used by the network: "
                             "the checkpoint does not match its architecture")
