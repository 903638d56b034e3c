"""A stage's peak memory is its own (memory.py): after ``reset_peak_rss`` the window's peak forgets
what an earlier stage took, where the system keeps a resettable high-water mark (Linux)."""

from __future__ import annotations

import sys

import pytest

from posttrain.memory import reset_peak_rss, return_free_memory, window_peak_rss_gb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_a_new_window_forgets_the_peak_of_the_one_before():
    reset_peak_rss()
    block = bytearray(400 * 2**20)
    block[::4096] = b"1" * len(block[::4096])  # every page touched: resident
    with_block = window_peak_rss_gb()
    del block
    assert reset_peak_rss()
    assert window_peak_rss_gb() < with_block - 0.3  # the 400 MiB block is no longer the peak


def resident_mib() -> float:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_freed_heap_memory_goes_back_after_a_cpu_phase_not_after_an_accelerators():
    def fragmented_heap() -> list[bytearray]:
        """~200 MiB in 64 KiB blocks (below malloc's mmap threshold: heap memory), every other one
        freed again: free pages that glibc keeps until asked (a step's activations, in small)."""
        blocks = [bytearray(b"1" * (64 * 2**10)) for _ in range(3200)]
        return blocks[1::2]

    kept = fragmented_heap()
    before = resident_mib()
    assert return_free_memory("cuda") is False  # a GPU phase's tensors were never malloc's
    assert resident_mib() > before - 20
    assert return_free_memory("cpu") is True
    assert resident_mib() < before - 60  # most of the ~100 MiB freed is resident no more
    del kept
