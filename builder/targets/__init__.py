"""Build targets: one entry per ``kilnlm build --target``, each the "network -> artifact files" step.

A target compiles the eager network (whose ``forward`` is the engine ABI of :mod:`kilnlm.runtime.abi`) into
the files of an engine directory; the manifest records its name (``build.target``), the engine file
(``engine_file``) and its toolchain, and the runtime picks the backend of the same name to load it.
``cpu`` (AOTInductor, :mod:`kilnlm.builder.targets.cpu`) compiles engines kilnlm's runtime serves; ``onnx``
(:mod:`kilnlm.builder.targets.onnx_target`) writes the network as an ONNX model with kilnlm's plugin nodes,
the input of a TensorRT plan, which kilnlm's runtime does not serve; ``tensorrt``
(:mod:`kilnlm.builder.targets.tensorrt_target`) builds that plan where TensorRT and a GPU are, and the
runtime's ``tensorrt`` backend serves it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from kilnlm.builder.errors import BuildError
from kilnlm.builder.targets.cpu import CpuTarget
from kilnlm.builder.targets.onnx_target import OnnxTarget
from kilnlm.builder.targets.tensorrt_target import TensorRTTarget
from kilnlm.runtime.manifest import BuildConfig, ModelConfig


class Target(Protocol):
    """What a build target declares and does.

    ``name``: the ``--target`` value and the manifest's ``build.target``; ``description``: what it compiles
    to, for the CLI's help; ``engine_file``: the compiled engine's path relative to the engine directory
    (the manifest's ``engine_file``); ``served``: whether kilnlm's runtime loads its engines (with the
    backend of the same name, :data:`kilnlm.runtime.backends.ENGINE_BACKENDS`); ``tensor_parallel``: whether
    it compiles ``--tp-size`` shards (one engine file per rank, ``compile``'s ``engine_file``)."""

    name: str
    description: str
    engine_file: str
    served: bool
    tensor_parallel: bool

    def stand_in(self) -> tuple[str, str] | None:
        """Where this machine cannot compile the target: ``(the target to build instead, why)``, which
        :func:`kilnlm.builder.config.resolve` then builds (the tensorrt target's ONNX export without TensorRT
        or a GPU); None where it can."""

    def default_compile_options(self) -> Any:
        """The compile options used when :attr:`BuildOptions.compile` is None (a frozen dataclass: the
        cache key digests its fields)."""

    def toolchain_versions(self) -> dict[str, str]:
        """What the compiled engine depends on (versions of kilnlm, torch, the target compiler, the ISA or
        GPU architecture, ...): recorded in the manifest and digested by the cache key."""

    def compile(self, network: torch.nn.Module, model: ModelConfig, build: BuildConfig, dtype: torch.dtype,
                out_dir: Path, options: Any, engine_file: str | None = None) -> list[Path]:
        """Compile ``network`` (activations in ``dtype``) for the limits of ``build`` into files under
        ``out_dir`` and return their paths (``out_dir / engine_file`` first; ``engine_file`` None: the
        target's). Raises :class:`BuildError`."""


# --target name -> its implementation, in the order the CLI lists them.
TARGETS: dict[str, Target] = {target.name: target for target in (CpuTarget(), OnnxTarget(), TensorRTTarget())}


def get_target(name: str) -> Target:
    """The target called ``name``. Raises :class:`BuildError` naming the targets there are."""
    if name not in TARGETS:
        raise BuildError(f"--target {name!r} is not supported: choose one of {', '.join(TARGETS)}")
    return TARGETS[name]


__all__ = ["TARGETS", "Target", "get_target"]
