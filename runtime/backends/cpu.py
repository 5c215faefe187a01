"""The ``cpu`` target's engine backend: an AOTInductor package (``model.pt2``) whose plugin ops run as
kilnlm's C++ kernels (:mod:`kilnlm.plugins.cpu`), with the paged KV pool in CPU memory."""

from __future__ import annotations

import os
import platform
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath
from typing import Callable

import torch

from kilnlm.runtime.abi import KV_CACHE_DTYPES, EngineInputs, kv_cache_bytes_per_block, kv_cache_shape
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.manifest import MANIFEST_NAME, Manifest, rank_model_config
from kilnlm.runtime.memory import advise_huge_pages, running_forward, zeroed_memory


def machine_cpu_isas() -> set[str]:
    """Vector ISAs inductor-generated code may use on this machine (e.g. ``avx2``, ``avx512``), as inductor
    lists them (it imports inductor and dry-compiles a test library per ISA: seconds)."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    return {str(isa) for isa in valid_vec_isa_list()}


# inductor's x86 ISA flags -> the torch.cpu probe inductor itself asks for each (cpu_vec_isa.x86_isa_checker)
_X86_ISA_PROBES = {"avx2": lambda: torch.cpu._is_avx2_supported(), "avx512": lambda: torch.cpu._is_avx512_supported(),
                   "avx512_vnni": lambda: torch.cpu._is_avx512_supported() and torch.cpu._is_vnni_supported(),
                   "amx_tile": lambda: torch.cpu._is_amx_tile_supported()}


def cpu_runs_isa(isa: str) -> bool:
    """Whether this CPU runs code inductor generated for vector ISA ``isa`` (an engine manifest's
    ``cpu_isa``, e.g. ``"avx512 avx512_vnni"``). For x86 flags, from torch's CPU probes alone: a cold start
    then skips :func:`machine_cpu_isas`'s ~2 s. Other names go to that list."""
    flags = isa.split()
    if platform.machine() in ("x86_64", "AMD64") and flags and all(f in _X86_ISA_PROBES for f in flags):
        return all(_X86_ISA_PROBES[f]() for f in flags)
    return isa in machine_cpu_isas()


def load_package(package_path: Path, while_loading: Callable[[], None] | None = None):
    """The AOTInductor package at ``package_path``, loaded by torch's own loader behind kilnlm's
    ``AotiPackage`` (:func:`kilnlm.plugins.cpu.load_aoti_package`), whose ``run`` releases the GIL:
    ``torch._inductor.aoti_load_package``'s runner holds it for the whole forward, stalling every other
    Python thread of the process (request submission, response streaming, metrics) for 3-10 ms per step.
    Needs the plugins' CPU kernels loaded. Raises RuntimeError for a package that fails to load, and
    OSError / zipfile.BadZipFile where the package cannot be extracted.

    The package is a zip whose compiled model (a shared library holding the weights) must be a file to be
    loaded. kilnlm extracts it into a private temporary directory, loads it from there (the loader's
    directory mode) and removes the directory at once: the process keeps its mapping of the library, and
    the disk space goes back when the process ends, however it ends. torch's loader extracts to a directory
    it removes only when the loader is destroyed, which a server killed with SIGKILL, or a Python that
    exits without collecting it, never does: each such start left the engine's size (0.5 GB for SmolLM2
    fp32) behind in ``/tmp``.

    Its weights are then moved to 64-byte boundaries (AOTInductor leaves them 16 bytes into a cache line,
    and a row's every 64-byte load would touch two lines) and backed by transparent huge pages where Linux
    allows (:mod:`kilnlm.runtime.memory`): a decode step streams all of them, and 4 KiB pages cost a TLB
    miss every 4 KiB.

    ``while_loading`` is called just before torch's loader runs, which releases the GIL for most of the
    load (0.19 s of SmolLM2 bf16's 0.38 on an Intel Xeon with AMX, 2 vCPUs): the executor parses its tokenizer
    there."""
    from kilnlm.plugins.cpu import load_aoti_package

    extracted = tempfile.mkdtemp(prefix="kilnlm-engine-")
    try:
        extract_package(package_path, Path(extracted))
        if while_loading is not None:
            while_loading()
        package = load_aoti_package(extracted)
    finally:
        shutil.rmtree(extracted, ignore_errors=True)
    package.realign_constants()  # every weight on a 64-byte boundary (see aoti_package.cpp)
    advise_huge_pages(*package.constants_span())
    return package


_LOCAL_HEADER_BYTES = 30  # a zip member's local file header, before its name and extra field (APPNOTE 4.3.7)


def extract_package(package_path: Path, directory: Path) -> None:
    """Extract the zip at ``package_path`` into ``directory``. Its stored members (AOTInductor stores every
    file of a package uncompressed) are copied by the kernel (``os.sendfile`` from the member's bytes in the
    zip), not read and written through Python's buffers as ``zipfile`` does: 0.13-0.14 s instead of 0.23-0.28
    for SmolLM2 bf16's 271 MB library on the development VM. Members compressed, or named with a path that
    ``zipfile`` would rewrite (absolute, ``..``), go through ``zipfile``. No CRC check: :func:`verify_engine`
    (:mod:`kilnlm.runtime.engine`) has checked the whole package's SHA-256 just before. Raises OSError and
    zipfile.BadZipFile (a member whose local header is not where the zip's directory says). Elsewhere than
    Linux (``sendfile`` into a regular file), ``zipfile`` extracts every member."""
    with zipfile.ZipFile(package_path) as archive, open(package_path, "rb") as source:
        for info in archive.infolist():
            name = PurePosixPath(info.filename)
            copied = (sys.platform.startswith("linux") and info.compress_type == zipfile.ZIP_STORED
                      and not name.is_absolute() and ".." not in name.parts and "\\" not in info.filename)
            if not copied:
                archive.extract(info, directory)
                continue
            target = directory.joinpath(*name.parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            source.seek(info.header_offset)
            header = source.read(_LOCAL_HEADER_BYTES)
            if len(header) != _LOCAL_HEADER_BYTES or header[:4] != b"PK\x03\x04":
                raise zipfile.BadZipFile(f"{package_path}: no local header for {info.filename!r}")
            offset = (info.header_offset + _LOCAL_HEADER_BYTES + int.from_bytes(header[26:28], "little")
                      + int.from_bytes(header[28:30], "little"))  # after the name and the extra field
            target.parent.mkdir(parents=True, exist_ok=True)
            with open(target, "wb") as out:
                left = info.file_size
                while left:
                    sent = os.sendfile(out.fileno(), source.fileno(), offset, left)
                    if sent == 0:
                        raise zipfile.BadZipFile(f"{package_path}: {info.filename!r} ends {left} bytes early")
                    offset += sent
                    left -= sent


class CpuBackend:
    """A loaded ``cpu`` engine, or one tensor-parallel rank's shard of it. ``package``: the AOTInductor package
    (its ``run`` is the forward); ``model``: the shape it computes with (a rank's heads and KV heads,
    :func:`~kilnlm.runtime.manifest.rank_model_config`)."""

    target = "cpu"

    def __init__(self, manifest: Manifest, package) -> None:
        self.manifest = manifest
        self.package = package
        self.model = rank_model_config(manifest.model, manifest.build.tp_size)
        self.kv_cache_dtype = KV_CACHE_DTYPES[manifest.build.kv_cache_dtype]

    @classmethod
    def verify(cls, engine_dir: Path, manifest: Manifest) -> None:
        """Refuse an engine compiled for a CPU vector ISA (``toolchain.cpu_isa``) this machine lacks."""
        isa = manifest.toolchain.get("cpu_isa", "")
        if isa and not cpu_runs_isa(isa):
            raise EngineError(f"{engine_dir / MANIFEST_NAME}: toolchain.cpu_isa is {isa!r} but this CPU supports only "
                              f"{', '.join(sorted(machine_cpu_isas())) or 'no vector ISA'}: rebuild the engine on (or for) this machine")

    @classmethod
    def load(cls, engine_dir: Path, manifest: Manifest, rank: int = 0,
             while_loading: Callable[[], None] | None = None) -> "CpuBackend":
        """Load the plugins' CPU kernels, then the package of tensor-parallel rank ``rank``
        (``while_loading``: see :func:`load_package`). Raises :class:`EngineError` when either fails (the
        package also when it cannot be extracted, e.g. into a full temporary directory)."""
        import kilnlm.plugins as plugins

        try:
            plugins.load_cpu_kernels()
        except plugins.KernelBuildError as exc:
            raise EngineError(f"cannot serve {engine_dir}: {exc}") from None
        package_path = engine_dir / manifest.rank_engine_file(rank)
        try:
            package = load_package(package_path, while_loading)
        except (OSError, zipfile.BadZipFile) as exc:
            raise EngineError(f"cannot extract {package_path} into {tempfile.gettempdir()}: {exc}") from None
        except RuntimeError as exc:
            raise EngineError(f"cannot load {package_path} ({str(exc).splitlines()[0]}): "
                              "rebuild the engine with this torch version "
                              f"({torch.__version__}; built with {manifest.toolchain.get('torch', 'unknown')})") from None
        return cls(manifest, package)

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all layers (K and V) in ``kv_cache_dtype`` (of this rank's KV heads)."""
        m = self.model
        return kv_cache_bytes_per_block(m.num_layers, self.manifest.build.tokens_per_block, m.num_kv_heads, m.head_dim,
                                        self.kv_cache_dtype)

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Zeros ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads, head_dim]`` in ``kv_cache_dtype``,
        CPU, backed by transparent huge pages where Linux allows (attention reads the pool every step);
        ``num_kv_heads`` is this rank's. Returns at once: the pages are faulted in by a background thread
        (:func:`~kilnlm.runtime.memory.zeroed_memory`)."""
        m = self.model
        shape = kv_cache_shape(m.num_layers, num_blocks, self.manifest.build.tokens_per_block, m.num_kv_heads, m.head_dim)
        return zeroed_memory(num_blocks * self.kv_cache_bytes_per_block()).view(self.kv_cache_dtype).view(shape)

    def forward(self, inputs: EngineInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """The package's forward over ``inputs.as_args(kv_cache)``; releases the GIL while it runs. A KV pool
        still faulting in (:func:`~kilnlm.runtime.memory.zeroed_memory`) waits meanwhile, on every
        tensor-parallel rank alike (:func:`~kilnlm.runtime.memory.running_forward`)."""
        with running_forward():
            (logits,) = self.package.run(list(inputs.as_args(kv_cache)))
        return logits
