"""The ``cpu`` target: export the network with ``torch.export`` and compile it ahead of time with
AOTInductor into one ``.pt2`` package (``model.pt2``), which the runtime's CPU backend loads.

Dynamic dimensions: T (packed tokens, 1..max_num_tokens), B (sequences, 1..max_batch_size; ``cu_seqlens_q``
is B+1), N (logits rows, 1..max_num_tokens) and num_blocks (the KV pool's size, chosen by the runtime). ``max_blocks_per_seq`` =
ceil(max_seq_len / tokens_per_block) is fixed. Weights are frozen into the package as constants.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.export import Dim

from kilnlm.builder.errors import BuildError
from kilnlm.builder.targets.smoke import check_logits, one_token_inputs
from kilnlm.builder.toolchain import inductor_cpu_isa
from kilnlm.runtime.abi import KV_CACHE_DTYPES, EngineInputs, kv_cache_shape
from kilnlm.runtime.manifest import BuildConfig, ModelConfig

log = logging.getLogger(__name__)


def default_inductor_configs() -> dict:
    """Inductor settings for the CPU target, measured with ``tests/builder/bench_compile.py`` on SmolLM2
    fp32 (30 layers, 2 shared cores, minimum of interleaved rounds): freezing on / off / with oneDNN weight
    pre-packing all ran a generation step in 31.4 ms (B=1; ~17 GB/s of weights read), 52-55 ms (B=8) and
    354-357 ms for a 256-token context step, and the step time did not change with an 8x larger KV pool
    (755 MB -> 6 GB: the pool is written in place, never copied). ``freezing`` is kept for the constant
    folding; ``cpp.weight_prepack`` is off because with a [vocab, hidden] LM head it stored a second,
    packed copy of the weight tied to the embedding (+113 MB for SmolLM2 fp32) for no gain."""
    return {"freezing": True, "cpp.weight_prepack": False}


@dataclass(frozen=True)
class CompileOptions:
    """The CPU target's compile options (:attr:`kilnlm.builder.config.BuildOptions.compile`)."""

    inductor_configs: dict = field(default_factory=default_inductor_configs)


def example_inputs(model: ModelConfig, build: BuildConfig, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A small valid packed batch (2 sequences, 3 + 2 tokens, logits of 3 rows, 4 KV blocks) for tracing;
    all on CPU."""
    max_blocks = build.max_blocks_per_seq
    tpb = build.tokens_per_block
    num_tokens = [3, 2] if build.max_num_tokens >= 5 else [2, 1]
    num_seqs = 2
    positions = torch.cat([torch.arange(n) for n in num_tokens])
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    block_tables[:, 0] = torch.tensor([1, 2], dtype=torch.int32)
    slots = torch.cat([block_tables[b, 0].long() * tpb + torch.arange(n) for b, n in enumerate(num_tokens)])
    cu = torch.tensor([0, num_tokens[0], sum(num_tokens)], dtype=torch.int32)
    inputs = EngineInputs(
        input_ids=torch.tensor([5, 6, 7, 8, 9][: sum(num_tokens)], dtype=torch.int64),
        positions=positions.to(torch.int64),
        cu_seqlens_q=cu,
        seq_lens_kv=torch.tensor(num_tokens, dtype=torch.int32),
        block_tables=block_tables,
        slot_mapping=slots.to(torch.int64),
        # every other row: a num_logits (3) unlike both num_seqs (2) and num_tokens (5)
        logits_indices=torch.arange(0, sum(num_tokens), 2, dtype=torch.int64),
    )
    kv_dtype = KV_CACHE_DTYPES[build.kv_cache_dtype]  # dtype, or float8_e4m3fn / int8 for an 8-bit KV cache
    kv_cache = torch.zeros(kv_cache_shape(model.num_layers, 4, tpb, model.num_kv_heads, model.head_dim), dtype=kv_dtype)
    return inputs.as_args(kv_cache)


def dynamic_shapes(build: BuildConfig) -> tuple:
    """Per-argument dynamic dims, in ABI order. ``num_logits`` (rows of ``logits_indices``) is its own dim,
    1..max_num_tokens, not tied to ``num_seqs``: the executor asks for one row per sequence, perplexity
    evaluation for every packed row (TensorRT-LLM's gather_context_logits)."""
    num_tokens = Dim("num_tokens", min=1, max=build.max_num_tokens)
    num_seqs = Dim("num_seqs", min=1, max=build.max_batch_size)
    num_logits = Dim("num_logits", min=1, max=build.max_num_tokens)
    num_blocks = Dim("num_blocks", min=1, max=2**31 - 1)
    return (
        {0: num_tokens},  # input_ids
        {0: num_tokens},  # positions
        {0: num_seqs + 1},  # cu_seqlens_q
        {0: num_seqs},  # seq_lens_kv
        {0: num_seqs},  # block_tables (max_blocks_per_seq fixed)
        {0: num_tokens},  # slot_mapping
        {0: num_logits},  # logits_indices
        {2: num_blocks},  # kv_cache
    )


def c_shim_configs() -> dict:
    """Inductor settings that make the compiled engine call every kilnlm op through its C shim
    (``aoti_torch_cpu_<op>``, :func:`kilnlm.plugins.schema.c_shim_declaration`) instead of AOTInductor's proxy
    executor, which boxes each call's arguments and goes through the dispatcher: ~2 us per call, and a
    SmolLM2 decode step makes 151 of them. The plugin versions an engine records say that it was compiled
    this way (:data:`kilnlm.plugins.PLUGIN_VERSIONS`)."""
    from kilnlm.plugins.schema import PLUGIN_VERSIONS, c_shim_declaration

    return {"aot_inductor.custom_ops_to_c_shims": {getattr(torch.ops.kilnlm, name).default: [c_shim_declaration(name)]
                                                   for name in PLUGIN_VERSIONS}}


def compile_engine(network: torch.nn.Module, model: ModelConfig, build: BuildConfig, dtype: torch.dtype,
                   package_path: str | Path, options: CompileOptions | None = None) -> Path:
    """``torch.export`` the network over the dynamic ABI and AOT-compile it into ``package_path``
    (``.pt2``). Raises :class:`BuildError` if export or compilation fails. Logs each step's duration."""
    options = options or CompileOptions()
    network = network.eval()
    args = example_inputs(model, build, dtype)
    log.info("exporting the network (torch.export, dynamic tokens / sequences / KV blocks)")
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            exported = torch.export.export(network, args, dynamic_shapes=dynamic_shapes(build), strict=False)
    except Exception as exc:  # export failures are many types; report them as one build error
        raise BuildError(f"torch.export failed for {model.architecture}: {str(exc).splitlines()[0]}") from exc
    log.info("exported the network in %.1f s", time.perf_counter() - t0)
    log.info("AOT-compiling with AOTInductor (the longest step: 0.5-2 min for the 135M-parameter SmolLM2 on 2 cores, by CPU)")
    t0 = time.perf_counter()
    package_path = Path(package_path)
    try:
        with torch.no_grad():
            torch._inductor.aoti_compile_and_package(
                exported, package_path=str(package_path),
                inductor_configs={**options.inductor_configs, **c_shim_configs()},
            )
    except Exception as exc:
        raise BuildError(f"AOTInductor compilation failed: {str(exc).splitlines()[0]}") from exc
    log.info("AOT-compiled the engine in %.1f s (%s, %.1f MB)", time.perf_counter() - t0, package_path.name,
             package_path.stat().st_size / 1e6)
    return package_path


def toolchain_versions() -> dict[str, str]:
    """kilnlm, torch, C++ compiler and the CPU vector ISA inductor generates code for."""
    from torch._inductor import cpp_builder

    try:
        kilnlm_version = importlib.metadata.version("kilnlm")
    except importlib.metadata.PackageNotFoundError:
        kilnlm_version = "0+unknown"
    info = cpp_builder.get_compiler_version_info(cpp_builder.get_cpp_compiler())
    compiler = next((part.strip() for part in info.split("_") if " version " in part), info[-80:]).strip()
    return {"kilnlm": kilnlm_version, "torch": torch.__version__, "compiler": compiler,
            "cpu_isa": inductor_cpu_isa(), "target": CpuTarget.name}


def smoke_test_engine(engine_dir: Path) -> None:
    """Load the engine in ``engine_dir`` as the runtime does (all its ranks) and run one forward of one token. Raises
    :class:`BuildError` when the logits are not finite or not ``[1, vocab_size]``."""
    from kilnlm.runtime.engine import Engine

    engine = Engine.load(engine_dir, trusted_keys=None)  # the builder's own output: no trust policy applies
    try:
        logits = engine.forward(one_token_inputs(engine.manifest.build.max_blocks_per_seq), engine.allocate_kv_cache(1))
    finally:
        engine.close()  # a tensor-parallel engine's other ranks
    check_logits(logits, engine.manifest.model.vocab_size, "smoke test of the built engine")


@dataclass(frozen=True)
class CpuTarget:
    """The ``cpu`` entry of :data:`kilnlm.builder.targets.TARGETS` (see :class:`~kilnlm.builder.targets.Target`)."""

    name = "cpu"
    description = "AOTInductor package, C++ kernels"
    engine_file = "model.pt2"
    served = True
    tensor_parallel = True

    def stand_in(self) -> None:
        return None

    def default_compile_options(self) -> CompileOptions:
        return CompileOptions()

    def toolchain_versions(self) -> dict[str, str]:
        return toolchain_versions()

    def compile(self, network: torch.nn.Module, model: ModelConfig, build: BuildConfig, dtype: torch.dtype,
                out_dir: Path, options: CompileOptions, engine_file: str | None = None) -> list[Path]:
        """AOT-compile ``network`` into ``out_dir / engine_file`` (default ``model.pt2``; :func:`compile_engine`)."""
        return [compile_engine(network, model, build, dtype, Path(out_dir) / (engine_file or self.engine_file), options)]

    def smoke_test(self, engine_dir: Path, model: ModelConfig, build: BuildConfig) -> None:
        """One token through the engine as the runtime loads it (:func:`smoke_test_engine`)."""
        smoke_test_engine(engine_dir)
