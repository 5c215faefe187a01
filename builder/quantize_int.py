"""Integer post-training quantization (int4_awq, int4_wo, int8_wo, int8_sq) with NVIDIA ModelOpt.

Every format goes through ModelOpt and its unified Hugging Face export (:mod:`kilnlm.builder.export`):

=========  ===============================================  ==========================================
qformat    ModelOpt recipe                                   calibration
=========  ===============================================  ==========================================
int4_awq   ``INT4_AWQ_CFG`` (awq_lite), block size =         activation-aware scale search on the text
           ``--group-size`` along the input dimension        (Lin et al., AWQ, 2023)
int4_wo    ``INT4_BLOCKWISE_WEIGHT_ONLY_CFG``, same blocks   none: round-to-nearest, scale = amax / 7
int8_wo    ``INT8_WEIGHT_ONLY_CFG`` (per output channel)     none: round-to-nearest, scale = amax / 127
int8_sq    ``INT8_SMOOTHQUANT_CFG`` (per-channel weights,    SmoothQuant (Xiao et al., 2023): smoothing
           per-tensor activations; by default kilnlm's op   factors and activation amax on the text;
           quantizes them per token at run time instead)     alpha 0.5, or searched (below) per tensor
=========  ===============================================  ==========================================

SmoothQuant's migration strength alpha decides how much of the activations' range moves into the weights;
its paper tunes it per model (0.5 for most, up to 0.8-0.85 for GLM / Llama-class models with stronger
activation outliers). Without ``--smoothquant-alpha``, a per-tensor int8_sq build tries each alpha of
:data:`~kilnlm.builder.formats.SMOOTHQUANT_ALPHA_GRID` and keeps the quantized model with the lowest next-token loss on validation
windows of the calibration text (disjoint from the calibration windows; never the evaluation text). The
calibration windows themselves would favour the alpha whose activation ranges fit them best: on SmolLM2
they ranked 0.9 above 0.8, against held-out text (docs/quantization.md). With ``--per-token`` it is
:data:`~kilnlm.builder.formats.PER_TOKEN_SMOOTHQUANT_ALPHA`, TensorRT-LLM's documented recipe
(``--smoothquant 0.5 --per_token``).

Symmetric integers: int4 in [-8, 7] with ``scale = amax / 7`` per group, int8 in [-128, 127] with
``scale = amax / 127`` (ModelOpt's convention, checked in its ``quant_utils``).

int4 zero points (``--zero-point``, int4_awq's default): ModelOpt quantizes int4 symmetrically only, which
wastes a level and the half of the range a group's weights do not use. With zero points each group is
rounded over its own ``[min(w, 0), max(w, 0)]`` instead (:func:`quantize_int4_asymmetric`: 16 levels,
``scale = (max - min) / 15``, an integer zero point), AWQ's own quantizer (Lin et al., 2023,
``zero_point=True`` in llm-awq and AutoAWQ). ModelOpt still searches AWQ's scales; only the final rounding
of the smoothed weights is kilnlm's (:func:`requantize_with_zero_points`). On SmolLM2-135M (group 64) it
takes int4_awq from +24% to about +11% perplexity over fp32 (docs/quantization.md).

The weight-only recipes calibrate from the weights alone (``forward_loop=None``), so their builds read no
text. ModelOpt's export gives the parts of fused linears (q/k/v, gate/up) one shared ``pre_quant_scale``
(their mean; weights re-quantized) and folds AWQ's into the preceding RMSNorm; kilnlm folds SmoothQuant's
the same way (:func:`kilnlm.builder.network.llama.fold_smoothing_into_norms`), the LM head's
(``--quantize-lm-head``) into the final norm; o_proj / down_proj keep theirs as the op's ``pre_quant_scale``.
Embeddings and (unless ``--quantize-lm-head``) the LM head stay 16-bit.

Determinism: the calibration batches are fixed (:mod:`kilnlm.builder.calibration`), ModelOpt's recipes here
draw no random numbers, and torch's RNG is seeded before calibration anyway.
"""

from __future__ import annotations

import copy
import logging
import tempfile
from pathlib import Path

import torch

from kilnlm.builder.calibration import calibration_batches, forward_loop
from kilnlm.builder.checkpoint import Checkpoint, float_model
from kilnlm.builder.config import ResolvedBuildOptions
from kilnlm.builder.errors import BuildError
from kilnlm.builder.export import export_unified_checkpoint, read_unified_checkpoint
from kilnlm.builder.formats import SMOOTHQUANT_ALPHA_GRID, QuantFormat
from kilnlm.builder.network.layers import IntQuantization
from kilnlm.builder.network.llama import fold_smoothing_into_norms
from kilnlm.builder.quantize import without_lm_head_exclusion

log = logging.getLogger(__name__)

# Group sizes offered in error messages (the int4 kernels' natural block widths).
GROUP_SIZE_CHOICES = (16, 32, 64, 128, 256)


def linear_in_features(hf_config) -> dict[str, int]:
    """Input width of each kind of decoder linear (HF names relative to ``model.layers.{i}``)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    hidden = hf_config.hidden_size
    return {"self_attn.q_proj / k_proj / v_proj": hidden, "self_attn.o_proj": hf_config.num_attention_heads * head_dim,
            "mlp.gate_proj / up_proj": hidden, "mlp.down_proj": hf_config.intermediate_size}


def check_group_size(hf_config, group_size: int, quantize_lm_head: bool) -> None:
    """Refuse a ``--group-size`` that does not divide every quantized linear's in_features (or is odd: two
    int4 columns share a byte), naming the first such layer and the sizes that would work."""
    widths = linear_in_features(hf_config)
    if quantize_lm_head:
        widths["lm_head"] = hf_config.hidden_size
    common = 0
    for width in widths.values():
        common = torch.gcd(torch.tensor(common), torch.tensor(width)).item() if common else width
    valid = [g for g in GROUP_SIZE_CHOICES if common % g == 0] or [common]
    bad = next((name for name, width in widths.items() if group_size < 2 or group_size % 2 or width % group_size), None)
    if bad is not None:
        raise BuildError(f"--group-size {group_size} does not divide {bad} (in_features {widths[bad]:,}): int4 groups "
                         f"must evenly split every quantized linear's input; valid group sizes for this model: "
                         f"{', '.join(map(str, valid))}")


def default_group_size(hf_config, quantize_lm_head: bool, preferred: int = 128) -> int:
    """``preferred`` (128, TensorRT-LLM's default) when it divides every quantized linear's in_features,
    else the largest of 64 / 32 / 16 that does (SmolLM2's hidden size 576 = 9 x 64 takes 64). Raises
    :class:`BuildError` through :func:`check_group_size` when none does."""
    for size in (preferred,) + tuple(g for g in (64, 32, 16) if g < preferred):
        try:
            check_group_size(hf_config, size, quantize_lm_head)
        except BuildError:
            continue
        if size != preferred:
            log.info("--group-size not given and %d does not divide every linear's in_features: using %d", preferred, size)
        return size
    check_group_size(hf_config, preferred, quantize_lm_head)  # raises, naming the layer
    return preferred


def modelopt_recipe(fmt: QuantFormat, group_size: int, quantize_lm_head: bool,
                    smoothquant_alpha: float | None = None) -> dict:
    """A deep copy of ModelOpt's recipe for ``fmt`` (:attr:`QuantFormat.modelopt_config`) with the int4 block
    size set to ``group_size``, with ``quantize_lm_head``, the LM head's weight quantizer enabled (its input
    quantizer too for a W8A8 format, so that SmoothQuant smooths and calibrates the head like any other
    linear), and for SmoothQuant the alpha set to ``smoothquant_alpha`` (None keeps the recipe's)."""
    import modelopt.torch.quantization as mtq

    recipe = copy.deepcopy(getattr(mtq, fmt.modelopt_config))
    entries = recipe["quant_cfg"]
    for entry in entries:
        if entry.get("quantizer_name") == "*weight_quantizer" and "block_sizes" in entry.get("cfg", {}):
            entry["cfg"]["block_sizes"] = {-1: group_size, "type": "static"}
    if quantize_lm_head:
        weight_cfg = next(e["cfg"] for e in entries if e.get("quantizer_name") == "*weight_quantizer")
        recipe = without_lm_head_exclusion(recipe)
        # W8A8 for W8A8 formats (SmoothQuant then smooths the head too); weight-only for the others
        input_entry = next((e for e in entries if e.get("quantizer_name") == "*input_quantizer"), None)
        head_input = ({"quantizer_name": "*lm_head*input_quantizer", "cfg": copy.deepcopy(input_entry["cfg"])}
                      if fmt.quantizes_activations else {"quantizer_name": "*lm_head*input_quantizer", "enable": False})
        recipe["quant_cfg"] += [{"quantizer_name": "*lm_head*weight_quantizer", "cfg": copy.deepcopy(weight_cfg)},
                                head_input]
    if fmt.smoothquant and smoothquant_alpha is not None:
        recipe["algorithm"] = {"method": "smoothquant", "alpha": float(smoothquant_alpha)}
    return recipe


def calibration_loss(model, batches: list[torch.Tensor], group_size: int = 8) -> float:
    """Mean next-token negative log-likelihood (nats per predicted token) of ``model`` (a transformers causal
    LM, possibly with ModelOpt quantizers) on ``batches`` ([1, seq_len] int64 each), in groups of
    ``group_size`` samples per forward."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(batches), group_size):
            ids = torch.cat(batches[i:i + group_size])
            logits = model(ids).logits[:, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                             reduction="sum"))
            count += ids[:, 1:].numel()
    return total / count


def search_smoothquant_alpha(model, fmt: QuantFormat, quantize_lm_head: bool, batches: list[torch.Tensor], loop):
    """Quantize a copy of the float ``model`` with each alpha of :data:`~kilnlm.builder.formats.SMOOTHQUANT_ALPHA_GRID` (calibrated
    by ``loop``), rank them by :func:`calibration_loss` on ``batches``, the validation windows (ties: the
    first), and return ``(alpha, model quantized in place with it)``. Only one candidate is held at a time
    (peak memory: two copies of the model), at the price of quantizing the winner once more (deterministic:
    the same model as its candidate)."""
    import modelopt.torch.quantization as mtq

    def quantize(target, alpha: float):
        torch.manual_seed(0)
        return mtq.quantize(target, modelopt_recipe(fmt, 128, quantize_lm_head, alpha), loop)

    baseline = calibration_loss(model, batches)
    losses = {}
    for alpha in SMOOTHQUANT_ALPHA_GRID:
        candidate = quantize(copy.deepcopy(model), alpha)
        losses[alpha] = calibration_loss(candidate, batches)
        del candidate
        log.info("%s SmoothQuant alpha %.1f: validation loss %+.4f nats/token over the float model", fmt.name, alpha,
                 losses[alpha] - baseline)
    alpha = min(losses, key=losses.get)
    log.info("%s: SmoothQuant alpha %.1f (lowest validation loss, %+.4f nats/token)", fmt.name, alpha,
             losses[alpha] - baseline)
    return alpha, quantize(model, alpha)


def quantize_int4_asymmetric(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round ``weight`` ``[out, in]`` to int4 with a scale and zero point per group of ``group_size``
    input columns: each group spans ``[lo, hi] = [min(w, 0), max(w, 0)]`` in 16 levels, ``scale = (hi - lo)
    / 15`` (float32; 1 for an all-zero group), ``z = round(-lo / scale)`` in [0, 15] and ``u = clamp(round(w
    / scale) + z, 0, 15)`` (AWQ's asymmetric quantizer, Lin et al. 2023, with zero kept inside the range so
    no weight is clipped). Stored in the kernel's signed form: ``q = u - 8`` and ``zero_point = z - 8``, so
    ``(q - zero_point) * scale`` is the dequantized weight, within ``scale / 2`` of ``w``.

    Returns ``(q [out, in] int8, scale [out, in // group_size] float32, zero_point [out, in // group_size]
    int8)``."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    lo, hi = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
    scale = (hi - lo) / 15
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.round(-lo / scale).clamp(0, 15)
    levels = torch.clamp(torch.round(groups / scale[..., None]) + zero[..., None], 0, 15)
    return ((levels - 8).to(torch.int8).reshape(out_features, in_features), scale.contiguous(),
            (zero - 8).to(torch.int8).contiguous())


# The norm whose weight ModelOpt's export folds a fused linear's shared pre_quant_scale into.
_PRECEDING_NORM = (("self_attn.q_proj", "input_layernorm"), ("self_attn.k_proj", "input_layernorm"),
                   ("self_attn.v_proj", "input_layernorm"), ("mlp.gate_proj", "post_attention_layernorm"),
                   ("mlp.up_proj", "post_attention_layernorm"))


def smoothed_input_scale(name: str, exported: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The per-input-channel factor ``p`` the exported linear ``name`` sees its input multiplied by (AWQ's
    ``pre_quant_scale``): its own ``pre_quant_scale`` when the export kept one, else the ratio of the
    preceding RMSNorm's exported weight to its original one (the export folded ``p`` into it), else None.
    The smoothed float weight the int4 values approximate is then ``W / p``."""
    if f"{name}.pre_quant_scale" in exported:
        return exported[f"{name}.pre_quant_scale"].float()
    norm = "model.norm" if name == "lm_head" else None
    for suffix, norm_name in _PRECEDING_NORM:
        if name.endswith(suffix):
            norm = f"{name[: -len(suffix)]}{norm_name}"
    if norm is None or f"{norm}.weight" not in exported:
        return None
    folded, plain = exported[f"{norm}.weight"].float(), original[f"{norm}.weight"].float()
    return torch.where(plain != 0, folded / torch.where(plain != 0, plain, torch.ones_like(plain)), torch.ones_like(plain))


def requantize_with_zero_points(export_dir: Path, ck: Checkpoint, group_size: int) -> None:
    """Re-round every int4 linear of ModelOpt's unified checkpoint in ``export_dir`` asymmetrically
    (:func:`quantize_int4_asymmetric`) from the checkpoint's float weights, smoothed by the scales ModelOpt's
    AWQ chose (:func:`smoothed_input_scale`), and rewrite it with zero points
    (:func:`kilnlm.builder.export.write_int4_zero_points`)."""
    from kilnlm.builder.export import kilnlm_int4_to_modelopt, load_tensors, write_int4_zero_points

    # what the re-rounding reads: which linears are int4 (their scales), AWQ's scales and the norms they were
    # folded into; not the packed weights or the embedding
    exported = load_tensors(export_dir, suffixes=(".weight_scale", ".pre_quant_scale", "norm.weight"))
    original = ck.state_dict
    names = sorted(n[: -len(".weight_scale")] for n in exported if n.endswith(".weight_scale"))
    linears = {}
    for name in names:
        weight = original.get(f"{name}.weight")
        if weight is None and name == "lm_head":  # tied: the LM head is the embedding
            weight = original["model.embed_tokens.weight"]
        weight = weight.float()
        p = smoothed_input_scale(name, exported, original)
        q, scale, zero_point = quantize_int4_asymmetric(weight if p is None else weight / p, group_size)
        linears[name] = (kilnlm_int4_to_modelopt(q), scale, zero_point)  # packed at once: half a byte per weight held
    write_int4_zero_points(export_dir, linears)
    log.info("int4 zero points: re-rounded %d linears asymmetrically (groups of %d)", len(linears), group_size)


def quantize_int(ck: Checkpoint, opts: ResolvedBuildOptions) -> tuple[dict[str, torch.Tensor], IntQuantization]:
    """Quantize ``ck`` with ModelOpt's recipe for ``opts.format``, export the unified HF checkpoint (to
    ``opts.export_checkpoint``, or a temporary directory) and read it back into kilnlm's layout. A per-tensor
    SmoothQuant build without ``opts.smoothquant_alpha`` searches SmoothQuant's alpha (:func:`search_smoothquant_alpha`).

    Returns ``(state_dict, quant)``: the float tensors the network still needs (float32, HF names; norms
    with the folded smoothing / AWQ scales) and the quantized linears. Raises :class:`BuildError` for a
    missing ModelOpt, an invalid group size or calibration data, or an export ModelOpt cannot write."""
    fmt = opts.format
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise BuildError(f"--qformat {fmt.name} needs NVIDIA ModelOpt ({exc}): pip install 'kilnlm[build]'") from None
    group_size = opts.group_size
    if fmt.group_wise:
        if group_size is None:
            group_size = default_group_size(ck.config, opts.quantize_lm_head, fmt.group_size)
        check_group_size(ck.config, group_size, opts.quantize_lm_head)
    model = float_model(ck, untie=opts.quantize_lm_head)
    loop = None
    if fmt.calibrated:
        batches = calibration_batches(ck.tokenizer, opts.calibration)
        log.info("calibrating %s (ModelOpt) on %d samples x %d tokens of %s", fmt.name, len(batches),
                 batches[0].shape[1], opts.calibration.describe())
        loop = forward_loop(batches, f"{fmt.name} calibration", log.isEnabledFor(logging.INFO))
    else:
        log.info("quantizing %s (ModelOpt, round-to-nearest from the weights; no calibration data)", fmt.name)
    if fmt.smoothquant and opts.smoothquant_alpha is None:
        validation = calibration_batches(ck.tokenizer, opts.calibration, validation=True)
        _, model = search_smoothquant_alpha(model, fmt, opts.quantize_lm_head, validation, loop)
    else:
        torch.manual_seed(0)
        model = mtq.quantize(model, modelopt_recipe(fmt, group_size or 128, opts.quantize_lm_head, opts.smoothquant_alpha),
                             loop)
    with tempfile.TemporaryDirectory(prefix="kilnlm-export-") as tmp:
        export_dir = opts.export_checkpoint if opts.export_checkpoint is not None else Path(tmp)
        export_unified_checkpoint(model, ck.tokenizer, export_dir)
        if opts.export_checkpoint is not None:
            log.info("wrote the unified HF checkpoint (ModelOpt format) to %s", export_dir)
        if opts.zero_point:
            requantize_with_zero_points(export_dir, ck, group_size)
        state, linears, group_size = read_unified_checkpoint(export_dir, fmt)
    quant = IntQuantization(fmt.name, group_size, linears, per_token=opts.per_token)
    if opts.quantize_lm_head and "lm_head" not in linears:
        raise BuildError("ModelOpt did not quantize the LM head although --quantize-lm-head was given: report this as a kilnlm bug")
    if fmt.smoothquant:
        fold_smoothing_into_norms(state, quant, ck.config.num_hidden_layers)
    if getattr(ck.config, "tie_word_embeddings", False) and not opts.quantize_lm_head:
        state.pop("lm_head.weight", None)
    return state, quant
