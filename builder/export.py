"""The unified Hugging Face checkpoint that NVIDIA ModelOpt exports, written and read back.

``--export-checkpoint DIR`` writes it for other engines (vLLM, SGLang, TensorRT-LLM read it); the builder
itself also reads the integer formats' weights from it (into a temporary directory when the option is not
given), so the engine and the exported checkpoint hold the same quantization by construction.

What ModelOpt's ``export_hf_checkpoint`` writes (ModelOpt 0.47, checked against its ``quant_utils``):

- ``config.json`` with a ``quantization_config`` section (``quant_method: modelopt``, ``quant_algo``) and
  ``hf_quant_config.json`` (``quant_algo``: ``W4A16_AWQ`` for int4_awq / int4_wo, ``W8A16`` for int8_wo,
  ``W8A8_SQ_PER_CHANNEL`` for int8_sq; ``group_size``; ``exclude_modules``);
- per quantized linear ``<name>.weight`` and ``<name>.weight_scale`` (float32, ``amax / 7`` or ``amax /
  127``), ``<name>.input_scale`` (int8_sq, 0-dim, ``amax / 127``) and ``<name>.pre_quant_scale``
  (AWQ / SmoothQuant per-input-channel scale, float32 ``[in_features]``) where it was not folded.
  Fused-input linears (q/k/v, gate/up) are re-smoothed to one shared ``pre_quant_scale`` (the mean of
  theirs, weights re-quantized) and, for AWQ, that scale is folded into the preceding RMSNorm weight.

int4 with zero points (``--zero-point``, int4_awq's default): kilnlm re-rounds the int4 linears
asymmetrically after ModelOpt's export and rewrites them in place (:func:`write_int4_zero_points`): the same
``weight`` / ``weight_scale`` tensors plus ``<name>.weight_zero_point`` (int8 ``[out, in // group_size]``
in [-8, 7]; the weight is ``(q - zero_point) * weight_scale``), and ``has_zero_point: true`` in both
quantization sections (TensorRT-LLM's QuantConfig field, which ModelOpt writes as false). Engines that read
ModelOpt's W4A16_AWQ without zero points cannot serve such a checkpoint: ``--no-zero-point`` keeps
ModelOpt's own.

INT4 weights are packed by ModelOpt along the *output* dimension, TensorRT-LLM's layout::

    modelopt  weight [out // 2, in] uint8:  byte[r, c] = q[2r, c] (low nibble) | q[2r + 1, c] (high nibble)
    kilnlm    weight [out, in // 2] uint8:  byte[r, j] = q[r, 2j] (low nibble) | q[r, 2j + 1] (high nibble)

and :func:`read_unified_checkpoint` repacks them exactly (no re-quantization).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

from kilnlm.builder.errors import BuildError
from kilnlm.builder.formats import QuantFormat
from kilnlm.builder.network.layers import QuantizedWeights
from kilnlm.plugins.reference import pack_int4

log = logging.getLogger(__name__)

def export_unified_checkpoint(model, tokenizer, export_dir: Path) -> Path:
    """Write ModelOpt's unified HF checkpoint of a ``mtq.quantize``-d transformers ``model`` (modified in
    place by the export: re-smoothing, norm folding) plus ``tokenizer``'s files into ``export_dir``.
    Raises :class:`BuildError` when ModelOpt's export fails."""
    from modelopt.torch.export import export_hf_checkpoint

    export_dir = Path(export_dir)
    export_dir.mkdir(parents=True, exist_ok=True)
    try:
        export_hf_checkpoint(model, export_dir=export_dir)
    except (RuntimeError, ValueError, AssertionError, NotImplementedError) as exc:
        raise BuildError(f"ModelOpt could not export the quantized checkpoint to {export_dir} ({exc}): "
                         "report this with the model's config.json") from exc
    tokenizer.save_pretrained(export_dir)
    return export_dir


def load_tensors(export_dir: Path, suffixes: tuple[str, ...] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of the checkpoint's ``*.safetensors`` files by name: every one, or with ``suffixes``
    only those whose names end with one of them (the others are not read). Raises :class:`BuildError` when
    there are no files."""
    from safetensors import safe_open

    files = sorted(export_dir.glob("*.safetensors"))
    if not files:
        raise BuildError(f"{export_dir} holds no *.safetensors: ModelOpt's export did not write the checkpoint")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if suffixes is None or name.endswith(suffixes):
                    state[name] = f.get_tensor(name)
    return state


def quant_section(export_dir: Path) -> dict:
    """The ``quantization`` section of ``hf_quant_config.json`` (``quant_algo``, ``group_size``, ...).
    Raises :class:`BuildError` when it is missing."""
    path = Path(export_dir) / "hf_quant_config.json"
    if not path.is_file():
        raise BuildError(f"{path} is missing: {export_dir} is not a ModelOpt unified checkpoint")
    return json.loads(path.read_text())["quantization"]


def modelopt_int4_to_kilnlm(packed: torch.Tensor) -> torch.Tensor:
    """Repack ModelOpt's INT4 weight ``[out // 2, in] uint8`` (pairs of output rows per byte) into
    kilnlm's ``[out, in // 2] uint8`` (pairs of input columns per byte); values are unchanged."""
    low = (packed & 0xF).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    q = torch.stack((low, high), dim=1).reshape(packed.shape[0] * 2, packed.shape[1])  # [out, in]
    q = torch.where(q >= 8, q - 16, q)
    return pack_int4(q)


def kilnlm_int4_to_modelopt(q: torch.Tensor) -> torch.Tensor:
    """int4 values ``[out, in]`` in [-8, 7] (out even) -> ModelOpt's packing ``[out // 2, in] uint8``."""
    nibbles = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return (nibbles[0::2] | (nibbles[1::2] << 4)).contiguous()


def write_int4_zero_points(export_dir: Path, linears: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> None:
    """Replace int4 linears of the unified checkpoint in ``export_dir`` by asymmetric ones: ``linears`` maps
    an HF module name to ``(weight [out // 2, in] uint8 in ModelOpt's packing
    (:func:`kilnlm_int4_to_modelopt`), weight_scale [out, in // g] float32, zero_point [out, in // g] int8)``.
    Rewrites the safetensors files holding them (and the shard index, if any) and sets ``has_zero_point`` in
    hf_quant_config.json and config.json. Raises :class:`BuildError` for a module the checkpoint does not
    hold."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    export_dir = Path(export_dir)
    index_path = export_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    pending = dict(linears)
    for file in sorted(export_dir.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors = {name: f.get_tensor(name) for name in f.keys()}
            metadata = f.metadata()
        here = [name for name in pending if f"{name}.weight" in tensors]
        for name in here:
            packed, scale, zero_point = pending.pop(name)
            tensors[f"{name}.weight"] = packed.view(tensors[f"{name}.weight"].dtype)
            tensors[f"{name}.weight_scale"] = scale.float().contiguous()
            tensors[f"{name}.weight_zero_point"] = zero_point.to(torch.int8).contiguous()
            if index is not None:
                index["weight_map"][f"{name}.weight_zero_point"] = file.name
        if here:
            save_file(tensors, str(file), metadata=metadata)
    if pending:
        raise BuildError(f"{export_dir} holds no int4 weight for {', '.join(sorted(pending))}: report this as a kilnlm bug")
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2))
    for config_name, key in (("hf_quant_config.json", "quantization"), ("config.json", "quantization_config")):
        path = export_dir / config_name
        if path.is_file():
            config = json.loads(path.read_text())
            if key in config:
                config[key]["has_zero_point"] = True
                path.write_text(json.dumps(config, indent=2))


def read_unified_checkpoint(export_dir: Path, fmt: QuantFormat) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeights], int | None]:
    """Read a ModelOpt unified checkpoint back into kilnlm's layout.

    Returns ``(state_dict, linears, group_size)``: the unquantized tensors (float32, HF names: norms with
    AWQ's folded scales, embeddings, an unquantized LM head), the quantized linears by HF module name
    (``model.layers.0.self_attn.q_proj``, ``lm_head``) as :class:`QuantizedWeights` in the layouts of the
    ``kilnlm::int4_linear`` / ``int8_linear`` / ``int8_sq_linear`` schemas, and the int4 group size (None
    for int8). Raises :class:`BuildError` when the checkpoint's ``quant_algo`` is not ``fmt.modelopt_quant_algo``."""
    section = quant_section(export_dir)
    algo = section.get("quant_algo")
    if algo != fmt.modelopt_quant_algo:
        raise BuildError(f"{export_dir}: quant_algo {algo!r} is not {fmt.modelopt_quant_algo!r} (--qformat {fmt.name}): "
                         "ModelOpt quantized with a different recipe; report this as a kilnlm bug")
    group_size = int(section["group_size"]) if fmt.group_wise else None
    tensors = load_tensors(Path(export_dir))
    modules = sorted(name[: -len(".weight_scale")] for name in tensors if name.endswith(".weight_scale"))
    linears: dict[str, QuantizedWeights] = {}
    for name in modules:
        weight = tensors.pop(f"{name}.weight")
        if group_size is not None:
            weight = modelopt_int4_to_kilnlm(weight.view(torch.uint8))
        elif weight.dtype != torch.int8:
            raise BuildError(f"{export_dir}: {name}.weight is {weight.dtype}, expected int8 for --qformat {fmt.name}")
        pre_quant_scale = tensors.pop(f"{name}.pre_quant_scale", None)
        input_scale = tensors.pop(f"{name}.input_scale", None)
        zero_point = tensors.pop(f"{name}.weight_zero_point", None)
        if (zero_point is not None) != bool(section.get("has_zero_point", False)):
            raise BuildError(f"{export_dir}: has_zero_point is {section.get('has_zero_point', False)} but {name} "
                             f"{'has' if zero_point is not None else 'has no'} weight_zero_point: the checkpoint is "
                             "inconsistent; export it again")
        linears[name] = QuantizedWeights(
            weight=weight.contiguous(),
            weight_scale=tensors.pop(f"{name}.weight_scale").float().contiguous(),
            input_scale=None if input_scale is None else input_scale.float().reshape(()),
            pre_quant_scale=None if pre_quant_scale is None else pre_quant_scale.float().contiguous(),
            bias=tensors.pop(f"{name}.bias", None),
            zero_point=None if zero_point is None else zero_point.to(torch.int8).contiguous(),
        )
    state = {k: v.float() for k, v in tensors.items()}
    if not linears:
        raise BuildError(f"{export_dir}: ModelOpt quantized no linear layer: check the model architecture")
    return state, linears, group_size
