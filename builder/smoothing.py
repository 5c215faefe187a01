"""SmoothQuant's per-channel smoothing (Xiao et al., 2023, "SmoothQuant: Accurate and Efficient Post-Training
Quantization for Large Language Models"), folded into a Llama checkpoint's float weights.

For a static per-tensor activation scale (``--qformat fp8``) the largest activation of a linear's input decides
the scale of every other one: SmolLM2's down projections see activations of a few thousand in a handful of
channels, and a scale that covers them pushes the ordinary activations of that input towards E4M3's
subnormals. Smoothing divides each input channel j by

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

(``max|X_j|`` over the calibration text, ``max|W_j|`` over column j of every linear reading that input) and
multiplies the weights' column j by it, moving that much of the channel's range from the activations into the
weights. Every ``1 / s`` is folded into what produces the input, so the network computes the same function in
exact arithmetic and the engine needs no extra op:

- q / k / v (one input): ``input_layernorm.weight / s``;
- gate / up (one input): ``post_attention_layernorm.weight / s``;
- down (``silu(gate) * up``): ``up_proj`` rows (and bias) ``/ s``;
- o_proj (attention output: each query head's ``P @ V`` of its KV head): ``v_proj`` rows (and bias) ``/ s``, one
  ``s`` per channel of a KV head, the maximum over the query heads that share it (GQA).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from kilnlm.builder.calibration import forward_loop
from kilnlm.builder.checkpoint import Checkpoint, float_model
from kilnlm.builder.errors import BuildError

log = logging.getLogger(__name__)

# s_j is kept within [1e-4, 1e4]: a channel the calibration text never excites (amax 0) keeps s = 1 there
SCALE_RANGE = (1e-4, 1e4)
_EPS = 1e-5  # floor of an amax before its power


def activation_amax(ck: Checkpoint, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-channel ``max |x|`` of every decoder linear's input over ``batches`` (``[1, seq_len]`` int64 token
    ids): HF linear name (``model.layers.{i}.mlp.down_proj``, ...) -> ``[in_features]`` float32."""
    model = float_model(ck)
    amax: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_module, inputs, _output) -> None:
            x = inputs[0].detach()
            a = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in model.named_modules()
               if isinstance(m, torch.nn.Linear) and name.startswith("model.layers.")]
    try:
        forward_loop(batches, "smoothing statistics", log.isEnabledFor(logging.INFO))(model)
    finally:
        for handle in handles:
            handle.remove()
    return amax


def _scales(act_amax: torch.Tensor, weight_amax: torch.Tensor, alpha: float) -> torch.Tensor:
    s = act_amax.clamp(min=_EPS).pow(alpha) / weight_amax.clamp(min=_EPS).pow(1.0 - alpha)
    s = torch.where(act_amax > 0, s, torch.ones_like(s))
    return s.clamp(*SCALE_RANGE)


def smooth_checkpoint(ck: Checkpoint, amax: dict[str, torch.Tensor], alpha: float) -> Checkpoint:
    """A copy of ``ck`` with SmoothQuant's scales for migration strength ``alpha`` (in [0, 1]) folded into its
    float weights (module docstring); ``amax`` from :func:`activation_amax`, measured on ``ck``. The original is
    not modified. The copy computes the same function as ``ck`` up to float32 rounding, and records ``alpha``
    (:attr:`Checkpoint.smoothing_alpha`). Raises :class:`BuildError` for a checkpoint smoothed already."""
    if ck.smoothing_alpha is not None:
        raise BuildError(f"{ck.source} is smoothed already (alpha {ck.smoothing_alpha}): smooth the source weights once")
    cfg = ck.config
    num_heads, num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    group = num_heads // num_kv_heads
    state = dict(ck.state_dict)

    def scaled(key: str, factor: torch.Tensor) -> None:
        if key in state:
            state[key] = state[key] * factor

    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        attn, mlp = p + "self_attn.", p + "mlp."
        shared_inputs = ((p + "input_layernorm.weight", [attn + "q_proj", attn + "k_proj", attn + "v_proj"]),
                         (p + "post_attention_layernorm.weight", [mlp + "gate_proj", mlp + "up_proj"]))
        for norm, linears in shared_inputs:
            a = torch.stack([amax[name] for name in linears]).amax(dim=0)
            w = torch.stack([state[name + ".weight"].abs().amax(dim=0) for name in linears]).amax(dim=0)
            s = _scales(a, w, alpha)
            scaled(norm, 1.0 / s)
            for name in linears:
                scaled(name + ".weight", s)
        s = _scales(amax[mlp + "down_proj"], state[mlp + "down_proj.weight"].abs().amax(dim=0), alpha)
        scaled(mlp + "down_proj.weight", s)
        scaled(mlp + "up_proj.weight", (1.0 / s)[:, None])
        scaled(mlp + "up_proj.bias", 1.0 / s)
        # o_proj's input channel h * head_dim + d reads KV head h // group's channel d
        a = amax[attn + "o_proj"].view(num_kv_heads, group, head_dim).amax(dim=1)
        w = state[attn + "o_proj.weight"].abs().amax(dim=0).view(num_kv_heads, group, head_dim).amax(dim=1)
        s = _scales(a, w, alpha)  # [num_kv_heads, head_dim]
        scaled(attn + "o_proj.weight", s[:, None, :].expand(num_kv_heads, group, head_dim).reshape(-1))
        scaled(attn + "v_proj.weight", (1.0 / s).reshape(-1)[:, None])
        scaled(attn + "v_proj.bias", (1.0 / s).reshape(-1))
    return dataclasses.replace(ck, state_dict=state, smoothing_alpha=alpha)


__all__ = ["activation_amax", "smooth_checkpoint"]
