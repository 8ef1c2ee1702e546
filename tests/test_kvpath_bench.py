"""``dualpath bench kvpath``'s pure parts (the run itself is a benchmark: two processes, 256 MiB
of pages; docs/performance.md): it is registered, every 1 MiB page is its own UCX message on
the production defaults, 4 KiB pages are packed, and the memcpy baseline really copies the
bytes between buffer sets larger than the LLC."""

from __future__ import annotations

import importlib

import numpy as np

from bench import kvpath_bench as kb
from common.config import TransportConfig
from common.transport.plan import plan_messages
from tools.cli import BENCHMARKS


def test_kvpath_is_a_registered_benchmark():
    assert BENCHMARKS["kvpath"] == "bench.kvpath_bench"
    assert importlib.import_module(BENCHMARKS["kvpath"]).main is kb.main


def test_every_1mib_page_is_one_message_and_small_pages_are_packed():
    cfg = TransportConfig()
    big = plan_messages(kb.slots_of(kb.PAGE, kb.PAGES), cfg.max_message_bytes,
                        cfg.pack_below_bytes)
    assert len(big) == kb.PAGES and not any(m.packed for m in big)
    small = plan_messages(kb.slots_of(kb.SMALL, kb.SMALL_PAGES), cfg.max_message_bytes,
                          cfg.pack_below_bytes)
    assert len(small) < kb.SMALL_PAGES and all(m.packed for m in small)


def test_regions_are_larger_than_a_32mib_llc_and_sources_are_reproducible():
    assert kb.REGIONS * kb.region_bytes(kb.PAGE, kb.PAGES) >= 4 * 32 * kb.MIB
    assert kb.COPY_SET >= 4 * 32 * kb.MIB
    a, b = kb.source_region(1, 4096), kb.source_region(1, 4096)
    assert np.array_equal(a, b) and not np.array_equal(a, kb.source_region(2, 4096))


def test_memcpy_baseline_copies_the_bytes_in_rotation(monkeypatch):
    monkeypatch.setattr(kb, "COPY_SET", 4 * kb.PAGE)
    copy = kb.Memcpy()
    assert copy.seconds(2 * kb.PAGE) > 0
    half = 2 * kb.PAGE
    assert np.array_equal(copy.dst[half:half + 2 * kb.PAGE], copy.src[:2 * kb.PAGE])
    assert not copy.dst[:half].any()


def test_without_nixl_the_bench_says_why_there_is_no_nixl_row(monkeypatch):
    monkeypatch.setattr(kb.importlib.util, "find_spec", lambda name: None)
    assert kb.nixl_row(True, 10.0) == "nixl_cu12 not installed (make nixl)"


def test_the_nixl_row_moves_and_verifies_the_pages_between_two_processes():
    """NIXL is optional (the peer row, ``make nixl``), so this skips without it, as cupy's
    test does; with it, one rep of the real row: every byte verified by the target's hash."""
    import json
    import subprocess
    import sys

    import pytest

    from bench.nixl_peer import MARK, NIXL_MODULE
    if importlib.util.find_spec(NIXL_MODULE) is None:
        pytest.skip(f"optional {NIXL_MODULE} not installed (make nixl)")
    proc = subprocess.run([sys.executable, "-m", "bench.nixl_peer", "--reps", "1",
                           "--transfers", "2", "--small-pages", str(kb.SMALL_PAGES)],
                          capture_output=True, text=True, timeout=120, cwd=kb.ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    row = json.loads(next(ln for ln in proc.stdout.splitlines()
                          if ln.startswith(MARK))[len(MARK):])
    # warm-up + 1 rep, 2 transfers each, every transfer's region hashed by the target
    assert row["path"] == "nixl" and row["verified"] == 2 * 2 * kb.PAGES * kb.PAGE
    assert row["gbps"] > 0 and row["pages_per_s_4k"] > 0
