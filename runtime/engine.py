"""Verify and load a built engine directory; run its forward through the backend of its target.

Integrity, compatibility and (with trusted keys) the signature are checked *before* anything is loaded
(:func:`verify_engine`): loading a compiled engine executes native code. The manifest's ``build.target`` picks the backend
(:mod:`kilnlm.runtime.backends`); :class:`Engine` is what the rest of the runtime sees, whatever the
target. Never imports kilnlm.builder or transformers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from kilnlm.runtime.abi import ACTIVATION_DTYPES, KV_CACHE_DTYPES, EngineInputs
from kilnlm.runtime.backends import EngineBackend, engine_backend
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.manifest import MANIFEST_NAME, SIGNATURE_NAME, Manifest, parse_manifest, read_manifest_bytes, verify_files
from kilnlm.runtime.signing import FROM_ENVIRONMENT, TrustedKeys, check_signature, read_signature, trusted_keys_of

__all__ = ["Engine", "verify_engine"]

TOKENIZER_DIR = "tokenizer"  # the engine directory's folder holding its tokenizer


def verify_engine(engine_dir: str | os.PathLike, trusted_keys: TrustedKeys | str | None = FROM_ENVIRONMENT) -> Manifest:
    """Check ``engine_dir`` without loading it: with trusted keys (``trusted_keys``: by default
    ``$KILNLM_TRUSTED_KEYS``'s, None: no check; :mod:`kilnlm.runtime.signing`) first that ``manifest.sig`` signs the manifest's
    bytes with one of them, then the manifest format version, every file's size and SHA-256 (no file
    missing, none added), plugin versions implemented by this kilnlm, a ``build.target`` this runtime has a
    backend for, supported dtypes, and the backend's own checks (``cpu``: a CPU vector ISA this machine
    has). Returns the manifest; raises :class:`EngineError` naming the offending file or field and what to
    do (:class:`~kilnlm.runtime.signing.SigningKeyError` for unusable trusted keys)."""
    from kilnlm.plugins import PLUGIN_ACCEPTED_VERSIONS, PLUGIN_VERSIONS

    root = Path(engine_dir)
    trusted = trusted_keys_of(trusted_keys)
    raw = read_manifest_bytes(root)
    if trusted is not None:
        check_signature(raw, read_signature(root), trusted, str(root / SIGNATURE_NAME))
    where = root / MANIFEST_NAME
    manifest = parse_manifest(raw, where)
    verify_files(root, manifest)
    for name, version in sorted(manifest.plugins.items()):
        if name not in PLUGIN_VERSIONS:
            raise EngineError(f"{where}: plugin {name!r} (version {version}) is not implemented by this kilnlm "
                              f"(has {', '.join(sorted(PLUGIN_VERSIONS))}): upgrade kilnlm or rebuild the engine with it")
        if version not in PLUGIN_ACCEPTED_VERSIONS.get(name, (PLUGIN_VERSIONS[name],)):
            raise EngineError(f"{where}: plugin {name!r} version {version} does not match this kilnlm's version "
                              f"{PLUGIN_VERSIONS[name]}: rebuild the engine with this kilnlm "
                              f"(built by kilnlm {manifest.toolchain.get('kilnlm', 'unknown')})")
    backend = engine_backend(manifest, where)
    if manifest.build.dtype not in ACTIVATION_DTYPES or manifest.build.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise EngineError(f"{where}: build.dtype {manifest.build.dtype!r} / kv_cache_dtype {manifest.build.kv_cache_dtype!r} "
                          f"not supported (dtype: {', '.join(ACTIVATION_DTYPES)}; kv_cache_dtype: {', '.join(KV_CACHE_DTYPES)}): "
                          "rebuild the engine")
    backend.verify(root, manifest)
    return manifest


class Engine:
    """A loaded engine: one compiled forward over the packed-batch ABI of :mod:`kilnlm.runtime.abi`, run by
    the backend of its target.

    Attributes: ``manifest``; ``backend`` (the target's :class:`~kilnlm.runtime.backends.EngineBackend`);
    ``dtype`` (activation dtype); ``kv_cache_dtype`` (the paged pool's dtype: ``dtype``, or float8_e4m3fn /
    int8 for an 8-bit KV cache); ``tokenizer_dir`` (holds tokenizer.json and tokenizer_config.json /
    chat_template.jinja)."""

    def __init__(self, engine_dir: Path, manifest: Manifest, backend: EngineBackend):
        self.engine_dir = engine_dir
        self.manifest = manifest
        self.backend = backend
        self.dtype = ACTIVATION_DTYPES[manifest.build.dtype]
        self.kv_cache_dtype = backend.kv_cache_dtype
        self.tokenizer_dir = engine_dir / TOKENIZER_DIR

    @classmethod
    def load(cls, engine_dir: str | os.PathLike, trusted_keys: TrustedKeys | str | None = FROM_ENVIRONMENT) -> "Engine":
        """:func:`verify_engine` (``trusted_keys``: see there), then load the engine with its target's
        backend. A tensor-parallel engine (``build.tp_size`` > 1) starts its other ranks, or, in a process a
        launcher such as torchrun started as one of them, joins theirs: there the call returns on rank 0 only,
        and every other rank serves rank 0 until it closes the engine, then exits
        (:mod:`kilnlm.runtime.backends.tensor_parallel`). Raises :class:`EngineError` for a refused engine or
        one that fails to load."""
        root = Path(engine_dir)
        return cls.load_verified(root, verify_engine(root, trusted_keys))

    @classmethod
    def load_verified(cls, engine_dir: Path, manifest: Manifest,
                      while_loading: Callable[[], None] | None = None) -> "Engine":
        """:meth:`load` without the checks: ``manifest`` is what :func:`verify_engine` has just returned for
        ``engine_dir``, so that a caller can do other work between the two. ``while_loading``: called once
        just before the load's longest call that releases the GIL, or not at all (a tensor-parallel engine):
        see :meth:`EngineBackend.load <kilnlm.runtime.backends.EngineBackend.load>`. Raises
        :class:`EngineError` for an engine that fails to load."""
        backend_cls = engine_backend(manifest, engine_dir / MANIFEST_NAME)
        if manifest.build.tp_size > 1:  # one process per rank
            from kilnlm.runtime.backends.tensor_parallel import TensorParallelBackend

            return cls(engine_dir, manifest, TensorParallelBackend.load(engine_dir, manifest, backend_cls))
        return cls(engine_dir, manifest, backend_cls.load(engine_dir, manifest, while_loading=while_loading))

    @property
    def broken(self) -> str | None:
        """Why the engine cannot run any more (a tensor-parallel rank died or a collective failed), or None
        while it can."""
        return getattr(self.backend, "broken", None)

    def close(self) -> None:
        """Release what the engine holds outside this process: a tensor-parallel engine's other ranks stop
        (:mod:`kilnlm.runtime.backends.tensor_parallel`). Idempotent; a no-op for one-rank engines."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all layers (K and V): element size of ``kv_cache_dtype`` (1 byte for
        an 8-bit KV cache, half of bfloat16's)."""
        return self.backend.kv_cache_bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Zeros ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` in the engine's
        ``kv_cache_dtype``, on the engine's device. Raises :class:`EngineError` for num_blocks < 1."""
        if num_blocks < 1:
            raise EngineError(f"num_blocks is {num_blocks}: the KV cache needs at least one block")
        return self.backend.allocate_kv_cache(num_blocks)

    def forward(self, inputs: EngineInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """One engine step over a packed batch; writes the new tokens' K/V into ``kv_cache`` in place.
        Returns ``logits [N, vocab_size] float32`` (N = ``len(inputs.logits_indices)``). Raises
        :class:`EngineError` when the batch exceeds the engine's build limits."""
        build = self.manifest.build
        if not 1 <= inputs.num_tokens <= build.max_num_tokens:
            raise EngineError(f"batch has {inputs.num_tokens} tokens but the engine takes 1..{build.max_num_tokens} "
                              "(max_num_tokens): schedule fewer tokens per step or rebuild with a larger --max-num-tokens")
        if not 1 <= inputs.num_seqs <= build.max_batch_size:
            raise EngineError(f"batch has {inputs.num_seqs} sequences but the engine takes 1..{build.max_batch_size} "
                              "(max_batch_size): schedule fewer sequences or rebuild with a larger --max-batch-size")
        if not 1 <= inputs.num_logits <= build.max_num_tokens:
            raise EngineError(f"batch asks for {inputs.num_logits} logits rows but the engine returns 1..{build.max_num_tokens} "
                              "(max_num_tokens): ask for fewer rows per step")
        if inputs.block_tables.shape[1] != build.max_blocks_per_seq:
            raise EngineError(f"block_tables has {inputs.block_tables.shape[1]} columns but the engine expects "
                              f"max_blocks_per_seq = {build.max_blocks_per_seq}")
        if kv_cache.dtype != self.kv_cache_dtype:
            raise EngineError(f"kv_cache is {kv_cache.dtype} but the engine expects {self.kv_cache_dtype}: "
                              "use Engine.allocate_kv_cache")
        return self.backend.forward(inputs, kv_cache)
