"""Load a checkpoint -- a Hugging Face model directory or a ``.gguf`` file -- into plain tensors.

The builder never keeps a transformers model around: :func:`load_checkpoint` returns the model's
``PretrainedConfig``, a state dict of float32 CPU tensors (Hugging Face names), the tokenizer and the
generation config, plus a content digest of the source files (``sha256:<hex>``, independent of
timestamps and paths) that the manifest records.

Supported architectures: see :data:`SUPPORTED_ARCHITECTURES`.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kilnlm.builder.errors import BuildError

log = logging.getLogger(__name__)

# HF architecture name -> the network module that implements it (kilnlm.builder.network.<module>).
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
}


@dataclass
class Checkpoint:
    """A loaded checkpoint.

    ``state_dict``: Hugging Face parameter names -> float32 CPU tensors (``lm_head.weight`` absent when
    the embeddings are tied). ``tokenizer``: a transformers fast tokenizer (saved into the engine as
    ``tokenizer.json`` + ``tokenizer_config.json``)."""

    config: Any  # transformers.PretrainedConfig
    state_dict: dict[str, torch.Tensor]
    tokenizer: Any
    generation_config: Any | None
    digest: str  # "sha256:<hex>"
    source: Path
    smoothing_alpha: float | None = None  # SmoothQuant smoothing folded into state_dict (builder/smoothing.py)

    @property
    def architecture(self) -> str:
        return self.config.architectures[0]


def float_model(ck: Checkpoint, untie: bool = False):
    """A float32 transformers model (eval mode) holding ``ck``'s weights: what ModelOpt calibrates and the
    builder measures activations on. Tied embeddings stay tied, unless ``untie``: then the LM head gets a copy
    of the embedding of its own (a quantized LM head needs its own weight; the embedding stays float)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(ck.config)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if untie and tied:
        config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = dict(ck.state_dict)
    if untie and tied:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    model.load_state_dict(state, strict=False)
    if tied and not untie:
        model.tie_weights()
    return model.eval()


def load_checkpoint(path: str | os.PathLike) -> Checkpoint:
    """Load ``path`` -- an HF model directory (config.json + one or more ``*.safetensors``) or a ``.gguf``
    file -- into a :class:`Checkpoint`.

    Raises :class:`BuildError` for a missing path, an unsupported architecture, or truncated / corrupt
    tensor files."""
    path = Path(path)
    if not path.exists():
        raise BuildError(f"checkpoint {path} does not exist: pass --checkpoint an HF model directory or a .gguf file")
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path)
    if path.is_dir():
        return _load_hf_dir(path)
    raise BuildError(f"checkpoint {path} is neither a directory nor a .gguf file: pass an HF model directory (config.json + *.safetensors) or a .gguf file")


# GGUF files name a model type, not a transformers class.
_GGUF_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _refuse_unsupported(architectures: list[str] | None, model_type: Any, where: Path) -> None:
    """Raise :class:`BuildError` unless the first of ``architectures`` is one kilnlm builds."""
    if not architectures or architectures[0] not in SUPPORTED_ARCHITECTURES:
        found = architectures[0] if architectures else f"model_type {model_type!r}"
        raise BuildError(f"{where}: architecture {found} is not supported: kilnlm builds {', '.join(SUPPORTED_ARCHITECTURES)}")


def _check_architecture(config: Any, where: Path) -> None:
    if not getattr(config, "architectures", None) and getattr(config, "model_type", None) in _GGUF_MODEL_TYPES:
        config.architectures = [_GGUF_MODEL_TYPES[config.model_type]]
    _refuse_unsupported(list(getattr(config, "architectures", None) or []), getattr(config, "model_type", "?"), where)


def _load_config(path: Path) -> Any:
    from transformers import AutoConfig

    config_path = path / "config.json"
    if not config_path.is_file():
        raise BuildError(f"{config_path} is missing: an HF checkpoint directory needs config.json and *.safetensors")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BuildError(f"{config_path} is not valid JSON ({exc}): fix or re-export the checkpoint") from None
    # Checked on the raw JSON: transformers' AutoConfig itself fails on model types it does not know.
    _refuse_unsupported(raw.get("architectures"), raw.get("model_type"), config_path)
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as exc:
        raise BuildError(f"{config_path} cannot be read by transformers ({exc}): fix or re-export the checkpoint") from None


def _load_safetensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError, safe_open

    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name).to(torch.float32)
        except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
            msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise BuildError(f"{file} is truncated or corrupt ({msg}): re-download or re-export the checkpoint") from None
    return state


def _digest_files(files: list[Path], root: Path) -> str:
    """``sha256:`` over (relative name, content SHA-256) of each file, in sorted name order."""
    digest = hashlib.sha256()
    for file in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        content = hashlib.sha256()
        with open(file, "rb") as f:
            while chunk := f.read(1 << 20):
                content.update(chunk)
        digest.update(f"{file.relative_to(root).as_posix()}\0{content.hexdigest()}\n".encode())
    return "sha256:" + digest.hexdigest()


def _load_hf_dir(path: Path) -> Checkpoint:
    from transformers import AutoTokenizer, GenerationConfig

    config = _load_config(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise BuildError(f"{path} holds no *.safetensors files: kilnlm reads safetensors checkpoints (convert .bin with save_pretrained)")
    state = _load_safetensors(files)
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:
        raise BuildError(f"{path}: cannot load its tokenizer ({exc}): the checkpoint needs tokenizer.json / tokenizer_config.json") from None
    generation_config = None
    if (path / "generation_config.json").is_file():
        generation_config = GenerationConfig.from_pretrained(path)
    digest = _digest_files([path / "config.json", *files], path)
    return Checkpoint(config, state, tokenizer, generation_config, digest, path)


def _load_gguf(path: Path) -> Checkpoint:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:
        raise BuildError(f"{path} cannot be read as GGUF ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__}): check the file") from None
    _check_architecture(config, path)
    log.info("dequantizing GGUF tensors of %s", path.name)
    architectures = config.architectures
    # config given: transformers would otherwise parse the whole GGUF's metadata once more
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, config=config, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32).clone() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    generation_config = model.generation_config
    config = model.config
    config.architectures = architectures
    # The GGUF loader leaves a quantization_config that describes the *file*, not the float weights.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    return Checkpoint(config, state, tokenizer, generation_config, _digest_files([path], path.parent), path)


def save_as_hf_dir(checkpoint: Checkpoint, out_dir: str | os.PathLike) -> Path:
    """Write ``checkpoint`` as an ordinary HF directory (config.json, model.safetensors, tokenizer,
    generation_config.json) that ``AutoModelForCausalLM.from_pretrained`` reads -- e.g. to turn the
    bundled GGUF into a reference model for tests. A GGUF-loaded transformers model refuses
    ``save_pretrained``, so a plain model is built from the config and the float weights copied in."""
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_config(checkpoint.config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(checkpoint.state_dict, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise BuildError(f"cannot convert {checkpoint.source}: missing weights {missing[:3]}, unexpected {unexpected[:3]}")
    if getattr(checkpoint.config, "tie_word_embeddings", False):
        model.tie_weights()
    model.save_pretrained(out)
    if checkpoint.generation_config is not None:
        checkpoint.generation_config.save_pretrained(out)
    checkpoint.tokenizer.save_pretrained(out)
    return out
