"""8-bit paged KV cache (``--kv-cache-dtype fp8 | int8``): per-layer calibration of K and V and the scales
baked into the engine.

Calibration uses NVIDIA ModelOpt's KV-cache quantizers: ``mtq.quantize`` with only the
``*[kv]_bmm_quantizer`` entries of ``mtq.FP8_KV_CFG`` enabled (every weight / activation quantizer off) and
max calibration. ModelOpt's Hugging Face attention wrapper feeds those quantizers the attention's key
states *after* RoPE (and before GQA's repeat_kv) and the value states, exactly the tensors kilnlm's
``paged_attention`` writes into the pool; ``tests/builder/test_kv_cache_quant.py`` checks the recorded
amax against forward hooks on transformers' ``apply_rotary_pos_emb`` / ``v_proj``. The calibration runs
on the checkpoint's float32 weights, whatever ``--qformat`` the linears get (KV amax is a property of
the model's activations; the weight formats perturb it by their own small error).

Scale rule (per layer, one for K and one for V; TensorRT-LLM's): ``scale = amax / 448`` for FP8 E4M3 and
``scale = amax / 127`` for int8, so the calibrated maximum maps onto the format's largest value; the pool
stores ``quantize(x / scale)`` (saturating beyond) and attention reads ``stored * scale``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from kilnlm.builder.checkpoint import Checkpoint, float_model
from kilnlm.builder.errors import BuildError
from kilnlm.plugins.reference import KV_CACHE_QMAX
from kilnlm.runtime.abi import KV_CACHE_DTYPES

log = logging.getLogger(__name__)

# --kv-cache-dtype values that quantize the pool -> the largest magnitude the stored format holds.
KV_QUANT_MAX = {name: KV_CACHE_QMAX[dtype] for name, dtype in KV_CACHE_DTYPES.items() if dtype in KV_CACHE_QMAX}
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_QUANT_MAX)


@dataclass(frozen=True)
class KvAmax:
    """Calibrated absolute maxima of one layer's keys (after RoPE) and values."""

    k_amax: float
    v_amax: float


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype_name: str) -> str:
    """The manifest's ``kv_cache_dtype``: ``auto`` -> the activation dtype name (``float32`` / ``bfloat16``,
    as before 8-bit pools existed), ``fp8`` / ``int8`` unchanged. Raises :class:`BuildError` for other
    values (say what would work)."""
    if kv_cache_dtype == "auto":
        return dtype_name
    if kv_cache_dtype in KV_QUANT_MAX:
        return kv_cache_dtype
    raise BuildError(f"--kv-cache-dtype {kv_cache_dtype!r} is not supported: choose one of "
                     f"{', '.join(KV_CACHE_DTYPE_CHOICES)} (auto stores K/V in the activation dtype {dtype_name})")


def kv_scales(amax: list[KvAmax], kv_cache_dtype: str) -> list[torch.Tensor]:
    """Per layer ``[2] float32`` = (k_scale, v_scale) = amax / 448 (fp8) or amax / 127 (int8), the
    ``kv_scale`` argument of ``kilnlm::paged_attention``. Raises :class:`BuildError` for a zero, negative
    or non-finite amax (a layer the calibration never reached, or diverging activations)."""
    qmax = KV_QUANT_MAX[kv_cache_dtype]
    scales = []
    for i, a in enumerate(amax):
        if not (a.k_amax > 0 and a.v_amax > 0 and math.isfinite(a.k_amax) and math.isfinite(a.v_amax)):
            raise BuildError(f"KV-cache calibration of layer {i} gave an unusable amax {a}: check the calibration data "
                             "(--calib-data) or build with --kv-cache-dtype auto")
        scales.append(torch.tensor([a.k_amax / qmax, a.v_amax / qmax], dtype=torch.float32))
    return scales


def calibrate_kv_cache(ck: Checkpoint, calib_batches: list[torch.Tensor], show_progress: bool = False) -> list[KvAmax]:
    """Per-layer amax of K after RoPE and of V over ``calib_batches`` (token ids ``[1, seq_len] int64``,
    CPU), with ModelOpt's KV-cache quantizers on the checkpoint's float32 weights (see the module
    docstring). Returns one :class:`KvAmax` per decoder layer, in layer order.

    Raises :class:`BuildError` if ModelOpt is missing, inserts no KV quantizer for this architecture, or a
    layer's quantizer recorded no amax."""
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise BuildError(f"--kv-cache-dtype fp8 / int8 needs NVIDIA ModelOpt ({exc}): pip install 'kilnlm[build]'") from None
    from tqdm.auto import tqdm

    model = float_model(ck)
    # Only the KV quantizers (FP8_KV_CFG's entries) on; their amax does not depend on num_bits.
    config = {"quant_cfg": [{"quantizer_name": "*", "enable": False}, *mtq.FP8_KV_CFG["quant_cfg"]],
              "algorithm": "max"}
    log.info("calibrating the KV cache on %d samples x %d tokens", len(calib_batches), calib_batches[0].shape[1])

    def forward_loop(m) -> None:  # samples in groups of 8: larger GEMMs, the same amax
        with torch.no_grad():
            for i in tqdm(range(0, len(calib_batches), 8), desc="KV-cache calibration", unit="batch",
                          disable=not show_progress):
                m(torch.cat(calib_batches[i:i + 8]))

    model = mtq.quantize(model, config, forward_loop)

    num_layers = ck.config.num_hidden_layers
    found: dict[int, dict[str, float]] = {}
    for name, module in model.named_modules():
        parts = name.split(".")
        if len(parts) != 5 or parts[:2] != ["model", "layers"] or parts[4] not in ("k_bmm_quantizer", "v_bmm_quantizer"):
            continue
        amax = getattr(module, "amax", None)
        if amax is None:
            raise BuildError(f"ModelOpt recorded no amax for {name}: the KV-cache calibration did not reach layer "
                             f"{parts[2]}; build with --kv-cache-dtype auto")
        found.setdefault(int(parts[2]), {})[parts[4][0]] = float(amax.float().max())
    missing = [i for i in range(num_layers) if set(found.get(i, {})) != {"k", "v"}]
    if missing:
        raise BuildError(f"ModelOpt inserted no KV-cache quantizers for layers {missing[:5]} of {ck.config.architectures[0]}: "
                         "this architecture's attention is not supported for an 8-bit KV cache; build with --kv-cache-dtype auto")
    return [KvAmax(found[i]["k"], found[i]["v"]) for i in range(num_layers)]


def attach_kv_scales(network: torch.nn.Module, scales: list[torch.Tensor]) -> None:
    """Bake per-layer ``kv_scale [2] float32`` into the network's attention layers (a constant buffer each,
    passed to ``kilnlm::paged_attention``). ``network.layers[i].attn`` must be a
    :class:`kilnlm.builder.network.layers.PagedAttention`. Raises :class:`BuildError` on a layer-count
    mismatch."""
    layers = network.layers
    if len(layers) != len(scales):
        raise BuildError(f"{len(scales)} KV-cache scales for a network of {len(layers)} layers: report this as a kilnlm bug")
    for layer, scale in zip(layers, scales):
        layer.attn.set_kv_scale(scale)
