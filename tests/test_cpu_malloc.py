"""Freed CPU activations stay with the allocator (``models/cpu_malloc.py``): once a CPU
model is loaded, an activation-sized block comes from the heap and, freed, stays there for
the next step instead of going back to the kernel (to be faulted in and zeroed again);
with the switch off, glibc maps such a block on its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from tiny_models import checkpoint

_PROBE = """
import ctypes, json, sys
import torch
from iron_batch.backends.torch_backend import TorchBackend

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MallInfo2
TorchBackend.from_model(sys.argv[1], device="cpu", dtype="bfloat16",
                        total_kv_blocks=16, kv_block_size=4)
before = mallinfo2()
block = torch.full((10 << 20,), 1.0, dtype=torch.bfloat16)  # 20 MiB, a prompt chunk's
alive = mallinfo2()
del block
freed = mallinfo2()
print(json.dumps({"mapped_alone": alive.hblkhd - before.hblkhd,
                  "kept_free": freed.fordblks - before.fordblks}))
"""


def _probe(keep: bool) -> dict[str, int]:
    env = dict(os.environ, IRON_BATCH_KEEP_FREED_MEMORY="1" if keep else "0")
    out = subprocess.run([sys.executable, "-c", _PROBE, str(checkpoint("llama"))],
                         env=env, capture_output=True, text=True, timeout=300, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_a_freed_activation_block_stays_with_the_allocator() -> None:
    block = 20 << 20
    kept = _probe(keep=True)
    assert kept["mapped_alone"] < block
    assert kept["kept_free"] >= block * 9 // 10  # (less the odd small allocation since)
    default = _probe(keep=False)
    assert default["mapped_alone"] >= block
    assert default["kept_free"] < block
