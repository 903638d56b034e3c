"""A stage's peak memory is its own (memory.py): after ``reset_peak_rss`` the window's peak forgets
what an earlier stage took, where the system keeps a resettable high-water mark (Linux)."""

from __future__ import annotations

import sys

import pytest

from posttrain.memory import reset_peak_rss, window_peak_rss_gb


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="VmHWM and clear_refs are Linux's")
def test_a_new_window_forgets_the_peak_of_the_one_before():
    reset_peak_rss()
    block = bytearray(400 * 2**20)
    block[::4096] = b"1" * len(block[::4096])  # every page touched: resident
    with_block = window_peak_rss_gb()
    del block
    assert reset_peak_rss()
    assert window_peak_rss_gb() < with_block - 0.3  # the 400 MiB block is no longer the peak
