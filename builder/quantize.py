"""FP8 (E4M3) post-training quantization: fp8 with NVIDIA ModelOpt's FP8 recipe, fp8_rowwise from the weights.

ModelOpt inserts max-calibrating quantizers into every linear of a transformers model
(``mtq.quantize(model, mtq.FP8_DEFAULT_CFG, forward_loop)``); running real English text through it
records each linear's weight amax and input (activation) amax. The builder turns those into static
per-tensor scales ``amax / 448`` (see :class:`kilnlm.builder.network.layers.Fp8Linear`); each part of a
fused linear keeps its own weight scale. Calibration text (:mod:`kilnlm.builder.calibration`) defaults to
kilnlm's bundled general English text and the standard library's ``pydoc_data.topics`` (the Python
language reference), so builds need no network and are deterministic.

fp8_rowwise (TensorRT-LLM's ``--use_fp8_rowwise``, ModelOpt's ``FP8_PER_CHANNEL_PER_TOKEN_CFG``) reads no
text: each weight row's scale is its own amax / 448 (:meth:`Fp8RowwiseLinear.quantize`), the activations'
scales are computed per token at run time by the op. The integer formats live in
:mod:`kilnlm.builder.quantize_int`.
"""

from __future__ import annotations

import copy
import logging

import torch

from kilnlm.builder.calibration import CalibrationConfig, calibration_batches, forward_loop
from kilnlm.builder.checkpoint import Checkpoint, float_model
from kilnlm.builder.errors import BuildError
from kilnlm.builder.formats import QuantFormat
from kilnlm.builder.network.layers import Fp8Amax, Fp8RowwiseLinear, IntQuantization
from kilnlm.builder.network.llama import DOWN_PROJ, GATE_UP_PROJS, O_PROJ, QKV_PROJS

log = logging.getLogger(__name__)


def without_lm_head_exclusion(recipe: dict) -> dict:
    """A deep copy of the ModelOpt quantization recipe ``recipe`` without its ``*lm_head*`` entry (ModelOpt's
    recipes disable the LM head's quantizers with it), for ``--quantize-lm-head``."""
    recipe = copy.deepcopy(recipe)
    recipe["quant_cfg"] = [e for e in recipe["quant_cfg"] if e.get("quantizer_name") != "*lm_head*"]
    return recipe


def calibrate_fp8(ck: Checkpoint, fmt: QuantFormat, cfg: CalibrationConfig, quantize_lm_head: bool = False) -> dict[str, Fp8Amax]:
    """Run ModelOpt's FP8 calibration (``fmt.modelopt_config``) on the checkpoint's float32 weights.

    Returns HF linear name (``model.layers.{i}.self_attn.q_proj``, ...) -> :class:`Fp8Amax` for every
    decoder linear, and for ``lm_head`` too with ``quantize_lm_head`` (``--quantize-lm-head``: ModelOpt's
    recipe with the LM head's weight and input quantizers enabled; a tied LM head is calibrated on a copy
    of the embedding, which stays 16-bit). Raises :class:`BuildError` if ModelOpt is missing or a
    quantizer recorded no amax."""
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise BuildError(f"--qformat {fmt.name} needs NVIDIA ModelOpt ({exc}): pip install 'kilnlm[build]'") from None
    model = float_model(ck)
    # the default recipe leaves the LM head (and embeddings) unquantized
    recipe = getattr(mtq, fmt.modelopt_config)
    recipe = without_lm_head_exclusion(recipe) if quantize_lm_head else recipe
    batches = calibration_batches(ck.tokenizer, cfg)
    log.info("calibrating FP8 on %d samples x %d tokens of %s", len(batches), batches[0].shape[1], cfg.describe())
    loop = forward_loop(batches, "FP8 calibration", log.isEnabledFor(logging.INFO))
    model = mtq.quantize(model, recipe, loop)
    amax: dict[str, Fp8Amax] = {}
    for name, module in model.named_modules():
        wanted = name.startswith("model.layers.") or (quantize_lm_head and name == "lm_head")
        if not wanted or not hasattr(module, "weight_quantizer"):
            continue
        w_amax, in_amax = module.weight_quantizer.amax, module.input_quantizer.amax
        if w_amax is None or in_amax is None:
            raise BuildError(f"ModelOpt recorded no amax for {name}: the calibration did not reach it")
        amax[name] = Fp8Amax(float(w_amax.float().max()), float(in_amax.float().max()))
    if not amax:
        raise BuildError("ModelOpt FP8 calibration quantized no linear layer: check the model architecture")
    if quantize_lm_head and "lm_head" not in amax:
        raise BuildError("ModelOpt FP8 calibration did not quantize the LM head: report this as a kilnlm bug")
    return amax


def quantize_fp8_rowwise(ck: Checkpoint, fmt: QuantFormat, quantize_lm_head: bool = False,
                         float_linears: tuple[str, ...] = ()) -> tuple[dict[str, torch.Tensor], IntQuantization]:
    """Per-channel FP8 quantization of every decoder linear of the checkpoint (fp8_rowwise) but
    ``float_linears`` (HF names, left in the state dict), from the float weights alone: ModelOpt's max
    calibrator with axis 0 records exactly each row's amax, so no model forward and no calibration text
    are needed. With ``quantize_lm_head`` the LM head too (a tied one from the embedding, which stays
    float in the network).

    Returns (the checkpoint's state dict without the quantized linears' weights and biases, the quantized
    linears by HF module name for :class:`~kilnlm.builder.network.llama.LlamaNetwork`'s ``quant``)."""
    state = dict(ck.state_dict)
    projections = (*QKV_PROJS, O_PROJ, *GATE_UP_PROJS, DOWN_PROJ)
    names = [f"model.layers.{i}.{p}" for i in range(ck.config.num_hidden_layers) for p in projections]
    linears = {name: Fp8RowwiseLinear.quantize(state.pop(f"{name}.weight"), state.pop(f"{name}.bias", None))
               for name in names if f"{name}.weight" in state and name not in float_linears}  # a missing one: LlamaNetwork names it
    if quantize_lm_head:
        tied = bool(getattr(ck.config, "tie_word_embeddings", False))
        head = state.get("model.embed_tokens.weight") if tied else state.pop("lm_head.weight", None)
        if head is None:
            raise BuildError("checkpoint has no LM head weight (lm_head.weight, or model.embed_tokens.weight when "
                             "tied) to quantize: drop --quantize-lm-head or re-export the checkpoint")
        linears["lm_head"] = Fp8RowwiseLinear.quantize(head)
    log.info("quantized %d linears to FP8 per channel (%s recipe, from the weights alone)", len(linears),
             fmt.modelopt_config)
    return state, IntQuantization(qformat=fmt.name, group_size=None, linears=linears)


__all__ = ["CalibrationConfig", "calibration_batches", "calibrate_fp8", "quantize_fp8_rowwise"]
