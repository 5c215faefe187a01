"""The engine cache key: which builds produce interchangeable engines.

``key = sha256(canonical JSON of inputs)`` (64 hex digits), where the inputs are

- ``checkpoint``: a content digest of the source checkpoint -- every file the build may read (for an HF
  directory: config, generation config, tokenizer files, ``*.safetensors``; for GGUF: the file), by
  name and SHA-256, never timestamps or the directory's path. Hashing the files is cheap next to loading
  them (SmolLM2-135M fp32: ~1 s for 540 MB on a busy 2-core machine, against minutes for a build), so
  the key is known before any conversion starts;
- ``build``: every field of the resolved build options (:class:`~kilnlm.builder.config.ResolvedBuildOptions`,
  defaults applied: ``dtype auto`` -> the activation dtype, unset calibration sizes / zero points -> the
  format's defaults, no calibration text -> the digest of the default texts) except
  :data:`EXCLUDED_FIELDS` (where the engine goes, overwriting, the smoke test, the signing key), file-valued options (e.g.
  calibration data) replaced by their content digest. Fields added to the options later are covered
  without touching this module;
- ``format_version``: the engine manifest's format version; ``plugins``: every plugin's version;
- ``toolchain``: the target's toolchain versions (:meth:`kilnlm.builder.targets.Target.toolchain_versions`;
  for ``cpu``: kilnlm, torch, C++ compiler, target and the CPU vector ISA inductor generates code for;
  memoized, :mod:`kilnlm.builder.toolchain`) and a digest of the builder / plugin / artifact-format sources.

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

import pydoc_data.topics

from kilnlm.builder.calibration import GENERAL_TEXT_PATH
from kilnlm.builder.config import ResolvedBuildOptions
from kilnlm.builder.errors import BuildError
from kilnlm.builder.targets import get_target
from kilnlm.builder.toolchain import kilnlm_source_digest, memoized
from kilnlm.plugins import PLUGIN_VERSIONS
from kilnlm.runtime import manifest as manifest_format

# Build option fields that do not change the engine: where it (or a side output such as an exported
# checkpoint) is written, whether an existing directory is replaced, the smoke test. (The checkpoint is
# keyed by its content, apart.)
EXCLUDED_FIELDS = frozenset({"checkpoint", "output", "overwrite", "smoke_test", "export_checkpoint", "sign_key",
                             "deferred"})  # deferred: a stand-in build is its stand-in target's build
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


def toolchain_for_key(target: str) -> dict[str, str]:
    """The toolchain part of the cache key: ``target``'s :meth:`~kilnlm.builder.targets.Target.toolchain_versions`
    (memoized per machine and compiler, :func:`kilnlm.builder.toolchain.memoized`) plus
    :func:`~kilnlm.builder.toolchain.kilnlm_source_digest` (always recomputed)."""
    versions = memoized(f"toolchain:{target}", get_target(target).toolchain_versions)
    return {**versions, "kilnlm_sources": kilnlm_source_digest()}


def _default_calibration_digest() -> dict[str, Any]:
    """What an unset ``calib_data`` stands for: kilnlm's ``data/general_en.txt`` and ``pydoc_data.topics``
    (which may change with the Python release), by content."""
    topics = Path(pydoc_data.topics.__file__)
    return {"default": ["general_en.txt", "pydoc_data.topics"],
            "content": [_digest_tree([GENERAL_TEXT_PATH], GENERAL_TEXT_PATH.parent), _digest_tree([topics], topics.parent)]}


def normalized_build_config(opts: ResolvedBuildOptions) -> dict[str, Any]:
    """The engine-affecting part of the resolved options ``opts`` as a JSON-ready dict: every field but
    :data:`EXCLUDED_FIELDS`, files by content, an unset ``calib_data`` by the default texts' content. An unset
    int4 group size stays unset: the build picks it per model (the format's 128, or the largest of 64/32/16
    that divides), so it is not the same as an explicit 128."""
    config = {f.name: _normalize(getattr(opts, f.name), f.name) for f in fields(opts) if f.name not in EXCLUDED_FIELDS}
    if opts.calib_data is None:
        config["calib_data"] = _default_calibration_digest()
    return config


def compute_cache_key(opts: ResolvedBuildOptions) -> CacheKey:
    """The cache key of building the resolved options ``opts`` (:func:`kilnlm.builder.config.resolve`).
    Reads and hashes the checkpoint's files but loads nothing. Raises :class:`BuildError` for a missing
    checkpoint."""
    inputs = {
        "checkpoint": checkpoint_content_digest(opts.checkpoint),
        "build": normalized_build_config(opts),
        "format_version": manifest_format.FORMAT_VERSION,
        "plugins": dict(sorted(PLUGIN_VERSIONS.items())),
        "toolchain": toolchain_for_key(opts.target),
    }
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return CacheKey(key=hashlib.sha256(canonical.encode()).hexdigest(), inputs=json.loads(canonical))


__all__ = ["CacheKey", "EXCLUDED_FIELDS", "checkpoint_content_digest", "compute_cache_key", "normalized_build_config",
           "toolchain_for_key"]
