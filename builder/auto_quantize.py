"""Mixed precision chosen on calibration text: which decoder linears stay 16-bit (``--auto-quantize-bits``).

A few linears carry most of a format's quantization error (on SmolLM2 FP8: the first layers' attention,
the down projections behind the massive activations of layers 11 and 29). NVIDIA ModelOpt's
``mtq.auto_quantize`` scores every linear's sensitivity on the calibration text (``method="gradient"``:
the first-order Taylor estimate of the loss change that quantizing it causes, summed over the calibration
samples) and keeps in 16 bits the ones that buy the most loss per weight byte, within a budget of
effective bits. ModelOpt groups the linears that kilnlm fuses (q / k / v, gate / up) so that a fused
linear is all quantized or all 16-bit. llama.cpp's ``Q4_K_M`` mixes precisions the same way (by a fixed
rule instead of a search); TensorRT-LLM records the linears left out as ``quantization.exclude_modules``.

The budget is kilnlm's ``--auto-quantize-bits``: the mean bits per weight of the decoder's linears (8 =
every linear FP8, 8.5 = up to 1/16 of their weights in bfloat16). ModelOpt's ``effective_bits`` also
counts the layers the search may not touch (the LM head, always 16-bit here: ``--quantize-lm-head``
quantizes it outside the search), so the budget is converted (:func:`modelopt_effective_bits`).
"""

from __future__ import annotations

import contextlib
import io
import logging
import time
import warnings

import torch

from kilnlm.builder.calibration import CalibrationConfig, calibration_batches
from kilnlm.builder.checkpoint import Checkpoint
from kilnlm.builder.errors import BuildError
from kilnlm.builder.formats import QuantFormat

log = logging.getLogger(__name__)

DECODER_PREFIX = "model.layers."  # the HF names of the linears the search may keep 16-bit
SEARCH_BATCH = 4  # calibration samples per forward / backward of the search
FLOAT_BITS = 16


def modelopt_effective_bits(bits: float, searched_weights: int, fixed_float_weights: int) -> float:
    """ModelOpt's ``effective_bits`` constraint for a budget of ``bits`` per weight over ``searched_weights``
    decoder-linear weights, when ``fixed_float_weights`` more (the LM head) stay 16-bit outside the search."""
    return (bits * searched_weights + FLOAT_BITS * fixed_float_weights) / (searched_weights + fixed_float_weights)


@contextlib.contextmanager
def _quiet_unless(show: bool):
    """ModelOpt's search prints unconditionally (tqdm bars for every pass, the quantizers it inserts, warnings
    about its own settings): without ``show`` (a ``--quiet`` build) its output is dropped; an exception still
    propagates."""
    if show:
        yield
        return
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def search_float_linears(ck: Checkpoint, fmt: QuantFormat, calibration: CalibrationConfig, bits: float) -> tuple[str, ...]:
    """Run ModelOpt's ``auto_quantize`` with ``fmt``'s recipe on the checkpoint's float32 model, scored on
    the calibration text, with at most ``bits`` bits per decoder-linear weight on average.

    Returns the HF names (``model.layers.{i}.self_attn.q_proj``, ...) of the decoder linears to keep in the
    activation dtype, sorted; every part of a fused linear or none. Raises :class:`BuildError` if ModelOpt
    is missing or the search exceeds the budget."""
    try:
        import modelopt.torch.quantization as mtq
    except ImportError as exc:
        raise BuildError(f"--auto-quantize-bits needs NVIDIA ModelOpt ({exc}): pip install 'kilnlm[build]'") from None
    from kilnlm.builder.checkpoint import float_model

    model = float_model(ck)
    linears = {name: m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    searched = {name: n for name, n in linears.items() if name.startswith(DECODER_PREFIX)}
    fixed = sum(linears.values()) - sum(searched.values())
    target = modelopt_effective_bits(bits, sum(searched.values()), fixed)
    batches = calibration_batches(ck.tokenizer, calibration)
    loader = [torch.cat(batches[i:i + SEARCH_BATCH]) for i in range(0, len(batches), SEARCH_BATCH)]
    log.info("auto_quantize: scoring %d linears on %d samples x %d tokens of %s (%.2f bits per weight)", len(searched),
             len(batches), batches[0].shape[1], calibration.describe(), bits)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with _quiet_unless(log.isEnabledFor(logging.INFO)):
        model, _ = mtq.auto_quantize(
            model, constraints={"effective_bits": target}, quantization_formats=[getattr(mtq, fmt.modelopt_config)],
            data_loader=loader, forward_step=lambda m, ids: m(ids, labels=ids), loss_func=lambda out, ids: out.loss,
            disabled_layers=[f"*{name}*" for name in linears if name not in searched],
            num_calib_steps=len(loader), num_score_steps=len(loader), method="gradient")
    kept = tuple(sorted(name for name, m in model.named_modules()
                        if name in searched and not m.weight_quantizer.is_enabled))
    kept_bits = fmt.weight_bits + (FLOAT_BITS - fmt.weight_bits) * sum(searched[n] for n in kept) / sum(searched.values())
    if kept_bits > bits + 1e-6:
        raise BuildError(f"ModelOpt auto_quantize kept {len(kept)} linears in 16 bits, {kept_bits:.3f} bits per weight "
                         f"against --auto-quantize-bits {bits}: report this as a kilnlm bug")
    log.info("auto_quantize took %.1f s: %d of %d linears stay 16-bit (%.3f bits per weight): %s",
             time.perf_counter() - t0, len(kept), len(searched), kept_bits, ", ".join(kept) or "none")
    return kept


__all__ = ["modelopt_effective_bits", "search_float_linears"]
