"""glibc's arenas under ``IRON_BATCH_ONE_MALLOC_ARENA`` (``platform/heap.py``): with it,
a thread started after the model loads (the server's engine thread) allocates from the main
arena, whose raised thresholds keep large activations between steps."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest
import torch
from iron_batch.platform import cpu, switches

# Arenas, mallopt and malloc_stats are glibc's; on another C library the switch sets
# nothing (heap.one_arena returns False) and there is no arena to count.
glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc arenas: this C library is not glibc")

_SCRIPT = """
import ctypes, sys, threading
import torch
from iron_batch.platform import heap
assert heap.keep_freed_memory(), "mallopt refused the thresholds"
if sys.argv[1] == "one":
    assert heap.one_arena(), "mallopt refused the arena cap"
torch.randn(256, 256) @ torch.randn(256, 256)  # torch's thread team allocates too
def step():
    for _ in range(3):
        (torch.ones(1 << 20) * 2).sum()
t = threading.Thread(target=step)
t.start()
t.join()
ctypes.CDLL(None).malloc_stats()
"""


def _arenas(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    # glibc's malloc_stats writes one "Arena N:" block per arena to stderr.
    return sum(line.startswith("Arena ") for line in out.stderr.splitlines())


@glibc_only
def test_one_arena_makes_later_threads_share_the_main_one() -> None:
    assert _arenas("one") == 1


@glibc_only
def test_by_default_a_thread_gets_an_arena_of_its_own() -> None:
    assert _arenas("default") > 1


def test_the_switch_reaches_the_cpu_kernels_and_is_off_by_default() -> None:
    cpu_ = torch.device("cpu")
    on = switches.read({"IRON_BATCH_ONE_MALLOC_ARENA": "1"})
    assert cpu.select(cpu_, torch.bfloat16, on).one_malloc_arena
    assert not cpu.select(cpu_, torch.bfloat16, switches.read({})).one_malloc_arena
    with pytest.raises(switches.SwitchError, match="IRON_BATCH_ONE_MALLOC_ARENA"):
        switches.read({"IRON_BATCH_ONE_MALLOC_ARENA": "2"})
