"""Transparent huge pages for the engine's large, long-lived CPU buffers (Linux).

A decode step streams every weight once (78-270 MB for SmolLM2) and reads each layer's KV blocks; with 4 KiB
pages that is one TLB miss per 4 KiB, and inside a virtual machine each miss walks two page tables. Backed by
2 MiB pages the same bytes need 512x fewer translations: on the development VM, SmolLM2's int4 weights
streamed by two threads in 3.13 ms instead of 3.57 (docs/performance.md).

Where the kernel's transparent huge pages are in ``madvise`` mode (the common default), memory gets them only
when asked: :func:`advise_huge_pages` marks a range ``MADV_HUGEPAGE`` (future faults) and asks for
``MADV_COLLAPSE`` (Linux 6.1+: rebuild the already-populated pages as huge pages now). Both are hints: a
kernel without them, THP disabled, or no free huge pages leaves the memory as it was, which is never an
error. :func:`zeroed_memory` gives a large zero-filled buffer (the KV pool) at once: fresh pages, advised
before their first touch and faulted in by a background thread, off the engine's start-up path. That thread
stands aside while forwards run (:func:`running_forward`), for at most :data:`POPULATE_MAX_DEFER_S` in all;
:func:`wait_until_populated` blocks until every such pool is faulted in (benchmarks, before they measure).

:func:`preload_malloc` picks the C allocator of the processes that serve an engine (tritonserver and its
Python backend stubs, the benchmark's engine processes): TCMalloc, else jemalloc, through ``LD_PRELOAD`` when
installed, as PyTorch's CPU launcher (``torch.backends.xeon.run_cpu``) does. A decode step allocates and
frees a few hundred small tensors (each op's output, the engine's intermediate buffers); glibc's malloc
serves them ~0.1 ms per step slower (docs/performance.md).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import sysconfig
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from kilnlm.runtime.errors import KilnError

if TYPE_CHECKING:
    import torch

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
MADV_POPULATE_WRITE = 23  # Linux 5.14+
HUGE_PAGE_BYTES = 2 << 20
# A pool's populating thread waits while forwards run or ran within POPULATE_QUIET_S (the executor's gap
# between two steps is well under it), for up to POPULATE_MAX_DEFER_S in all: enough for a cold start's first
# forwards (SmolLM2: 0.01-0.1 s each), little against the seconds a server under load takes to fill its pool.
POPULATE_QUIET_S = 0.005
POPULATE_MAX_DEFER_S = 1.0

_libc = None


def _madvise():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    return _libc.madvise


def advise_huge_pages(begin: int, end: int, *, collapse: bool = True) -> int:
    """Asks Linux to back the 2 MiB-aligned pages inside the address range ``[begin, end)`` (bytes) by
    transparent huge pages: ``MADV_HUGEPAGE`` for pages faulted in later, then, with ``collapse``,
    ``MADV_COLLAPSE`` for the pages already there (it copies them: ~0.5 s for 377 MB on the development VM,
    so memory not yet written is better advised with ``collapse=False`` before it is first touched).
    Returns the bytes ``MADV_COLLAPSE`` made huge (0 without ``collapse``, when nothing was aligned inside
    the range, on another OS, or when the kernel declined). Never raises for the kernel's answer."""
    first = (begin + HUGE_PAGE_BYTES - 1) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    last = end // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if not sys.platform.startswith("linux") or last <= first:
        return 0
    madvise = _madvise()
    madvise(first, last - first, MADV_HUGEPAGE)
    if not collapse:
        return 0
    return last - first if madvise(first, last - first, MADV_COLLAPSE) == 0 else 0


def zeroed_memory(nbytes: int) -> torch.Tensor:
    """``nbytes`` zero bytes: a ``[nbytes]`` uint8 CPU tensor, returned at once. On Linux it is a private
    anonymous mapping of its own, starting on a 2 MiB boundary and advised ``MADV_HUGEPAGE`` before any
    page is touched. Linux zero-fills such pages when they are first touched, so nothing writes the zeros;
    a daemon thread then faults every page in (``MADV_POPULATE_WRITE``, which never changes a page's
    contents, so the caller may write the memory meanwhile), standing aside while forwards run
    (:func:`running_forward`). Faulting SmolLM2's 377 MB pool in as huge
    pages takes 0.35-0.65 s on the development VM, which ``torch.zeros`` spent on the engine's start-up
    path. Where the kernel lacks ``MADV_POPULATE_WRITE`` (before 5.14), pages fault in on first touch. The
    mapping goes when the tensor and its views are freed. Elsewhere: ``torch.zeros``. Raises OSError when
    the address space cannot be mapped."""
    import torch  # here: the serving launcher imports this module and must start without torch

    if not sys.platform.startswith("linux"):
        return torch.zeros(nbytes, dtype=torch.uint8)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE)  # anonymous: fileno -1
    skip = -torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr() % HUGE_PAGE_BYTES
    memory = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=skip)  # keeps mapping alive
    begin = memory.data_ptr()
    advise_huge_pages(begin, begin + nbytes, collapse=False)
    # The thread holds the mapping, so it stays mapped until the populate returns. ctypes releases the GIL.
    # Counted before it starts, so that a forward right after this call already makes it wait.
    with _GATE.lock:
        _GATE.populating += 1
    threading.Thread(target=_populate, args=(mapping, begin, nbytes), name="kilnlm-populate", daemon=True).start()
    return memory


class _ForwardGate:
    """The forwards running in this process, for :func:`_populate` to wait on."""

    def __init__(self) -> None:
        self.lock = threading.Condition(threading.Lock())  # notified when a populating thread ends
        self.running = 0  # forwards in progress
        self.last_end = 0.0  # time.monotonic() when the last one ended
        self.populating = 0  # live populating threads: without one, forwards skip the lock

    def busy(self) -> bool:
        """Whether a forward runs or ended less than POPULATE_QUIET_S ago."""
        return bool(self.running) or time.monotonic() - self.last_end < POPULATE_QUIET_S


_GATE = _ForwardGate()


@contextmanager
def running_forward() -> Iterator[None]:
    """Marks an engine forward in progress (``CpuBackend.forward``, :mod:`kilnlm.runtime.backends.cpu`, runs
    inside it, on every tensor-parallel rank).

    A forward's parallel regions wait at each barrier for the slowest of its threads, so one core lost to
    :func:`zeroed_memory`'s populating thread slows the whole forward: on a 2-vCPU Zen 4, a cold start's
    first forward took 0.58 s (median of ten) beside it, 0.03 s without it. The populating thread
    waits while forwards run back to back (one within :data:`POPULATE_QUIET_S` of the last), up to
    :data:`POPULATE_MAX_DEFER_S` in all, so that the pool still fills under a steady load. Costs nothing
    once no pool is being populated."""
    if not _GATE.populating:
        yield
        return
    with _GATE.lock:
        _GATE.running += 1
    try:
        yield
    finally:
        with _GATE.lock:
            _GATE.running -= 1
            _GATE.last_end = time.monotonic()


def _populate(mapping: mmap.mmap, begin: int, nbytes: int) -> None:
    # zeroed_memory counted this thread in _GATE.populating; it uncounts itself when done.
    # One huge page per call: the populate holds the process's mmap lock, and a thread that maps memory
    # meanwhile (a thread's stack, a large malloc) waits for it, and every page fault behind that one.
    madvise = _madvise()
    deferred = 0.0  # seconds spent waiting for forwards
    try:
        for offset in range(0, nbytes, HUGE_PAGE_BYTES):
            while deferred < POPULATE_MAX_DEFER_S and _GATE.busy():
                start = time.monotonic()
                time.sleep(POPULATE_QUIET_S)
                deferred += time.monotonic() - start
            if madvise(begin + offset, min(HUGE_PAGE_BYTES, nbytes - offset), MADV_POPULATE_WRITE) != 0:
                return  # before Linux 5.14, or no memory: the rest faults in on first touch
    finally:
        with _GATE.lock:
            _GATE.populating -= 1
            _GATE.lock.notify_all()


def wait_until_populated(timeout_s: float | None = None) -> bool:
    """Blocks until no pool of this process is being faulted in (:func:`zeroed_memory`), or ``timeout_s``
    seconds (None: no limit) have passed. Returns whether none is. A benchmark calls it before it measures
    steady-state speed: on a 2-vCPU VM a fresh pool takes seconds to fault in (SmolLM2's 755 MB took
    1.6-2.5 s on an AMD EPYC Zen 5, 4.7 ms per huge page where the hypervisor had not backed the memory yet,
    0.1 ms where it had), and forwards beside that thread lose one of the two cores."""
    with _GATE.lock:
        return _GATE.lock.wait_for(lambda: not _GATE.populating, timeout_s)


# LD_PRELOAD allocators, in the order "auto" tries them (PyTorch's CPU launcher's), each with the file names
# distributions install it under (Debian / Ubuntu: libtcmalloc-minimal4 -> libtcmalloc_minimal.so.4,
# libjemalloc2 -> libjemalloc.so.2; conda-forge gperftools / jemalloc: libtcmalloc.so, libjemalloc.so).
MALLOC_LIBRARIES: dict[str, tuple[str, ...]] = {
    "tcmalloc": ("libtcmalloc.so*", "libtcmalloc_minimal.so*"),
    "jemalloc": ("libjemalloc.so*",),
}
MALLOC_CHOICES = ("auto", *MALLOC_LIBRARIES, "system")


def malloc_search_dirs() -> list[Path]:
    """Where :func:`find_malloc_library` looks, in order: this Python's prefix (the venv) and ``$CONDA_PREFIX``,
    ``~/.local``, ``/usr/local``, then the system's library folders (multiarch first)."""
    dirs = [Path(sys.prefix) / "lib"]
    if os.environ.get("CONDA_PREFIX"):
        dirs.append(Path(os.environ["CONDA_PREFIX"]) / "lib")
    dirs += [Path.home() / ".local" / "lib", Path("/usr/local/lib"), Path("/usr/local/lib64")]
    multiarch = sysconfig.get_config_var("MULTIARCH")
    if multiarch:
        dirs += [Path("/usr/lib") / multiarch, Path("/lib") / multiarch]
    return dirs + [Path("/usr/lib"), Path("/usr/lib64")]


def find_malloc_library(name: str, search_dirs: list[Path] | None = None) -> Path | None:
    """The first shared library of allocator ``name`` (a key of :data:`MALLOC_LIBRARIES`) in ``search_dirs``
    (default :func:`malloc_search_dirs`), the shortest file name first (``libtcmalloc_minimal.so.4`` before
    its ``.so.4.5.10``), or None."""
    for directory in malloc_search_dirs() if search_dirs is None else search_dirs:
        for pattern in MALLOC_LIBRARIES[name]:
            found = sorted((p for p in directory.glob(pattern) if p.is_file()), key=lambda p: (len(p.name), p.name))
            if found:
                return found[0]
    return None


def _preload_entries(env: Mapping[str, str]) -> list[str]:
    return [e for e in env.get("LD_PRELOAD", "").replace(" ", ":").split(":") if e]


def _is_malloc_library(entry: str, names=MALLOC_LIBRARIES) -> bool:
    return any(Path(entry).match(pattern) for name in names for pattern in MALLOC_LIBRARIES[name])


def preload_malloc(env: Mapping[str, str], allocator: str = "auto",
                   search_dirs: list[Path] | None = None) -> tuple[dict[str, str], str | None]:
    """A copy of ``env`` for a process that should run on ``allocator``, and the library it preloads.

    ``allocator``: "auto" (an allocator ``env`` already preloads, else TCMalloc if installed, else jemalloc,
    else glibc's), "tcmalloc" or "jemalloc" (that one), or "system" (glibc's: allocator entries leave
    ``LD_PRELOAD``). Other ``LD_PRELOAD`` entries are kept. Returns ``(environment, library path or None)``.
    Raises :class:`KilnError` for an unknown ``allocator`` or a named one that is not installed."""
    if allocator not in MALLOC_CHOICES:
        raise KilnError(f"unknown allocator {allocator!r}: use one of {', '.join(MALLOC_CHOICES)}")
    env = dict(env)
    entries = _preload_entries(env)
    library = None
    if allocator != "system":
        names = tuple(MALLOC_LIBRARIES) if allocator == "auto" else (allocator,)
        kept = next((e for e in entries if _is_malloc_library(e, names)), None)
        if kept is not None:
            return env, kept
        library = next((str(p) for name in names if (p := find_malloc_library(name, search_dirs)) is not None), None)
        if library is None and allocator != "auto":
            folders = ", ".join(map(str, malloc_search_dirs() if search_dirs is None else search_dirs))
            raise KilnError(f"{allocator} was asked for but no {' or '.join(MALLOC_LIBRARIES[allocator])} is in "
                            f"{folders}: install it (Debian / Ubuntu: apt-get install libtcmalloc-minimal4 or "
                            "libjemalloc2) or use the system allocator")
    preload = ([library] if library is not None else []) + [e for e in entries if not _is_malloc_library(e)]
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    else:
        env.pop("LD_PRELOAD", None)
    return env, library
