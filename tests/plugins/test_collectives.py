"""kilnlm::all_reduce and kilnlm::all_gather over real gloo groups: each test spawns one process per rank
(torch.multiprocessing, spawn), joined through a FileStore, which runs the C++ kernels, the references and
an AOTInductor-compiled module calling the ops through their C shims. Each rank writes its result (or its
traceback) to a file that the parent checks; a rank still running at the deadline fails the test, never
hangs it."""

from __future__ import annotations

import functools
import os
import time
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kilnlm.plugins import (
    all_gather_reference,
    all_reduce_reference,
    set_tensor_parallel_group,
    tensor_parallel_group,
)
from kilnlm.plugins.schema import c_shim_declaration

pytestmark = pytest.mark.usefixtures("cpu_kernels")

NO_GROUP = r"kilnlm::{}: no tensor-parallel group is set in this process: .*kilnlm\.plugins\.set_tensor_parallel_group"


def rank_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rank ``rank``'s input: the same tensor in every process that asks, so a rank can compute the result."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + rank)).to(dtype)


# ---- running ranks ---------------------------------------------------------------------------------------

def _rank_main(rank: int, world_size: int, work_dir: str, body, timeout_s: float) -> None:
    result_path = Path(work_dir) / f"rank{rank}.pt"
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"file://{work_dir}/store", world_size=world_size, rank=rank,
                                timeout=timedelta(seconds=timeout_s))
        result = {"value": body(rank, world_size, Path(work_dir))}
    except BaseException:  # reported to the parent, which fails the test with it
        result = {"error": traceback.format_exc()}
    torch.save(result, result_path)
    os._exit(0)  # no destroy_process_group: a rank whose peer is gone would wait for it


def run_ranks(body, world_size: int, work_dir: Path, *, timeout_s: float = 30.0, deadline_s: float = 90.0) -> list:
    """Runs ``body(rank, world_size, work_dir)`` in ``world_size`` spawned processes over one gloo group
    (the default group, with ``timeout_s``) and returns their return values in rank order. Fails the test
    with a rank's traceback, or when a rank has not finished within ``deadline_s`` (all are then killed)."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_rank_main, args=(rank, world_size, str(work_dir), body, timeout_s), daemon=True)
             for rank in range(world_size)]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + deadline_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(5)
    if hung:
        pytest.fail(f"ranks {hung} did not finish within {deadline_s} s")
    values = []
    for rank in range(world_size):
        path = work_dir / f"rank{rank}.pt"
        if not path.exists():
            pytest.fail(f"rank {rank} exited with code {procs[rank].exitcode} without a result")
        result = torch.load(path)
        if "error" in result:
            pytest.fail(f"rank {rank} failed:\n{result['error']}")
        values.append(result["value"])
    return values


# ---- bodies run by each rank ------------------------------------------------------------------------------

def _all_reduce_body(rank: int, world_size: int, work_dir: Path) -> dict:
    set_tensor_parallel_group(dist.group.WORLD)
    assert tensor_parallel_group() is dist.group.WORLD
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = rank_input(rank, (5, 33), dtype)
        x_before = x.clone()
        y = torch.ops.kilnlm.all_reduce(x)
        assert torch.equal(x, x_before), "all_reduce changed its input"
        expected = sum(rank_input(r, (5, 33), dtype).float() for r in range(world_size)).to(dtype)  # one rounding
        assert y.dtype == dtype and y.shape == x.shape
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        torch.testing.assert_close(all_reduce_reference(x), y, rtol=0, atol=0)
        out[str(dtype)] = y
    strided = rank_input(rank, (6, 8)).t()  # non-contiguous input: [8, 6]
    torch.testing.assert_close(torch.ops.kilnlm.all_reduce(strided),
                               sum(rank_input(r, (6, 8)) for r in range(world_size)).t(), rtol=0, atol=0)
    set_tensor_parallel_group(None)
    assert tensor_parallel_group() is None
    for call in (lambda: torch.ops.kilnlm.all_reduce(x), lambda: all_reduce_reference(x)):
        try:
            call()
        except RuntimeError as exc:
            assert "no tensor-parallel group is set in this process" in str(exc), str(exc)
        else:
            raise AssertionError("all_reduce ran with the tensor-parallel group cleared")
    return out


def test_all_reduce_sums_over_the_ranks(tmp_path):
    """Two ranks: the sum, exact in float32 and rounded once in bfloat16, the same on both ranks, equal to
    the reference; clearing the group makes the op raise."""
    results = run_ranks(_all_reduce_body, 2, tmp_path)
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], rtol=0, atol=0)


def _all_gather_body(rank: int, world_size: int, work_dir: Path) -> dict:
    out = {}
    set_tensor_parallel_group(dist.group.WORLD)
    for dtype in (torch.float32, torch.bfloat16):
        x = rank_input(rank, (4, 5), dtype)
        y = torch.ops.kilnlm.all_gather(x, world_size)
        expected = torch.cat([rank_input(r, (4, 5), dtype) for r in range(world_size)], dim=-1)  # [4, 3 * 5]
        torch.testing.assert_close(y, expected, rtol=0, atol=0)
        torch.testing.assert_close(all_gather_reference(x, world_size), y, rtol=0, atol=0)
        out[str(dtype)] = y
    try:
        torch.ops.kilnlm.all_gather(x, world_size - 1)
    except RuntimeError as exc:
        assert f"compiled for tp_size={world_size - 1} but the tensor-parallel group" in str(exc), str(exc)
    else:
        raise AssertionError("all_gather ran with a tp_size other than the group's size")
    # A group of ranks 0 and 2 (new_group, resolved by its own name): the gather follows its ranks' order.
    pair = dist.new_group([0, 2])
    if rank != 1:
        set_tensor_parallel_group(pair)
        x = rank_input(rank, (4, 5))
        out["pair"] = torch.ops.kilnlm.all_gather(x, 2)
        torch.testing.assert_close(out["pair"], torch.cat([rank_input(0, (4, 5)), rank_input(2, (4, 5))], dim=-1),
                                   rtol=0, atol=0)
    dist.barrier()
    return out


def test_all_gather_concatenates_in_rank_order(tmp_path):
    """Three ranks: ``[rows, 3 * cols]`` in rank order, bit for bit in float32 and bfloat16, the same on
    every rank, equal to the reference; a tp_size other than the group's is refused; a new_group of two of
    the ranks gathers over those two."""
    results = run_ranks(_all_gather_body, 3, tmp_path)
    for result in results[1:]:
        for key in ("torch.float32", "torch.bfloat16"):
            torch.testing.assert_close(result[key], results[0][key], rtol=0, atol=0)
    torch.testing.assert_close(results[2]["pair"], results[0]["pair"], rtol=0, atol=0)


def _lost_peer_body(case: str, rank: int, world_size: int, work_dir: Path) -> tuple[float, str]:
    set_tensor_parallel_group(dist.group.WORLD)
    if rank == 1:  # "exited": gone at once; "silent": never calls, gone once rank 0 is done
        while case == "silent" and not (work_dir / "done").exists():
            time.sleep(0.05)
        torch.save({"value": None}, work_dir / "rank1.pt")
        os._exit(0)
    if case == "exited":
        while not (work_dir / "rank1.pt").exists():
            time.sleep(0.05)
        time.sleep(0.5)
    t0 = time.monotonic()
    try:
        torch.ops.kilnlm.all_reduce(torch.ones(16))
    except RuntimeError as exc:
        return time.monotonic() - t0, str(exc)
    finally:
        (work_dir / "done").touch()
    raise AssertionError(f"all_reduce returned with its peer {case}")


@pytest.mark.parametrize("case, min_s, max_s, cause", [
    pytest.param("exited", 0.0, 4.0, "Connection closed by peer", id="exited"),
    pytest.param("silent", 4.0, 30.0, "Timed out", id="silent"),  # the group's 5 s timeout, not sooner
])
def test_lost_peer_raises_instead_of_hanging(tmp_path, case, min_s, max_s, cause):
    """With a 5 s group timeout: a peer that has exited fails the op at once, one that never makes the call
    fails it after the timeout; the error names the op and keeps gloo's cause."""
    results = run_ranks(functools.partial(_lost_peer_body, case), 2, tmp_path, timeout_s=5.0, deadline_s=60.0)
    elapsed_s, message = results[0]
    assert message.startswith("kilnlm::all_reduce: the collective failed: "), message
    assert cause in message, message
    assert min_s <= elapsed_s < max_s, elapsed_s


# ---- without a group ----------------------------------------------------------------------------------------

def test_no_group_raises_a_clear_error():
    assert tensor_parallel_group() is None
    x = torch.ones(2, 3)
    with pytest.raises(RuntimeError, match=NO_GROUP.format("all_reduce")):
        torch.ops.kilnlm.all_reduce(x)
    with pytest.raises(RuntimeError, match=NO_GROUP.format("all_gather")):
        torch.ops.kilnlm.all_gather(x, 2)
    with pytest.raises(RuntimeError, match=NO_GROUP.format("all_reduce")):
        all_reduce_reference(x)
    with pytest.raises(RuntimeError, match=NO_GROUP.format("all_gather")):
        all_gather_reference(x, 2)
    with pytest.raises(TypeError, match="takes a torch.distributed.ProcessGroup"):
        set_tensor_parallel_group("0")


def test_references_leave_the_kernels_in_place():
    """register_references covers the collectives, and keeps the loaded C++ kernels where they exist."""
    from kilnlm.plugins.reference import REFERENCE_OPS, register_references

    assert {"all_reduce", "all_gather"} <= set(REFERENCE_OPS)
    assert register_references("CPU", ("all_reduce", "all_gather")) is None


def test_c_shim_declarations():
    assert c_shim_declaration("all_reduce") == "AOTITorchError aoti_torch_cpu_all_reduce(AtenTensorHandle x, " \
                                              "AtenTensorHandle* ret0)"
    assert c_shim_declaration("all_gather") == "AOTITorchError aoti_torch_cpu_all_gather(AtenTensorHandle x, " \
                                              "int64_t tp_size, AtenTensorHandle* ret0)"


# ---- inside an AOTInductor-compiled module ------------------------------------------------------------------

TP_SIZE, ROWS, HIDDEN, VOCAB_PER_RANK = 2, 3, 16, 8


class ToyTensorParallelNet(torch.nn.Module):
    """A row-parallel projection (all_reduce of the partial products) then a vocabulary-parallel head
    (all_gather of each rank's logits): x ``[ROWS, HIDDEN]`` -> logits ``[ROWS, TP_SIZE * VOCAB_PER_RANK]``."""

    def forward(self, x, w_row, w_head):
        hidden = torch.ops.kilnlm.all_reduce(x @ w_row)  # [ROWS, HIDDEN]
        return torch.ops.kilnlm.all_gather(hidden @ w_head + 1.0, TP_SIZE)  # [ROWS, TP_SIZE * VOCAB_PER_RANK]


def toy_inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return rank_input(rank, (ROWS, HIDDEN)), rank_input(10 + rank, (HIDDEN, HIDDEN)), \
        rank_input(20 + rank, (HIDDEN, VOCAB_PER_RANK))


def _compiled_body(rank: int, world_size: int, work_dir: Path):
    from kilnlm.plugins.cpu import load_aoti_package

    set_tensor_parallel_group(dist.group.WORLD)
    engine = load_aoti_package(work_dir / "toy.pt2")
    (logits,) = engine.run(list(toy_inputs(rank)))
    torch.testing.assert_close(logits, ToyTensorParallelNet()(*toy_inputs(rank)), rtol=1e-6, atol=1e-5)
    return logits


def test_compiled_module_calls_the_collectives_through_their_c_shims(tmp_path):
    """The ops compiled by AOTInductor as the CPU target compiles engines (C shims): the compiled call
    reaches the collective on both ranks and equals eager execution; with no group the compiled call
    raises the op's own error."""
    import zipfile

    from kilnlm.builder.targets.cpu import c_shim_configs
    from kilnlm.plugins.cpu import load_aoti_package

    with torch.no_grad():
        exported = torch.export.export(ToyTensorParallelNet(), toy_inputs(0))
        package = torch._inductor.aoti_compile_and_package(exported, package_path=str(tmp_path / "toy.pt2"),
                                                           inductor_configs=c_shim_configs())
    with zipfile.ZipFile(package) as archive:
        (wrapper,) = [archive.read(n).decode() for n in archive.namelist() if n.endswith(".wrapper.cpp")]
    assert "aoti_torch_cpu_all_reduce(" in wrapper and "aoti_torch_cpu_all_gather(" in wrapper
    assert "aoti_torch_proxy_executor_call_function(" not in wrapper

    results = run_ranks(_compiled_body, TP_SIZE, tmp_path)
    hidden = sum(x @ w_row for x, w_row, _ in map(toy_inputs, range(TP_SIZE)))
    expected = torch.cat([hidden @ toy_inputs(r)[2] + 1.0 for r in range(TP_SIZE)], dim=-1)
    for logits in results:
        assert logits.shape == (ROWS, TP_SIZE * VOCAB_PER_RANK)
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-4)

    with pytest.raises(RuntimeError, match=NO_GROUP.format("all_reduce")):
        load_aoti_package(package).run(list(toy_inputs(0)))
