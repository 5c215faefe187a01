"""The OpenMP worker threads of the thread that creates an :class:`~kilnlm.runtime.executor.Executor`.

torch's CPU kernels, oneDNN and kilnlm's plugins run their parallel regions on OpenMP (libgomp). libgomp
keeps one pool of worker threads per *calling* thread. Once the creating thread has run a parallel region
(allocating the KV cache is one), its idle workers stay counted, so when the executor's loop thread starts
its own pool libgomp sees more managed threads than CPUs and throttles spin-waiting: the loop thread's
workers fall asleep between the forward's hundreds of small regions and each wake-up costs tens of
microseconds. Measured on SmolLM2 fp8 (2 cores): a batch-1 decode forward took 10.2 ms when only one
thread had ever used OpenMP and 23-25 ms on the loop thread after one parallel region on the main thread.

:func:`release_calling_thread_workers` releases the calling thread's pool with OpenMP 5.0's
``omp_pause_resource_all(omp_pause_soft)``; the pool is made again if that thread runs another parallel
region, so code that keeps computing on other threads while an executor serves brings the slowdown back.
"""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the runtime usable


def _loaded_openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch loaded (libgomp / libiomp5 / libomp, found in /proc/self/maps), or None."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line or "libomp" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def release_calling_thread_workers() -> bool:
    """Release the OpenMP worker threads of the calling thread (see the module docstring).

    Returns True when the runtime released them; False when no OpenMP runtime is loaded, it predates
    OpenMP 5.0 (no ``omp_pause_resource_all``), or it refused (e.g. called inside a parallel region).
    Never raises."""
    runtime = _loaded_openmp_runtime()
    pause = getattr(runtime, "omp_pause_resource_all", None) if runtime is not None else None
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    released = pause(OMP_PAUSE_SOFT) == 0
    if not released:
        log.debug("omp_pause_resource_all refused: the executor's forwards may run slower")
    return released
