"""kilnlm.runtime.memory: advise_huge_pages, a hint that never fails and never changes the memory's contents;
zeroed_memory, zeros returned at once and faulted in behind the caller's back without losing its writes, out
of the way of running forwards for a bounded time; preload_malloc, the LD_PRELOAD allocator of the serving processes."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from kilnlm.runtime.errors import KilnError
from kilnlm.runtime import memory as memory_module
from kilnlm.runtime.memory import (HUGE_PAGE_BYTES, advise_huge_pages, find_malloc_library, preload_malloc, running_forward,
                                   wait_until_populated, zeroed_memory)

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def linux_at_least(major: int, minor: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    release = tuple(int(part) for part in platform.release().split(".")[:2])
    return release >= (major, minor)


def collapse_supported() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not disabled."""
    return linux_at_least(6, 1) and THP_ENABLED.exists() and "[never]" not in THP_ENABLED.read_text()


def populate_supported() -> bool:
    """Linux 5.14+ (MADV_POPULATE_WRITE)."""
    return linux_at_least(5, 14)


def test_range_without_an_aligned_huge_page_is_left_alone():
    t = torch.zeros(1000)
    assert advise_huge_pages(t.data_ptr(), t.data_ptr() + t.nbytes) == 0
    assert advise_huge_pages(0, 0) == 0


def test_contents_survive_and_the_aligned_interior_is_collapsed():
    t = torch.randn(4 * HUGE_PAGE_BYTES // 4)  # 8 MiB of float32: at least 3 whole aligned huge pages inside
    before = t.clone()
    begin, end = t.data_ptr(), t.data_ptr() + t.nbytes
    collapsed = advise_huge_pages(begin, end)
    assert torch.equal(t, before)
    assert collapsed in (0, (end // HUGE_PAGE_BYTES - -(-begin // HUGE_PAGE_BYTES)) * HUGE_PAGE_BYTES)
    if not collapse_supported():
        pytest.skip("no MADV_COLLAPSE here (needs Linux 6.1+ with transparent huge pages enabled)")
    assert collapsed >= 3 * HUGE_PAGE_BYTES, "the kernel supports MADV_COLLAPSE but collapsed nothing"


def test_engine_weights_span_is_its_constants(tiny_engine_dir):
    """The compiled package reports where its weights lie (what Engine.load advises): a non-empty range no
    larger than the package file. (Forwards after the advice are every executor test's.)"""
    from kilnlm.runtime.engine import Engine

    engine = Engine.load(tiny_engine_dir)
    begin, end = engine.backend.package.constants_span()
    assert 0 < begin < end
    weights = sum(f.stat().st_size for f in Path(tiny_engine_dir).glob("*.pt2"))
    assert end - begin <= weights, "the constants span more than the whole package holds"


def test_engine_weights_are_moved_to_64_byte_boundaries(tiny_engine_dir):
    """AOTInductor's CPU model keeps its constants in a std::malloc'd blob, 16 bytes into a cache line when
    glibc maps it; the package moves them into one buffer on a 2 MiB boundary, each constant on a 64-byte
    one, and Engine.load has done so: asking again finds every constant aligned (0 bytes to move, not -1 for
    constants it cannot move)."""
    import shutil
    import tempfile
    import zipfile

    from kilnlm.plugins.cpu import load_aoti_package
    from kilnlm.runtime.engine import Engine

    extracted = tempfile.mkdtemp()
    try:
        with zipfile.ZipFile(next(Path(tiny_engine_dir).glob("*.pt2"))) as archive:
            archive.extractall(extracted)
        package = load_aoti_package(extracted)
    finally:
        shutil.rmtree(extracted)
    begin, end = package.constants_span()
    moved = package.realign_constants()
    assert moved >= 0
    if moved:
        assert moved >= end - begin - 64 * 1024
        assert package.constants_span()[0] % HUGE_PAGE_BYTES == 0
    assert package.realign_constants() == 0
    assert Engine.load(tiny_engine_dir).backend.package.realign_constants() == 0


def wait_for_populating_threads() -> None:
    assert wait_until_populated(timeout_s=60), "a pool still faults in after 60 s"


def smaps_bytes_in(begin: int, end: int, field: str) -> int:
    """``field`` (``Rss:``, ``AnonHugePages:``) of this process's mappings that overlap ``[begin, end)``, in bytes."""
    kib = 0
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            current = (lo, hi)
        elif fields[0] == field and current and current[0] < end and current[1] > begin:
            kib += int(fields[1])
    return kib * 1024


def huge_page_bytes_in(begin: int, end: int) -> int:
    return smaps_bytes_in(begin, end, "AnonHugePages:")


def populating_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "kilnlm-populate"]


@pytest.mark.skipif(not populate_supported(), reason="needs Linux 5.14+ (MADV_POPULATE_WRITE) to fault memory in ahead")
def test_population_waits_while_a_forward_runs():
    """No page is faulted in while a forward runs (but the one in flight when it began), and the rest is once
    it ends."""
    nbytes = 32 * HUGE_PAGE_BYTES
    memory = zeroed_memory(nbytes)
    begin, end = memory.data_ptr(), memory.data_ptr() + nbytes
    with running_forward():
        at_start = smaps_bytes_in(begin, end, "Rss:")
        time.sleep(0.3)
        held = smaps_bytes_in(begin, end, "Rss:")
    wait_for_populating_threads()
    assert held - at_start <= HUGE_PAGE_BYTES, f"{(held - at_start) >> 20} MiB faulted in during the forward"
    assert smaps_bytes_in(begin, end, "Rss:") >= nbytes
    assert memory_module._GATE.running == 0 and memory_module._GATE.populating == 0


@pytest.mark.skipif(not populate_supported(), reason="needs Linux 5.14+ (MADV_POPULATE_WRITE) to fault memory in ahead")
def test_population_waits_while_forwards_run_back_to_back():
    """Steps a millisecond apart, as an executor's are, keep it waiting as one long forward does."""
    nbytes = 32 * HUGE_PAGE_BYTES
    memory = zeroed_memory(nbytes)
    begin, end = memory.data_ptr(), memory.data_ptr() + nbytes
    with running_forward():
        at_start = smaps_bytes_in(begin, end, "Rss:")
    steps = long_gaps = 0
    deadline = time.monotonic() + 0.3
    while time.monotonic() < deadline:
        with running_forward():
            time.sleep(0.01)
        gap_start = time.monotonic()
        time.sleep(0.001)
        steps += 1
        long_gaps += time.monotonic() - gap_start >= memory_module.POPULATE_QUIET_S
    with running_forward():
        held = smaps_bytes_in(begin, end, "Rss:")
    wait_for_populating_threads()
    if long_gaps > steps // 2:
        pytest.skip(f"{long_gaps} of {steps} 1 ms sleeps overslept POPULATE_QUIET_S: the machine is too loaded to keep "
                    "forwards back to back")
    # a gap that oversleeps past POPULATE_QUIET_S lets a page through (the scheduler does that on a loaded
    # machine); waking at every forward's end (what this guards against) lets one through per step
    pages = (held - at_start) // HUGE_PAGE_BYTES
    assert pages <= long_gaps + 4, f"{pages} huge pages faulted in over {steps} steps, {long_gaps} gaps of >= 5 ms"
    assert smaps_bytes_in(begin, end, "Rss:") >= nbytes


@pytest.mark.skipif(not populate_supported(), reason="needs Linux 5.14+ (MADV_POPULATE_WRITE) to fault memory in ahead")
def test_population_waits_for_forwards_only_so_long(monkeypatch):
    """Under a forward that never ends the pool still fills, once the waits reach POPULATE_MAX_DEFER_S."""
    monkeypatch.setattr(memory_module, "POPULATE_MAX_DEFER_S", 0.2)
    nbytes = 8 * HUGE_PAGE_BYTES
    memory = zeroed_memory(nbytes)
    with running_forward():
        deadline = time.monotonic() + 30
        while populating_threads() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not populating_threads(), "the populating thread still waits after its budget"
        assert smaps_bytes_in(memory.data_ptr(), memory.data_ptr() + nbytes, "Rss:") >= nbytes


@pytest.mark.skipif(not populate_supported(), reason="needs Linux 5.14+ (MADV_POPULATE_WRITE) to fault memory in ahead")
def test_wait_until_populated_returns_once_the_pool_is_faulted_in():
    """While a forward holds the populating thread back the wait times out (False); once the forward ends it
    returns True with every page resident."""
    nbytes = 8 * HUGE_PAGE_BYTES
    memory = zeroed_memory(nbytes)
    with running_forward():
        assert not wait_until_populated(timeout_s=0.1)
    assert wait_until_populated(timeout_s=60)
    assert memory_module._GATE.populating == 0
    assert smaps_bytes_in(memory.data_ptr(), memory.data_ptr() + nbytes, "Rss:") >= nbytes
    assert wait_until_populated(timeout_s=0)  # nothing left to wait for


def test_zeroed_memory_keeps_what_is_written_while_it_is_faulted_in():
    """The caller writes a pattern into every page right away, while the background thread is faulting the
    pages in; once that thread is done the pattern is intact and the rest is still zeros."""
    nbytes = 6 * HUGE_PAGE_BYTES + 12345
    memory = zeroed_memory(nbytes)
    assert memory.shape == (nbytes,) and memory.dtype == torch.uint8
    pages = torch.arange(0, nbytes, 4096)
    memory[pages] = 7
    wait_for_populating_threads()
    expected = torch.zeros(nbytes, dtype=torch.uint8)
    expected[pages] = 7
    assert torch.equal(memory, expected)
    if sys.platform.startswith("linux"):
        assert memory.data_ptr() % HUGE_PAGE_BYTES == 0


def test_kv_cache_is_zeros_on_huge_pages(tiny_engine_dir):
    """allocate_kv_cache's pool (zeroed_memory) is zeros, and where Linux has transparent huge pages its
    memory is backed by them once the background thread has faulted it in."""
    from kilnlm.runtime.engine import Engine

    engine = Engine.load(tiny_engine_dir)
    num_blocks = max(1, (8 * HUGE_PAGE_BYTES) // engine.kv_cache_bytes_per_block())
    kv_cache = engine.allocate_kv_cache(num_blocks)
    assert not kv_cache.any()
    if not collapse_supported():
        pytest.skip("no transparent huge pages to check here (needs Linux 6.1+ with THP enabled)")
    wait_for_populating_threads()
    huge = huge_page_bytes_in(kv_cache.data_ptr(), kv_cache.data_ptr() + kv_cache.nbytes)
    assert huge >= 7 * HUGE_PAGE_BYTES, f"only {huge // 1024} KiB of the pool's mappings are huge pages"


# ------------------------------------------------------------------------------------- preload_malloc


def _libraries(folder: Path, *names: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"\x7fELF")
    return folder


def test_find_malloc_library_takes_the_shortest_name_of_the_first_folder_that_has_one(tmp_path):
    first = _libraries(tmp_path / "a", "libtcmalloc_minimal.so.4.5.10", "libtcmalloc_minimal.so.4",
                       "libtcmalloc_minimal_debug.so.4", "libjemalloc.so.2")
    second = _libraries(tmp_path / "b", "libtcmalloc.so")
    assert find_malloc_library("tcmalloc", [first, second]) == first / "libtcmalloc_minimal.so.4"
    assert find_malloc_library("tcmalloc", [second, first]) == second / "libtcmalloc.so"
    assert find_malloc_library("jemalloc", [second, first]) == first / "libjemalloc.so.2"
    assert find_malloc_library("jemalloc", [second]) is None
    _libraries(tmp_path / "c", "libtcmalloc_minimal_debug.so.4")  # the debug build is not taken
    assert find_malloc_library("tcmalloc", [tmp_path / "c"]) is None


def test_auto_prefers_tcmalloc_then_jemalloc_and_keeps_other_preloads_after_it(tmp_path):
    both = _libraries(tmp_path / "both", "libjemalloc.so.2", "libtcmalloc_minimal.so.4")
    env, library = preload_malloc({"LD_PRELOAD": "/opt/libother.so", "HOME": "/h"}, "auto", [both])
    assert library == str(both / "libtcmalloc_minimal.so.4")
    assert env == {"LD_PRELOAD": f"{library}:/opt/libother.so", "HOME": "/h"}
    only_je = _libraries(tmp_path / "je", "libjemalloc.so.2")
    env, library = preload_malloc({}, "auto", [only_je])
    assert library == str(only_je / "libjemalloc.so.2") and env == {"LD_PRELOAD": library}
    assert preload_malloc({"A": "1"}, "auto", [tmp_path / "empty"]) == ({"A": "1"}, None)


def test_an_allocator_already_preloaded_is_kept_and_system_removes_it(tmp_path):
    folder = _libraries(tmp_path / "lib", "libtcmalloc_minimal.so.4", "libjemalloc.so.2")
    base = {"LD_PRELOAD": "/x/libjemalloc.so.2:/opt/libother.so"}
    assert preload_malloc(base, "auto", [folder]) == (base, "/x/libjemalloc.so.2")
    assert preload_malloc(base, "jemalloc", [folder]) == (base, "/x/libjemalloc.so.2")
    env, library = preload_malloc(base, "tcmalloc", [folder])  # the other allocator is replaced
    assert env["LD_PRELOAD"] == f"{folder / 'libtcmalloc_minimal.so.4'}:/opt/libother.so"
    assert preload_malloc(base, "system", [folder]) == ({"LD_PRELOAD": "/opt/libother.so"}, None)
    assert preload_malloc({"LD_PRELOAD": "/x/libtcmalloc.so.4"}, "system", [folder]) == ({}, None)


def test_a_named_allocator_that_is_not_installed_and_an_unknown_one_are_refused(tmp_path):
    with pytest.raises(KilnError, match=r"jemalloc was asked for.*apt-get install"):
        preload_malloc({}, "jemalloc", [_libraries(tmp_path / "lib", "libtcmalloc_minimal.so.4")])
    with pytest.raises(KilnError, match="unknown allocator 'mimalloc'"):
        preload_malloc({}, "mimalloc")


def test_a_process_started_with_the_environment_runs_on_the_allocator():
    env, library = preload_malloc(os.environ, "auto")
    if library is None:
        pytest.skip("neither TCMalloc nor jemalloc is installed on this machine (apt-get install libtcmalloc-minimal4)")
    code = "import sys; sys.stdout.write(open('/proc/self/maps').read())"
    maps = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert str(Path(library).resolve()) in maps or library in maps
