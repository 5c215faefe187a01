"""kilnlm.runtime.openmp: the creating thread's OpenMP workers are released before the executor's loop
thread starts (their presence made every loop-thread forward 2x slower; see the module docstring)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from kilnlm.runtime.openmp import release_calling_thread_workers


def _num_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through Linux's /proc")
def test_release_frees_the_calling_threads_openmp_workers():
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread: OpenMP starts no workers to release")
    result: dict[str, object] = {}

    def run() -> None:  # a fresh thread, so its pool is created here and nowhere else
        torch.ones(1 << 22).sum()  # a parallel region: this thread's pool gets its workers
        result["with_workers"] = _num_threads()
        result["released"] = release_calling_thread_workers()
        result["freed"] = _wait_for(lambda: _num_threads() < result["with_workers"])
        torch.ones(1 << 22).sum()  # the runtime stays usable: the pool is made again
        result["sum_after"] = float(torch.ones(1 << 22).sum())

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert result["released"] is True, "this torch's OpenMP runtime has no omp_pause_resource_all"
    assert result["freed"], f"no worker thread exited after the release ({result['with_workers']} threads)"
    assert result["sum_after"] == float(1 << 22)
