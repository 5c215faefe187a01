"""Engine backends: one entry per build target, behind one small protocol.

The manifest's ``build.target`` selects the backend that verifies and loads an engine; the executor, the
scheduler, the input builder and the sampler only ever see the protocol (through
:class:`kilnlm.runtime.engine.Engine`), so a new target is one module here plus one entry in
:data:`ENGINE_BACKENDS` -- nothing in the serving loop changes.

A backend class (the registry entry) answers two questions before and while loading::

    verify(engine_dir, manifest)        does this machine run the engine?  (reads files, loads nothing)
    load(engine_dir, manifest, rank=0)  -> a backend instance of tensor-parallel rank ``rank``'s shard
                                           (executes the engine's native code)

and a loaded backend offers the engine ABI of :mod:`kilnlm.runtime.abi`::

    kv_cache_dtype                        torch dtype of the paged pool
    kv_cache_bytes_per_block()            bytes of one KV block over all layers (KV pool sizing)
    allocate_kv_cache(num_blocks)         the pool, on the engine's device
    forward(inputs, kv_cache) -> logits   one packed step; writes the new K/V into kv_cache in place

| target   | module        | engine file                                              |
|----------|---------------|----------------------------------------------------------|
| cpu      | cpu.py        | ``model.pt2`` (AOTInductor package)                      |
| tensorrt | tensorrt.py   | ``rank0.engine`` (a serialized TensorRT plan; one GPU)   |

Importing this package imports no target's native runtime: the ``tensorrt`` backend imports ``tensorrt``
(and with it CUDA) only in ``verify`` / ``load``.

An engine built with ``--tp-size N`` runs its target's backend once per rank, rank 0 wrapped by
:class:`~kilnlm.runtime.backends.tensor_parallel.TensorParallelBackend` (:mod:`.tensor_parallel`), which
starts and drives the other ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, ClassVar, Protocol

import torch

from kilnlm.runtime.abi import EngineInputs
from kilnlm.runtime.backends.cpu import CpuBackend
from kilnlm.runtime.backends.tensorrt import TensorRTBackend
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.manifest import Manifest


class EngineBackend(Protocol):
    """A loaded engine of one target. ``verify`` and ``load`` are classmethods: the registry holds classes."""

    target: ClassVar[str]  # the manifest's build.target this backend runs
    kv_cache_dtype: torch.dtype

    @classmethod
    def verify(cls, engine_dir: Path, manifest: Manifest) -> None:
        """Refuse (:class:`EngineError`, saying what to do) an engine this machine cannot run; loads nothing."""

    @classmethod
    def load(cls, engine_dir: Path, manifest: Manifest, rank: int = 0,
             while_loading: Callable[[], None] | None = None) -> "EngineBackend":
        """Load the verified engine's shard of tensor-parallel rank ``rank`` (the engine itself when
        ``build.tp_size`` is 1). ``while_loading``, when given, is called once just before the load's longest
        call that releases the GIL, or not at all: what the caller then starts in another thread holding the
        GIL (the executor's tokenizer parse) runs beside that call instead of stalling the load's Python.
        Raises :class:`EngineError` when it fails to load."""

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one KV block over all layers, K and V."""

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` zeros in
        ``kv_cache_dtype`` on the engine's device."""

    def forward(self, inputs: EngineInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """``logits [N, vocab_size] float32``, CPU, of one packed step (N = ``inputs.num_logits``).
        ``inputs`` are CPU tensors (views of the input builder's buffers, valid until the next step) and
        the sampler reads the logits with numpy: a device backend copies in and out itself."""


# build.target -> backend class
ENGINE_BACKENDS: dict[str, type[EngineBackend]] = {backend.target: backend for backend in (CpuBackend, TensorRTBackend)}


def engine_backend(manifest: Manifest, where: Path) -> type[EngineBackend]:
    """The backend class of ``manifest.build.target``. Raises :class:`EngineError` for a target this
    kilnlm has no backend for (``where``: the manifest's path, for the message)."""
    target = manifest.build.target
    backend = ENGINE_BACKENDS.get(target)
    if backend is None:
        targets = ", ".join(sorted(ENGINE_BACKENDS))
        raise EngineError(f"{where}: build.target is {target!r} but this kilnlm runtime has no {target!r} backend "
                          f"(it runs {targets} engines): rebuild the engine for one of {targets}, or serve it with "
                          f"a kilnlm that has the {target} backend, on a {target} host")
    return backend
