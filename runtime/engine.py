"""Load a built engine directory and run its forward (the CPU target: an AOTInductor package).

Integrity and compatibility are checked *before* anything is loaded (:func:`verify_engine`): loading a
compiled engine executes native code. Never imports kilnlm.builder or transformers.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kilnlm.runtime.abi import EngineInputs, kv_cache_shape
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.memory import advise_huge_pages
from kilnlm.runtime.manifest import MANIFEST_NAME, Manifest, read_manifest, verify_files

TARGET = "cpu"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# manifest build.kv_cache_dtype -> the paged pool's torch dtype ("fp8" / "int8": 8-bit pools with per-layer
# scales baked into the engine; see kilnlm::paged_attention).
KV_CACHE_DTYPES = {**_DTYPES, "fp8": torch.float8_e4m3fn, "int8": torch.int8}


def _machine_cpu_isas() -> set[str]:
    """Vector ISAs inductor-generated code may use on this machine (e.g. ``avx2``, ``avx512``)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return {str(isa) for isa in valid_vec_isa_list()}


def verify_engine(engine_dir: str | os.PathLike) -> Manifest:
    """Check ``engine_dir`` without loading it: manifest format version, every file's size and SHA-256
    (no file missing, none added), plugin versions implemented by this kilnlm, target ``cpu`` and a CPU
    vector ISA this machine has. Returns the manifest; raises :class:`EngineError` naming the offending
    file or field and what to do."""
    from kilnlm.plugins import PLUGIN_ACCEPTED_VERSIONS, PLUGIN_VERSIONS

    root = Path(engine_dir)
    manifest = read_manifest(root)
    verify_files(root, manifest)
    where = root / MANIFEST_NAME
    for name, version in sorted(manifest.plugins.items()):
        if name not in PLUGIN_VERSIONS:
            raise EngineError(f"{where}: plugin {name!r} (version {version}) is not implemented by this kilnlm "
                              f"(has {', '.join(sorted(PLUGIN_VERSIONS))}): upgrade kilnlm or rebuild the engine with it")
        if version not in PLUGIN_ACCEPTED_VERSIONS.get(name, (PLUGIN_VERSIONS[name],)):
            raise EngineError(f"{where}: plugin {name!r} version {version} does not match this kilnlm's version "
                              f"{PLUGIN_VERSIONS[name]}: rebuild the engine with this kilnlm "
                              f"(built by kilnlm {manifest.toolchain.get('kilnlm', 'unknown')})")
    if manifest.build.target != TARGET:
        raise EngineError(f"{where}: build.target is {manifest.build.target!r} but this runtime runs {TARGET!r} "
                          f"engines: rebuild with the {TARGET} target or serve it on a {manifest.build.target} host")
    if manifest.build.dtype not in _DTYPES or manifest.build.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise EngineError(f"{where}: build.dtype {manifest.build.dtype!r} / kv_cache_dtype {manifest.build.kv_cache_dtype!r} "
                          f"not supported (dtype: {', '.join(_DTYPES)}; kv_cache_dtype: {', '.join(KV_CACHE_DTYPES)}): "
                          "rebuild the engine")
    isa = manifest.toolchain.get("cpu_isa", "")
    if isa and isa not in _machine_cpu_isas():
        raise EngineError(f"{where}: toolchain.cpu_isa is {isa!r} but this CPU supports only "
                          f"{', '.join(sorted(_machine_cpu_isas())) or 'no vector ISA'}: rebuild the engine on (or for) this machine")
    return manifest


def load_package(package_path: Path):
    """The AOTInductor package at ``package_path``, loaded by torch's own loader behind kilnlm's
    ``AotiPackage`` (:func:`kilnlm.plugins.cpu.load_aoti_package`), whose ``run`` releases the GIL:
    ``torch._inductor.aoti_load_package``'s runner holds it for the whole forward, stalling every other
    Python thread of the process (request submission, response streaming, metrics) for 3-10 ms per step.
    Needs the plugins' CPU kernels loaded. Raises RuntimeError for a package that fails to load.

    Its weights are then backed by transparent huge pages where Linux allows (:mod:`kilnlm.runtime.memory`):
    a decode step streams all of them, and 4 KiB pages cost a TLB miss every 4 KiB."""
    from kilnlm.plugins.cpu import load_aoti_package

    package = load_aoti_package(str(package_path))
    advise_huge_pages(*package.constants_span())
    return package


class Engine:
    """A loaded engine: one compiled forward over the packed-batch ABI of :mod:`kilnlm.runtime.abi`.

    Attributes: ``manifest``; ``dtype`` (activation dtype); ``kv_cache_dtype`` (the paged pool's dtype:
    ``dtype``, or float8_e4m3fn / int8 for an 8-bit KV cache); ``tokenizer_dir`` (holds tokenizer.json and
    tokenizer_config.json / chat_template.jinja)."""

    def __init__(self, engine_dir: Path, manifest: Manifest, runner):
        self.engine_dir = engine_dir
        self.manifest = manifest
        self.dtype = _DTYPES[manifest.build.dtype]
        self.kv_cache_dtype = KV_CACHE_DTYPES[manifest.build.kv_cache_dtype]
        self.tokenizer_dir = engine_dir / "tokenizer"
        self._runner = runner

    @classmethod
    def load(cls, engine_dir: str | os.PathLike) -> "Engine":
        """:func:`verify_engine`, then load the plugins' CPU kernels, then the AOTInductor package.
        Raises :class:`EngineError` for a refused engine or a package that fails to load."""
        import kilnlm.plugins as plugins

        root = Path(engine_dir)
        manifest = verify_engine(root)
        try:
            plugins.load_cpu_kernels()
        except plugins.KernelBuildError as exc:
            raise EngineError(f"cannot serve {root}: {exc}") from None
        try:
            runner = load_package(root / manifest.engine_file)
        except RuntimeError as exc:
            raise EngineError(f"cannot load {root / manifest.engine_file} ({str(exc).splitlines()[0]}): "
                              "rebuild the engine with this torch version "
                              f"({torch.__version__}; built with {manifest.toolchain.get('torch', 'unknown')})") from None
        return cls(root, manifest, runner)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all layers (K and V): element size of ``kv_cache_dtype`` (1 byte for
        an 8-bit KV cache, half of bfloat16's)."""
        m = self.manifest.model
        shape = kv_cache_shape(m.num_layers, 1, self.manifest.build.tokens_per_block, m.num_kv_heads, m.head_dim)
        num_elements = 1
        for d in shape:
            num_elements *= d
        return num_elements * torch.empty((), dtype=self.kv_cache_dtype).element_size()

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Zeros ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` in the engine's
        ``kv_cache_dtype``, CPU. Raises :class:`EngineError` for num_blocks < 1."""
        if num_blocks < 1:
            raise EngineError(f"num_blocks is {num_blocks}: the KV cache needs at least one block")
        m = self.manifest.model
        shape = kv_cache_shape(m.num_layers, num_blocks, self.manifest.build.tokens_per_block, m.num_kv_heads, m.head_dim)
        # Huge pages (attention reads the pool every step): asked for before the zeros fault fresh pages in,
        # since collapsing a written pool copies it (~0.5 s for SmolLM2's default 377 MB); then collapsed,
        # for memory the allocator reused (already faulted in, in 4 KiB pages)
        kv_cache = torch.empty(shape, dtype=self.kv_cache_dtype)
        span = (kv_cache.data_ptr(), kv_cache.data_ptr() + kv_cache.nbytes)
        advise_huge_pages(*span, collapse=False)
        kv_cache.zero_()
        advise_huge_pages(*span)
        return kv_cache

    def forward(self, inputs: EngineInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """One engine step over a packed batch; writes the new tokens' K/V into ``kv_cache`` in place.
        Returns ``logits [N, vocab_size] float32``, CPU (N = ``len(inputs.logits_indices)``). Raises
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
        (logits,) = self._runner.run(list(inputs.as_args(kv_cache)))
        return logits
