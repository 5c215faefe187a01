"""Runtime test fixtures: the SmolLM2 tokenizer files, and a tiny random-weight Llama wrapped as an *eager*
engine (the builder's network, uncompiled, calling the plain-torch reference paged attention) that has the
:class:`kilnlm.runtime.engine.Engine` interface. The eager engine lets the executor be tested for exact
greedy agreement with Hugging Face transformers without compiling anything; the compiled engines are
tested through the builder's ``tiny_engine_dir`` / ``smollm2_engine_fp32_dir`` fixtures where they exist."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from factories import build_config, make_manifest, make_tiny_checkpoint
from kilnlm.runtime.abi import EngineInputs, kv_cache_shape
from kilnlm.runtime.manifest import Manifest, ModelConfig


@pytest.fixture(scope="session")
def rt_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2's tokenizer files as transformers saves them (tokenizer.json, tokenizer_config.json,
    chat_template.jinja), converted from the bundled GGUF."""
    from transformers import AutoTokenizer

    from kilnlm.builder.bundled import smollm2_gguf_path

    gguf = smollm2_gguf_path()
    out = tmp_path_factory.mktemp("smollm2_tokenizer")
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def hf_tokenizer(rt_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(rt_tokenizer_dir)


def _register_reference_kernels():
    """Make ``kilnlm::paged_attention`` and ``kilnlm::gemm`` (the ops of the fp32 network) callable eagerly
    on CPU with their reference implementations, each unless some kernel is registered already (the C++
    kernels, loaded by an earlier test). Returns the library handle (keep it alive) or None."""
    import kilnlm.plugins  # noqa: F401  (declares the schema)
    from kilnlm.plugins.reference import gemm_reference, paged_attention_reference

    lib = None
    for name, reference in (("paged_attention", paged_attention_reference), ("gemm", gemm_reference)):
        if not torch._C._dispatch_has_kernel_for_dispatch_key(f"kilnlm::{name}", "CPU"):
            lib = lib or torch.library.Library("kilnlm", "IMPL")
            lib.impl(name, reference, "CPU")
    return lib


@dataclass
class EagerEngine:
    """The Engine interface over an uncompiled network (test stand-in for a compiled engine)."""

    manifest: Manifest
    network: torch.nn.Module
    dtype: torch.dtype = torch.float32
    tokenizer_dir: Path | None = None

    def kv_cache_bytes_per_block(self) -> int:
        m, b = self.manifest.model, self.manifest.build
        return m.num_layers * 2 * b.tokens_per_block * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        m, b = self.manifest.model, self.manifest.build
        return torch.zeros(kv_cache_shape(m.num_layers, num_blocks, b.tokens_per_block, m.num_kv_heads, m.head_dim), dtype=self.dtype)

    @torch.no_grad()
    def forward(self, inputs: EngineInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.network(*inputs.as_args(kv_cache))


@pytest.fixture(scope="session")
def make_build_config():
    """Factory: ``make_build_config(**overrides) -> BuildConfig`` (small CPU limits; factories.build_config)."""
    return build_config


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory, rt_tokenizer_dir) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), rt_tokenizer_dir, seed=0)


@pytest.fixture(scope="session")
def tiny_hf_model(tiny_hf_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_hf_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def make_eager_engine(tiny_hf_model, tiny_hf_checkpoint):
    """Factory: ``make_eager_engine(**build_overrides) -> EagerEngine`` over the tiny Llama."""
    from kilnlm.builder.network.llama import LlamaNetwork, model_config_from_hf

    lib = _register_reference_kernels()
    model_config: ModelConfig = model_config_from_hf(tiny_hf_model.config)
    state_dict = {k: v.detach().clone() for k, v in tiny_hf_model.state_dict().items() if k != "lm_head.weight" or not model_config.tie_word_embeddings}
    network = LlamaNetwork(model_config, state_dict, torch.float32).eval()

    def make(**build_overrides) -> EagerEngine:
        manifest = make_manifest(build_config(**build_overrides), model_config)
        return EagerEngine(manifest, network, torch.float32, tiny_hf_checkpoint)

    make.library = lib  # keep the op registration alive as long as the fixture
    yield make
