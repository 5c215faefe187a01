"""The ``onnx`` target: the network exported to ONNX (:mod:`kilnlm.builder.targets.onnx_export`), checked, and
smoke-tested with ONNX Runtime (:mod:`kilnlm.builder.targets.onnx_runtime`)."""

from __future__ import annotations

import importlib.metadata
import logging
from pathlib import Path

import torch

from kilnlm.builder.targets.onnx_export import MODEL_FILE, ONNX_OPSET, export_onnx
from kilnlm.builder.targets.onnx_runtime import OnnxRuntimeModel
from kilnlm.builder.targets.smoke import check_logits, one_token_inputs
from kilnlm.plugins import PLUGIN_VERSIONS
from kilnlm.runtime.abi import kv_cache_shape
from kilnlm.runtime.manifest import BuildConfig, ModelConfig

log = logging.getLogger(__name__)


def toolchain_versions() -> dict[str, str]:
    """kilnlm, torch, the ONNX toolchain (onnx, onnxscript) and the opset the export writes."""

    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return {"kilnlm": version("kilnlm"), "torch": torch.__version__, "onnx": version("onnx"),
            "onnxscript": version("onnxscript"), "onnx_opset": str(ONNX_OPSET), "target": OnnxTarget.name}


def smoke_test_onnx(engine_dir: Path, model: ModelConfig, build: BuildConfig) -> None:
    """Run one token through the exported model with ONNX Runtime (:mod:`kilnlm.builder.targets.onnx_runtime`)
    when its activations and pool are float32 (ONNX Runtime runs the attention plugin on float32 only; other
    exports were checked by ``onnx.checker`` alone). Raises :class:`BuildError` when the logits are not
    finite or not ``[1, vocab_size]``."""
    if build.dtype != "float32" or build.kv_cache_dtype != "float32":
        log.info("ONNX Runtime runs the attention plugin on float32 only: the %s export was checked by onnx.checker",
                 build.dtype)
        return
    kv_cache = torch.zeros(kv_cache_shape(model.num_layers, 1, build.tokens_per_block, model.num_kv_heads, model.head_dim))
    logits = OnnxRuntimeModel(Path(engine_dir) / MODEL_FILE).forward(one_token_inputs(build.max_blocks_per_seq), kv_cache)
    check_logits(logits, model.vocab_size, "ONNX Runtime smoke test of the export")


class OnnxTarget:
    """The ``onnx`` entry of :data:`kilnlm.builder.targets.TARGETS` (see :class:`~kilnlm.builder.targets.Target`):
    the network as ``model.onnx`` with kilnlm's plugin nodes, checked with ``onnx.checker`` and, for float32
    exports, run once with ONNX Runtime. It is the input a TensorRT plan is built from; kilnlm's runtime does
    not serve it."""

    name = "onnx"
    description = "ONNX model with kilnlm plugin nodes, the TensorRT target's input; not served"
    engine_file = MODEL_FILE
    served = False
    tensor_parallel = False

    def stand_in(self) -> None:
        return None

    def default_compile_options(self) -> None:
        return None

    def toolchain_versions(self) -> dict[str, str]:
        return toolchain_versions()

    def compile(self, network: torch.nn.Module, model: ModelConfig, build: BuildConfig, dtype: torch.dtype,
                out_dir: Path, options: None, engine_file: str | None = None) -> list[Path]:
        """Export ``network`` to ``out_dir / model.onnx`` and its weights (:func:`export_onnx`)."""
        return export_onnx(network, model, build, dtype, out_dir, PLUGIN_VERSIONS)

    def smoke_test(self, engine_dir: Path, model: ModelConfig, build: BuildConfig) -> None:
        smoke_test_onnx(engine_dir, model, build)
