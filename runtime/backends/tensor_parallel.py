"""Tensor-parallel engines (``build.tp_size`` > 1): one process per rank, rank 0 the one that serves.

Each rank loads its shard (``manifest.engine_files[r]``) with the target's backend and its own paged KV pool
(its KV heads); the shards' ``kilnlm::all_reduce`` / ``all_gather`` ops meet over a torch.distributed gloo
group, whose every collective times out after ``timeout_s``. Rank 0 is the backend the
:class:`~kilnlm.runtime.engine.Engine` sees: the scheduler, the KV-cache manager and the sampler run there
only, and each step it sends the packed :class:`~kilnlm.runtime.abi.EngineInputs` to the other ranks, then
runs its own forward; every rank computes the full logits (the LM head's all-gather), rank 0 returns them.
So the executor, the servers and the Triton models take a tensor-parallel engine unchanged::

    rank 0 (the serving process)               rank r
      forward(inputs) --command: inputs-->       forward(inputs)  -- collectives over gloo --
      allocate_kv_cache(n) --command: n-->       allocate_kv_cache(n)
      close() --command: stop-->                 exit

Two ways to start the ranks:

- **kilnlm starts them** (the default, one host): loading the engine spawns ranks 1..N-1 as processes of
  this one, joined through a TCPStore on loopback; commands travel over a pipe per rank, so that a rank
  whose parent dies sees the pipe close and exits. The OpenMP threads this process had are divided among
  the ranks (each rank ``max(1, threads // tp_size)``; rank 0's own count is lowered to that).
- **A launcher starts them** (one host or several): under torchrun (or any launcher that sets
  torch.distributed's ``env://`` variables ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; see
  :func:`launched_rank`) every rank runs the same command, e.g. ``torchrun --nnodes 2 --nproc-per-node 1
  --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m kilnlm.cli serve --engine DIR`` on each host, and each
  loads the engine from its own copy of the engine directory (every copy verified; the manifests must be
  the same bytes). Rank 0's load returns and the command goes on; on every other rank the load does not
  return: the process serves rank 0's commands, which come as broadcasts over a second gloo group whose
  timeout is long enough for an idle server (:data:`COMMAND_TIMEOUT`), and exits (status 0) when rank 0
  closes the engine, or (status 1) when rank 0 is gone. Threads are the launcher's to set (torchrun sets
  ``OMP_NUM_THREADS=1`` when it starts several processes on a host).

A rank that dies (or a collective that fails or times out) breaks the engine: that forward and every later
one raise :class:`EngineError` (naming the rank where kilnlm started it), and :meth:`close` stops the
others. One tensor-parallel engine per process: its group is the process's default torch.distributed group.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing as mp
import os
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
COMMAND_TIMEOUT = timedelta(days=365)  # a launched rank waits this long for rank 0's next command (an idle server)
_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # torch.distributed's env:// rendezvous


def launched_rank() -> tuple[int, int] | None:
    """``(rank, world_size)`` when a launcher started this process as one rank of a group (torchrun, or
    anything that sets all of ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``), else None."""
    if not all(name in os.environ for name in _LAUNCH_VARIABLES):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def _init_group(rank: int, tp_size: int, timeout_s: float, store=None) -> None:
    """Join the gloo group of the ranks (through ``store``, else torch.distributed's ``env://`` variables)
    and make it the plugins' tensor-parallel group."""
    import torch.distributed as dist

    from kilnlm.plugins import set_tensor_parallel_group

    dist.init_process_group("gloo", init_method=None if store is not None else "env://", store=store, rank=rank,
                            world_size=tp_size, timeout=timedelta(seconds=timeout_s))
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


class _RankZeroGone(Exception):
    """Rank 0 can no longer send commands (its process or host is gone)."""


def _serve_commands(backend, receive, rank: int) -> None:
    """Run rank 0's commands (``receive()`` returns the next ``(command, payload)``) until it sends stop.
    Raises _RankZeroGone when rank 0 is gone, SystemExit(1) when a command fails (the peers' collectives then
    fail on the closed connection)."""
    kv_cache = None
    while True:
        command, payload = receive()
        if command == "stop":
            return
        try:
            if command == "allocate":
                kv_cache = backend.allocate_kv_cache(payload)
            elif command == "forward":
                backend.forward(EngineInputs(*(torch.from_numpy(a) for a in payload)), kv_cache)
        except BaseException:
            log.exception("tensor-parallel rank %d failed", rank)
            raise SystemExit(1)


def _rank_main(engine_dir: str, rank: int, tp_size: int, store_port: int, timeout_s: float, num_threads: int,
               manifest_sha256: str, conn) -> None:
    """A spawned rank's process: join the group, load the shard, then run the commands rank 0 sends."""
    import torch.distributed as dist

    from kilnlm.runtime.backends import engine_backend

    torch.set_num_threads(num_threads)
    try:
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=timeout_s))
        _init_group(rank, tp_size, timeout_s, store)
        root = Path(engine_dir)
        manifest = _verified_rank_manifest(root, rank, manifest_sha256)
        backend = engine_backend(manifest, root / MANIFEST_NAME).load(root, manifest, rank=rank)
    except BaseException as exc:  # reported to rank 0, which raises it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", None))

    def receive():
        try:
            return conn.recv()
        except (EOFError, OSError) as exc:
            raise _RankZeroGone(exc) from exc

    try:
        _serve_commands(backend, receive, rank)
    except _RankZeroGone:  # rank 0's process is gone
        return
    _leave_group()


class _Pipes:
    """Commands to ranks this process spawned: a pipe per rank (their processes in ``processes``)."""

    def __init__(self, processes: list, pipes: list) -> None:
        self.processes = processes
        self.pipes = pipes

    def send(self, message) -> None:
        """Raises ConnectionError naming the first rank that cannot take ``message``."""
        for rank, pipe in enumerate(self.pipes, start=1):
            try:
                pipe.send(message)
            except OSError as exc:
                raise ConnectionError(f"tensor-parallel rank {rank} stopped taking commands ({exc})") from exc

    def close(self, send_stop: bool = True) -> None:
        """Stop the ranks (a stop command, then a kill for one that does not exit) and close the pipes."""
        _stop(self.processes, self.pipes)
        self.processes, self.pipes = [], []


class _Broadcast:
    """Commands to launched ranks (on this host or others): a broadcast from rank 0 over ``group``."""

    processes: tuple = ()  # none of the ranks are this process's children

    def __init__(self, group) -> None:
        self.group = group

    def send(self, message) -> None:
        """Raises ConnectionError when a rank cannot take ``message``."""
        import torch.distributed as dist

        try:
            dist.broadcast_object_list([message], src=0, group=self.group)
        except RuntimeError as exc:
            raise ConnectionError(f"a tensor-parallel rank stopped taking commands ({_first_line(exc)})") from exc

    def receive(self):
        """The next message from rank 0. Raises _RankZeroGone when it cannot come."""
        import torch.distributed as dist

        message = [None]
        try:
            dist.broadcast_object_list(message, src=0, group=self.group)
        except RuntimeError as exc:
            raise _RankZeroGone(_first_line(exc)) from exc
        return message[0]

    def close(self, send_stop: bool = True) -> None:
        """Send stop unless ``send_stop`` is False (a broken group: the ranks then see it close and exit)."""
        if send_stop:
            try:
                self.send(("stop", None))
            except ConnectionError:
                pass


class TensorParallelBackend:
    """Rank 0 of a tensor-parallel engine (the protocol of :mod:`kilnlm.runtime.backends`), wrapping rank 0's
    backend of the engine's target; see the module docstring."""

    def __init__(self, manifest: Manifest, local, channel: _Pipes | _Broadcast, store=None) -> None:
        self.manifest = manifest
        self.target = local.target
        self.local = local
        self.kv_cache_dtype = local.kv_cache_dtype
        self._channel = channel
        self._store = store  # a spawned group's TCPStore, kept alive with the group
        self._broken: str | None = None

    @classmethod
    def load(cls, engine_dir: Path, manifest: Manifest, backend_cls, timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S):
        """Load every rank's shard (this process's with ``backend_cls``): under a launcher
        (:func:`launched_rank`) as this process's rank, which does not return on ranks other than 0, else by
        starting ranks 1..tp_size-1 here. Raises :class:`EngineError` when a rank fails to start or load (the
        others are stopped), or when the launcher started a number of ranks other than ``build.tp_size``."""
        import torch.distributed as dist

        if dist.is_initialized():
            raise EngineError("torch.distributed is already initialized in this process: a tensor-parallel engine runs "
                              "its ranks in a group of its own, so load it in a process without one (one such engine "
                              "per process; close the last one first)")
        launched = launched_rank()
        if launched is not None:
            return cls._load_launched(engine_dir, manifest, backend_cls, *launched, timeout_s)
        return cls._load_spawned(engine_dir, manifest, backend_cls, timeout_s)

    @classmethod
    def _load_spawned(cls, engine_dir: Path, manifest: Manifest, backend_cls, timeout_s: float):
        import torch.distributed as dist

        tp_size = manifest.build.tp_size
        num_threads = max(1, torch.get_num_threads() // tp_size)
        context = mp.get_context("spawn")
        manifest_sha256 = hashlib.sha256(read_manifest_bytes(engine_dir)).hexdigest()
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
        channel = _Pipes([], [])
        try:
            for rank in range(1, tp_size):
                parent, child = context.Pipe()
                process = context.Process(target=_rank_main, name=f"kilnlm-tp-rank{rank}", daemon=True,
                                          args=(str(engine_dir), rank, tp_size, store.port, timeout_s, num_threads,
                                                manifest_sha256, child))
                process.start()
                child.close()
                channel.processes.append(process)
                channel.pipes.append(parent)
            torch.set_num_threads(num_threads)
            _init_group(0, tp_size, timeout_s, store)
            local = backend_cls.load(engine_dir, manifest, rank=0)
            for rank, pipe in enumerate(channel.pipes, start=1):
                if not pipe.poll(_STARTUP_TIMEOUT_S):
                    raise EngineError(f"tensor-parallel rank {rank} did not load {manifest.rank_engine_file(rank)} "
                                      f"within {_STARTUP_TIMEOUT_S:.0f} s")
                status, message = pipe.recv()
                if status != "ready":
                    raise EngineError(f"tensor-parallel rank {rank} failed to load {engine_dir}: {message}")
        except BaseException as exc:
            channel.close()
            _leave_group()
            if isinstance(exc, (EngineError, KeyboardInterrupt)):
                raise
            raise EngineError(f"cannot start the {tp_size} tensor-parallel ranks of {engine_dir}: {exc}") from exc
        log.info("started %d tensor-parallel ranks of %s (%d threads each)", tp_size, engine_dir, num_threads)
        return cls(manifest, local, channel, store)

    @classmethod
    def _load_launched(cls, engine_dir: Path, manifest: Manifest, backend_cls, rank: int, world_size: int,
                       timeout_s: float):
        import torch.distributed as dist

        tp_size = manifest.build.tp_size
        if world_size != tp_size:
            raise EngineError(f"this process was launched as one of WORLD_SIZE={world_size} ranks, but {engine_dir} "
                              f"has tp_size {tp_size}: launch {tp_size} ranks in all (e.g. torchrun --nproc-per-node "
                              f"{tp_size}), or start it without a launcher and kilnlm starts its ranks itself")
        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            _init_group(rank, tp_size, timeout_s)
            commands = _Broadcast(dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT))
        except Exception as exc:
            _leave_group()
            raise EngineError(f"rank {rank} cannot join the {tp_size} tensor-parallel ranks of {engine_dir} at "
                              f"{where}: {_first_line(exc)}") from exc
        local, error = None, None
        try:
            local = backend_cls.load(engine_dir, manifest, rank=rank)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        # Every rank loaded its shard from the same manifest (each host verified its own copy), or none goes on.
        statuses = [None] * tp_size
        try:
            dist.all_gather_object(statuses, (hashlib.sha256(read_manifest_bytes(engine_dir)).hexdigest(), error),
                                   group=commands.group)
        except RuntimeError as exc:
            _leave_group()
            raise EngineError(f"the tensor-parallel ranks of {engine_dir} lost each other while loading: "
                              f"{_first_line(exc)}") from exc
        problems = [f"rank {r} failed to load its shard ({failure})" for r, (_, failure) in enumerate(statuses) if failure]
        problems += [f"rank {r}'s {MANIFEST_NAME} is not rank 0's (every host needs the same engine)"
                     for r, (sha256, _) in enumerate(statuses) if sha256 != statuses[0][0]]
        if problems:
            _leave_group()
            raise EngineError(f"the tensor-parallel engine {engine_dir} cannot run: {'; '.join(problems)}")
        if rank == 0:
            log.info("joined %d launched tensor-parallel ranks of %s at %s", tp_size, engine_dir, where)
            return cls(manifest, local, commands)
        log.info("tensor-parallel rank %d of %s serves rank 0's commands", rank, engine_dir)
        try:
            _serve_commands(local, commands.receive, rank)
        except _RankZeroGone as exc:
            log.error("tensor-parallel rank %d: rank 0 is gone (%s); exiting", rank, exc)
            raise SystemExit(1)
        _leave_group()
        raise SystemExit(0)

    @property
    def processes(self) -> list:
        """The processes of ranks 1..tp_size-1 when this process started them (empty under a launcher)."""
        return self._channel.processes

    @property
    def broken(self) -> str | None:
        """Why the engine cannot run any more (a rank died, a collective failed, or it was closed), else None."""
        if self._broken is None:
            self._find_dead_rank()
        return self._broken

    def _find_dead_rank(self) -> None:
        for rank, process in enumerate(self.processes, start=1):
            if not process.is_alive():
                self._broken = f"tensor-parallel rank {rank} (pid {process.pid}) exited with code {process.exitcode}"
                return

    def _check_ranks(self) -> None:
        broken = self.broken
        if broken is not None:
            raise EngineError(f"{broken}: the engine cannot run any more; restart the server (or reload the engine)")

    def _send(self, command: str, payload) -> None:
        self._check_ranks()
        try:
            self._channel.send((command, payload))
        except ConnectionError as exc:
            self._broken = str(exc)
            self._check_ranks()

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes one KV block takes over all layers and all ranks: a KV-cache budget (``--kv-cache-bytes``)
        counts every rank's pool, on this host or another."""
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
            while self._broken is None and self.processes and time.monotonic() < deadline_s:
                self._find_dead_rank()
                time.sleep(0.05)
            self._broken = self._broken or f"a tensor-parallel collective failed ({_first_line(exc)})"
            self._check_ranks()
            raise

    def close(self) -> None:
        """Stop the other ranks and leave the group. Idempotent."""
        self._channel.close(send_stop=self._broken is None)
        self._broken = self._broken or "the engine was closed"
        _leave_group()


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


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
