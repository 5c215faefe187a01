"""kilnlm.runtime.memory.advise_huge_pages: a hint that never fails and never changes the memory's contents."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest
import torch

from kilnlm.runtime.memory import HUGE_PAGE_BYTES, advise_huge_pages

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def collapse_supported() -> bool:
    """Linux 6.1+ (MADV_COLLAPSE) with transparent huge pages not disabled."""
    if not sys.platform.startswith("linux") or not THP_ENABLED.exists() or "[never]" in THP_ENABLED.read_text():
        return False
    major, minor = (int(part) for part in platform.release().split(".")[:2])
    return (major, minor) >= (6, 1)


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
    begin, end = engine._runner.constants_span()
    assert 0 < begin < end
    weights = sum(f.stat().st_size for f in Path(tiny_engine_dir).glob("*.pt2"))
    assert end - begin <= weights, "the constants span more than the whole package holds"


def test_advice_before_first_touch_gives_huge_pages_on_fault(tiny_engine_dir):
    """allocate_kv_cache advises the pool before zeroing it (no collapse, no copy): the pool is zeros, and
    where Linux has transparent huge pages its memory is backed by them."""
    from kilnlm.runtime.engine import Engine

    engine = Engine.load(tiny_engine_dir)
    num_blocks = max(1, (8 * HUGE_PAGE_BYTES) // engine.kv_cache_bytes_per_block())
    kv_cache = engine.allocate_kv_cache(num_blocks)
    assert not kv_cache.any()
    if not collapse_supported():
        pytest.skip("no transparent huge pages to check here (needs Linux 6.1+ with THP enabled)")
    begin, end = kv_cache.data_ptr(), kv_cache.data_ptr() + kv_cache.nbytes
    huge_kib = 0
    current = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and not fields[0].endswith(":"):
            lo, hi = (int(a, 16) for a in fields[0].split("-"))
            current = (lo, hi)
        elif fields[0] == "AnonHugePages:" and current and current[0] < end and current[1] > begin:
            huge_kib += int(fields[1])
    assert huge_kib * 1024 >= 4 * HUGE_PAGE_BYTES, f"only {huge_kib} KiB of the pool's mappings are huge pages"
