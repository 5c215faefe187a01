"""The engine cache key: which builds produce interchangeable engines.

``key = sha256(canonical JSON of inputs)`` (64 hex digits), where the inputs are

- ``checkpoint``: a content digest of the source checkpoint -- every file the build may read (for an HF
  directory: config, generation config, tokenizer files, ``*.safetensors``; for GGUF: the file), by
  name and SHA-256, never timestamps or the directory's path. Hashing the files is cheap next to loading
  them (SmolLM2-135M fp32: ~1 s for 540 MB on a busy 2-core machine, against minutes for a build), so
  the key is known before any conversion starts;
- ``build``: every :class:`~kilnlm.builder.build.BuildOptions` field except :data:`EXCLUDED_FIELDS`
  (where the engine goes, overwriting, the smoke test), defaults resolved (``dtype auto`` -> the
  activation dtype, unset calibration sizes / calibration text -> their defaults),
  file-valued options (e.g. calibration data) replaced by their content digest. Fields added to
  ``BuildOptions`` later are covered without touching this module;
- ``format_version``: the engine manifest's format version; ``plugins``: every plugin's version;
- ``toolchain``: kilnlm's version and a digest of the builder / plugin / artifact-format sources, torch
  version, C++ compiler, target and the CPU vector ISA inductor generates code for (a TensorRT target
  adds its GPU SM architecture and TensorRT version here).

The key and its inputs are recorded in the engine's manifest (``cache_key``, ``cache_key_inputs``).
"""

from __future__ import annotations

import enum
import hashlib
import json
import os
from dataclasses import dataclass, fields, is_dataclass
from pathlib import Path
from typing import Any

from kilnlm.builder.errors import BuildError
from kilnlm.builder.toolchain import toolchain_for_key

# BuildOptions fields that do not change the engine: where it (or a side output such as an exported
# checkpoint) is written, whether an existing directory is replaced, the smoke test, how much is logged.
EXCLUDED_FIELDS = frozenset({"checkpoint", "output", "overwrite", "smoke_test", "quiet", "verbose", "verbosity",
                             "export_checkpoint"})
# Files in an HF checkpoint directory that no build reads (documentation, other weight formats).
_IGNORED_SUFFIXES = (".md", ".bin", ".pth", ".pt", ".h5", ".msgpack", ".ckpt", ".onnx", ".gguf", ".lock")
_IGNORED_NAMES = ("LICENSE", "LICENCE", "NOTICE", "USE_POLICY")


@dataclass
class CacheKey:
    """``key``: 64 hex digits; ``inputs``: the JSON-ready dict it digests (recorded in the manifest)."""

    key: str
    inputs: dict[str, Any]


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _digest_tree(files: list[Path], root: Path) -> str:
    """``sha256:`` over (relative name, content SHA-256) of ``files``, sorted by name."""
    digest = hashlib.sha256()
    for rel, file in sorted((f.relative_to(root).as_posix(), f) for f in files):
        digest.update(f"{rel}\0{_sha256_file(file)}\n".encode())
    return "sha256:" + digest.hexdigest()


def _checkpoint_files(path: Path) -> list[Path]:
    """The files of an HF checkpoint directory a build may read (top level, not hidden, not docs or
    weight formats kilnlm does not load)."""
    return [p for p in sorted(path.iterdir()) if p.is_file() and not p.name.startswith(".")
            and not p.name.endswith(_IGNORED_SUFFIXES) and not p.name.upper().startswith(_IGNORED_NAMES)]


def checkpoint_content_digest(path: str | os.PathLike) -> str:
    """Content digest (``sha256:<hex>``) of the checkpoint at ``path`` -- an HF directory or a ``.gguf``
    file -- independent of timestamps and of where it lies. Raises :class:`BuildError` if ``path`` does
    not exist."""
    path = Path(path)
    if path.is_file():
        return _digest_tree([path], path.parent)
    if path.is_dir():
        return _digest_tree(_checkpoint_files(path), path)
    raise BuildError(f"checkpoint {path} does not exist: pass --checkpoint an HF model directory or a .gguf file")


def _normalize(value: Any, name: str) -> Any:
    """A JSON value that identifies ``value``'s effect on the engine (files by content)."""
    if isinstance(value, Path) or (isinstance(value, str) and os.sep in value and os.path.exists(value)):
        path = Path(value)
        if path.is_dir():
            return {"content": _digest_tree([p for p in path.rglob("*") if p.is_file()], path)}
        if path.is_file():  # the content, and the suffix (it may choose the parser: .txt / .jsonl)
            return {"content": "sha256:" + _sha256_file(path), "suffix": path.suffix}
        return {"missing_path": str(value)}  # the build itself reports it
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _normalize(getattr(value, f.name), f"{name}.{f.name}") for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): _normalize(v, f"{name}.{k}") for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [_normalize(v, name) for v in value]
    if isinstance(value, enum.Enum):
        return _normalize(value.value, name)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return f"{type(value).__module__}.{type(value).__qualname__}:{value}"


def normalized_build_config(opts) -> dict[str, Any]:
    """The engine-affecting part of ``opts`` (a :class:`BuildOptions`) as a JSON-ready dict, defaults
    resolved: ``dtype auto`` -> the activation dtype; unset calibration sizes -> the defaults the build
    applies; unset calibration data -> the digest of the default texts (kilnlm's ``data/general_en.txt``
    and ``pydoc_data.topics``, which may change with the Python release). An unset int4 group size stays
    unset: the build picks it per model (128, or the largest of 64/32/16 that divides), so it is not the
    same as an explicit 128. Options a format does not use are refused by
    :func:`~kilnlm.builder.build.check_quant_options` (so they are always unset there) rather than dropped
    here. Raises :class:`BuildError` for options the build would refuse."""
    from kilnlm.builder import build

    build.check_quant_options(opts)
    config = {f.name: _normalize(getattr(opts, f.name), f.name) for f in fields(opts) if f.name not in EXCLUDED_FIELDS}
    config["dtype"] = build.resolve_dtype(opts.qformat, opts.dtype)
    defaults = (("calib_num_samples", build.default_calib_num_samples(opts.qformat)),
                ("calib_seq_len", build.DEFAULT_CALIB_SEQ_LEN))
    for name, default in defaults:
        if name in config and config[name] is None:
            config[name] = default
    if "calib_data" in config and config["calib_data"] is None:
        import pydoc_data.topics

        from kilnlm.builder.calibration import GENERAL_TEXT_PATH

        topics = Path(pydoc_data.topics.__file__)
        config["calib_data"] = {"default": ["general_en.txt", "pydoc_data.topics"],
                                "content": [_digest_tree([GENERAL_TEXT_PATH], GENERAL_TEXT_PATH.parent),
                                            _digest_tree([topics], topics.parent)]}
    return config


def compute_cache_key(opts) -> CacheKey:
    """The cache key of building ``opts`` (a :class:`BuildOptions`). Reads and hashes the checkpoint's
    files but loads nothing. Raises :class:`BuildError` for a missing checkpoint or bad options."""
    from kilnlm.plugins import PLUGIN_VERSIONS
    from kilnlm.runtime.manifest import FORMAT_VERSION

    inputs = {
        "checkpoint": checkpoint_content_digest(opts.checkpoint),
        "build": normalized_build_config(opts),
        "format_version": FORMAT_VERSION,
        "plugins": dict(sorted(PLUGIN_VERSIONS.items())),
        "toolchain": toolchain_for_key(),
    }
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return CacheKey(key=hashlib.sha256(canonical.encode()).hexdigest(), inputs=json.loads(canonical))


__all__ = ["CacheKey", "EXCLUDED_FIELDS", "checkpoint_content_digest", "compute_cache_key", "normalized_build_config"]
