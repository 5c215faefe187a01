"""The process's tensor-parallel group: the one ``torch.distributed`` ProcessGroup over which the ``kilnlm``
collectives (``all_reduce``, ``all_gather``; :mod:`kilnlm.plugins.schema`) run.

The ops take no group argument, as TensorRT-LLM's AllReduce / AllGather plugins carry none the engine
passes: a compiled engine (one per rank, each rank its own process) calls them, and the runtime says once
per process which group that is, after creating it with ``torch.distributed`` (with a timeout, which bounds
every collective's wait)::

    torch.distributed.init_process_group("gloo", ..., timeout=timedelta(seconds=60))
    kilnlm.plugins.set_tensor_parallel_group(torch.distributed.group.WORLD)

The C++ kernels (csrc/collectives.cpp) receive the group's name (``ProcessGroup.group_name``) and resolve
it in c10d's group registry on every call; the references (``reference.py``) use the group object itself.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

_LOCK = threading.Lock()
_group: dist.ProcessGroup | None = None  # the process's tensor-parallel group, or None


def set_tensor_parallel_group(group: dist.ProcessGroup | None) -> None:
    """Make ``group`` the process's tensor-parallel group, over which ``kilnlm::all_reduce`` and
    ``kilnlm::all_gather`` run from now on (the CPU kernels, which this loads first, and the references);
    None clears it, after which the ops raise. Call it once per rank process, before running an engine
    that uses the collectives.

    Raises:
        TypeError: ``group`` is not a ``torch.distributed.ProcessGroup`` (nor None).
        KernelBuildError: the CPU kernels cannot be built or loaded.
    """
    from kilnlm.plugins.cpu import _load

    global _group
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"set_tensor_parallel_group takes a torch.distributed.ProcessGroup (or None), got "
                        f"{type(group).__name__}: pass the group init_process_group / new_group created")
    module = _load()[1]
    with _LOCK:
        module.set_tensor_parallel_group_name("" if group is None else group.group_name)
        _group = group


def tensor_parallel_group() -> dist.ProcessGroup | None:
    """The process's tensor-parallel group set by :func:`set_tensor_parallel_group`, or None."""
    return _group


def require_tensor_parallel_group(op: str) -> dist.ProcessGroup:
    """The process's tensor-parallel group for op ``kilnlm::<op>``. Raises RuntimeError (the CPU kernels'
    message) when none is set."""
    group = _group
    if group is None:
        raise RuntimeError(f"kilnlm::{op}: no tensor-parallel group is set in this process: create it with "
                           "torch.distributed (init_process_group / new_group) and call "
                           "kilnlm.plugins.set_tensor_parallel_group(group) before running the engine")
    return group
