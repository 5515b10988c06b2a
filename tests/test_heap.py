"""glibc's arenas (``platform/heap.py``): a thread started after the model loads
allocates from an arena of its own, unless ``IRON_BATCH_ONE_MALLOC_ARENA`` caps them at the
main one, whose raised thresholds keep large activations between steps. The server steps
the model on its main thread, so a step's large temporaries stay in the heap there."""

from __future__ import annotations

import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch
from conftest import cli_process
from iron_batch.platform import cpu, switches
from tiny_models import checkpoint

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


# The server with a torch backend whose every step also makes, fills and frees a 96 MiB
# block (a 64-row step's float32 logits over a large vocabulary are 67 MB), and writes the
# pages that block faulted in on the stepping thread (per-thread rusage: Linux's, as glibc
# is here) to FAULTS_LOG.
_SERVER_BOOT = """
import json, resource, sys
import torch
from iron_batch.backends.torch_backend import TorchBackend
log = open(FAULTS_LOG, "a")
submit = TorchBackend.submit
def submit_with_a_large_temporary(self, batch):
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    block = torch.empty(48 << 20, dtype=torch.bfloat16).fill_(1.0)
    del block
    log.write(json.dumps(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before) + "\\n")
    log.flush()
    return submit(self, batch)
TorchBackend.submit = submit_with_a_large_temporary
from iron_batch.server.cli import main
main(sys.argv[1:])
"""


@glibc_only
def test_the_server_keeps_a_steps_large_temporaries_in_the_heap(tmp_path: Path) -> None:
    faults_log = tmp_path / "faults.jsonl"
    boot = _SERVER_BOOT.replace("FAULTS_LOG", repr(str(faults_log)))
    with cli_process("--backend", "torch", "--model", str(checkpoint("llama")), "--device",
                     "cpu", "--dtype", "float32", "--no-ui", boot=boot,
                     startup_s=120) as (proc, port):
        for i in range(3):
            r = httpx.post(f"http://127.0.0.1:{port}/generate",
                           json={"prompt_token_ids": [1 + i, 5, 9], "max_new_tokens": 8},
                           timeout=60)
            assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    faults = [int(line) for line in faults_log.read_text().splitlines()]
    pages = (96 << 20) // os.sysconf("SC_PAGE_SIZE")
    assert len(faults) >= 20, faults
    # The first steps grow the heap; after them the block is reused, not faulted in again.
    # On a thread with an arena of its own it was mapped fresh every step (all its pages).
    later = sorted(faults[3:])
    assert later[len(later) // 2] < pages // 20, faults
