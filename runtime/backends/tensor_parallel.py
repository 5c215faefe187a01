"""Tensor-parallel engines (``build.tp_size`` > 1): rank 0 in this process, ranks 1..N-1 in processes it starts.

Each rank loads its shard (``manifest.engine_files[r]``) with the target's backend and its own paged KV pool
(its KV heads); the shards' ``kilnlm::all_reduce`` / ``all_gather`` ops meet over a torch.distributed gloo
group, whose every collective times out after ``timeout_s``. Rank 0 is the backend the
:class:`~kilnlm.runtime.engine.Engine` sees: the scheduler, the KV-cache manager and the sampler run there
only, and each step it sends the packed :class:`~kilnlm.runtime.abi.EngineInputs` to the other ranks (a
pipe per rank), then runs its own forward; every rank computes the full logits (the LM head's all-gather),
rank 0 returns them. So the executor, the servers and the Triton models take a tensor-parallel engine
unchanged::

    rank 0 (this process)                    rank r (a spawned process, one per other rank)
      forward(inputs) --pipe: inputs-->        forward(inputs)  -- collectives over gloo --
      allocate_kv_cache(n) --pipe: n-->        allocate_kv_cache(n)
      close() --pipe: stop-->                  exit

The commands travel over pipes rather than the group so that an idle server's ranks wait without a
collective timing out, and a rank whose parent dies sees the pipe close and exits. A rank that dies (or a
collective that fails or times out) breaks the engine: that forward and every later one raise
:class:`EngineError` naming the rank, and :meth:`close` stops the others. The OpenMP threads this process
had are divided among the ranks (each rank ``max(1, threads // tp_size)``; rank 0's own count is lowered
to that). One tensor-parallel engine per process: its group is the process's default torch.distributed group.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import time
from datetime import timedelta
from pathlib import Path

import torch

from kilnlm.runtime.abi import EngineInputs
from kilnlm.runtime.errors import EngineError
from kilnlm.runtime.manifest import MANIFEST_NAME, Manifest, parse_manifest, read_manifest_bytes, sha256_file

log = logging.getLogger(__name__)

DEFAULT_COLLECTIVE_TIMEOUT_S = 120.0  # a collective (and the group's rendezvous) that waits longer fails
_STARTUP_TIMEOUT_S = 300.0  # a rank that has not loaded its shard by then is given up on
_EXIT_GRACE_S = 2.0  # after a failed collective, how long a peer may take to finish exiting (to be named)


def _init_group(store, rank: int, tp_size: int, timeout_s: float) -> None:
    """Join the gloo group of the ranks through ``store`` and make it the plugins' tensor-parallel group."""
    import torch.distributed as dist

    from kilnlm.plugins import set_tensor_parallel_group

    dist.init_process_group("gloo", store=store, rank=rank, world_size=tp_size, timeout=timedelta(seconds=timeout_s))
    set_tensor_parallel_group(dist.group.WORLD)


def _verified_rank_manifest(root: Path, rank: int, manifest_sha256: str) -> Manifest:
    """The manifest rank 0 verified (same bytes: ``manifest_sha256``), after checking this rank's engine file
    against it (rank 0 checked every file, signature included; this closes the gap since). Raises EngineError."""
    raw = read_manifest_bytes(root)
    if hashlib.sha256(raw).hexdigest() != manifest_sha256:
        raise EngineError(f"{root / MANIFEST_NAME} changed after rank 0 verified it")
    manifest = parse_manifest(raw, root / MANIFEST_NAME)
    rel = manifest.rank_engine_file(rank)
    if rel not in manifest.files or sha256_file(root / rel) != manifest.files[rel]["sha256"]:
        raise EngineError(f"{root / rel} does not match its SHA-256 in the manifest (changed after rank 0 verified it)")
    return manifest


def _rank_main(engine_dir: str, rank: int, tp_size: int, store_port: int, timeout_s: float, num_threads: int,
               manifest_sha256: str, conn) -> None:
    """Rank ``rank``'s process: join the group, load the shard, then run the commands rank 0 sends."""
    import torch.distributed as dist

    from kilnlm.runtime.backends import engine_backend

    torch.set_num_threads(num_threads)
    try:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
        _init_group(store, rank, tp_size, timeout_s)
        root = Path(engine_dir)
        manifest = _verified_rank_manifest(root, rank, manifest_sha256)
        backend = engine_backend(manifest, root / MANIFEST_NAME).load(root, manifest, rank=rank)
    except BaseException as exc:  # reported to rank 0, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))
    kv_cache = None
    while True:
        try:
            command, payload = conn.recv()
        except (EOFError, OSError):  # rank 0's process is gone
            return
        if command == "stop":
            break
        try:
            if command == "allocate":
                kv_cache = backend.allocate_kv_cache(payload)
            elif command == "forward":
                backend.forward(EngineInputs(*(torch.from_numpy(a) for a in payload)), kv_cache)
        except BaseException:
            log.exception("tensor-parallel rank %d failed", rank)
            raise SystemExit(1)  # the peers' collectives fail on the closed connection
    dist.destroy_process_group()


class TensorParallelBackend:
    """Rank 0 of a tensor-parallel engine (the protocol of :mod:`kilnlm.runtime.backends`), wrapping rank 0's
    backend of the engine's target; see the module docstring."""

    def __init__(self, manifest: Manifest, local, processes: list, pipes: list, store) -> None:
        self.manifest = manifest
        self.target = local.target
        self.local = local
        self.kv_cache_dtype = local.kv_cache_dtype
        self._processes = processes
        self._pipes = pipes
        self._store = store
        self._broken: str | None = None

    @classmethod
    def load(cls, engine_dir: Path, manifest: Manifest, backend_cls, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        """Start ranks 1..tp_size-1, join them in a gloo group and load every shard (rank 0's with
        ``backend_cls``). Raises :class:`EngineError` when a rank fails to start or load (the others are stopped)."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise EngineError("torch.distributed is already initialized in this process: a tensor-parallel engine runs "
                              "its ranks in a group of its own, so load it in a process without one (one such engine "
                              "per process; close the last one first)")
        tp_size = manifest.build.tp_size
        num_threads = max(1, torch.get_num_threads() // tp_size)
        context = mp.get_context("spawn")
        manifest_sha256 = hashlib.sha256(read_manifest_bytes(engine_dir)).hexdigest()
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        processes, pipes = [], []
        try:
            for rank in range(1, tp_size):
                parent, child = context.Pipe()
                process = context.Process(target=_rank_main, name=f"kilnlm-tp-rank{rank}", daemon=True,
                                          args=(str(engine_dir), rank, tp_size, store.port, timeout_s, num_threads,
                                                manifest_sha256, child))
                process.start()
                child.close()
                processes.append(process)
                pipes.append(parent)
            torch.set_num_threads(num_threads)
            _init_group(store, 0, tp_size, timeout_s)
            local = backend_cls.load(engine_dir, manifest, rank=0)
            for rank, pipe in enumerate(pipes, start=1):
                if not pipe.poll(_STARTUP_TIMEOUT_S):
                    raise EngineError(f"tensor-parallel rank {rank} did not load {manifest.rank_engine_file(rank)} "
                                      f"within {_STARTUP_TIMEOUT_S:.0f} s")
                status, message = pipe.recv()
                if status != "ready":
                    raise EngineError(f"tensor-parallel rank {rank} failed to load {engine_dir}: {message}")
        except BaseException as exc:
            _stop(processes, pipes)
            _leave_group()
            if isinstance(exc, (EngineError, KeyboardInterrupt)):
                raise
            raise EngineError(f"cannot start the {tp_size} tensor-parallel ranks of {engine_dir}: {exc}") from exc
        log.info("started %d tensor-parallel ranks of %s (%d threads each)", tp_size, engine_dir, num_threads)
        return cls(manifest, local, processes, pipes, store)

    @property
    def broken(self) -> str | None:
        """Why the engine cannot run any more (a rank died, a collective failed, or it was closed), else None."""
        if self._broken is None:
            self._find_dead_rank()
        return self._broken

    def _find_dead_rank(self) -> None:
        for rank, process in enumerate(self._processes, start=1):
            if not process.is_alive():
                self._broken = f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                return

    def _check_ranks(self) -> None:
        broken = self.broken
        if broken is not None:
            raise EngineError(f"{broken}: the engine cannot run any more; restart the server (or reload the engine)")

    def _send(self, command: str, payload) -> None:
        self._check_ranks()
        for rank, pipe in enumerate(self._pipes, start=1):
            try:
                pipe.send((command, payload))
            except OSError as exc:
                self._broken = f"tensor-parallel rank {rank} stopped taking commands ({exc})"
                self._check_ranks()

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all layers and all ranks (every rank's pool is in this host's memory)."""
        return self.local.kv_cache_bytes_per_block() * self.manifest.build.tp_size

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor:
        """Rank 0's pool ``[num_layers, 2, num_blocks, tokens_per_block, num_kv_heads / tp_size, head_dim]``;
        every other rank allocates its own of the same number of blocks."""
        self._send("allocate", num_blocks)
        return self.local.allocate_kv_cache(num_blocks)

    def forward(self, inputs: EngineInputs, kv_cache: torch.Tensor) -> torch.Tensor:
        """Send ``inputs`` to every rank, run rank 0's shard; ``logits [N, vocab_size] float32``. Raises
        :class:`EngineError` when a rank has died or a collective failed or timed out."""
        self._send("forward", [t.numpy() for t in inputs.as_args(kv_cache)[:-1]])
        try:
            return self.local.forward(inputs, kv_cache)
        except RuntimeError as exc:
            # Name the rank whose exit broke the collective, if one did (given a moment to finish exiting).
            deadline_s = time.monotonic() + _EXIT_GRACE_S
            while self._broken is None and time.monotonic() < deadline_s:
                self._find_dead_rank()
                time.sleep(0.05)
            self._broken = self._broken or f"a tensor-parallel collective failed ({str(exc).splitlines()[0]})"
            self._check_ranks()
            raise

    def close(self) -> None:
        """Stop the other ranks and leave the group. Idempotent."""
        _stop(self._processes, self._pipes)
        self._processes, self._pipes = [], []
        self._broken = self._broken or "the engine was closed"
        _leave_group()


def _leave_group() -> None:
    import torch.distributed as dist

    from kilnlm.plugins import set_tensor_parallel_group

    if dist.is_initialized():
        set_tensor_parallel_group(None)
        dist.destroy_process_group()


def _stop(processes: list, pipes: list, timeout_s: float = 10.0) -> None:
    for pipe in pipes:
        try:
            pipe.send(("stop", None))
        except OSError:
            pass
    for process in processes:
        process.join(timeout_s)
        if process.is_alive():
            process.kill()
            process.join()
    for pipe in pipes:
        pipe.close()
