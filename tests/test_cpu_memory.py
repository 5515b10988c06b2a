"""CPU activations kept off fresh kernel pages (``platform/heap.py``): once a CPU model
is loaded, an activation-sized block comes from the heap and, freed, stays there for the
next step instead of going back to the kernel (to be faulted in and zeroed again), even one
above glibc's largest mmap threshold; with the switch off, glibc maps such a block on its
own. A long prompt step runs the MLP in runs of
rows small enough to stay such blocks, with the same logits as in one piece."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest
import torch
from iron_batch.backends.torch_backend import TorchBackend
from test_cpu_decoder import _logits_run
from tiny_models import checkpoint, random_prompts

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
# Above glibc's largest mmap threshold (32 MiB): a 64-prompt step's float32 temporaries.
large = torch.full((24 << 20,), 1.0, dtype=torch.float16)  # 48 MiB
large_alive = mallinfo2()
del large
print(json.dumps({"mapped_alone": alive.hblkhd - before.hblkhd,
                  "kept_free": freed.fordblks - before.fordblks,
                  "large_mapped_alone": large_alive.hblkhd - freed.hblkhd}))
"""


def _probe(keep: bool) -> dict[str, int]:
    env = dict(os.environ, IRON_BATCH_KEEP_FREED_MEMORY="1" if keep else "0")
    out = subprocess.run([sys.executable, "-c", _PROBE, str(checkpoint("llama"))],
                         env=env, capture_output=True, text=True, timeout=300, check=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc",
                    reason="mallopt's thresholds and mallinfo2 are glibc's; other C "
                           "libraries are left as they are (platform/heap.py does nothing there)")
def test_a_freed_activation_block_stays_with_the_allocator() -> None:
    block = 20 << 20
    kept = _probe(keep=True)
    assert kept["mapped_alone"] < block, kept
    # Freed, it stays in the heap (less whatever small allocation took a piece since).
    assert kept["kept_free"] >= block // 2, kept
    assert kept["large_mapped_alone"] == 0, kept
    default = _probe(keep=False)
    assert default["mapped_alone"] >= block, default
    assert default["large_mapped_alone"] >= 48 << 20, default
    assert default["kept_free"] < block // 2, default


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_mlp_in_runs_of_rows_gives_the_same_logits(dtype: str) -> None:
    be = TorchBackend.from_model(str(checkpoint("qwen2")), device="cpu", dtype=dtype,
                                 total_kv_blocks=96, kv_block_size=4)
    model = be.model
    c = model.config
    item = model.dtype.itemsize
    # Sized from the model: its widest MLP block stays under the heap's limit.
    mlp_rows = model.layers[0].mlp.max_rows
    assert mlp_rows is not None
    assert mlp_rows * 2 * c.intermediate_size * item <= 24 << 20
    prompts = random_prompts(9, [37, 50, 21])
    runs = []
    for rows in (None, 16):  # 16: every prompt step split, the last run partial
        for layer in model.layers:
            layer.mlp.max_rows = rows
        runs.append([_logits_run(be, [p], []) for p in prompts])
    for (tokens_whole, logits_whole), (tokens_runs, logits_runs) in zip(*runs, strict=True):
        assert tokens_runs == tokens_whole
        if dtype == "bfloat16":
            # oneDNN's bf16 GEMM sums each output the same way whatever the row count.
            torch.testing.assert_close(logits_runs, logits_whole, rtol=0, atol=0)
        else:
            # float32 GEMM may pick another kernel for 16 rows than for 50: rounding only.
            torch.testing.assert_close(logits_runs, logits_whole, rtol=0, atol=1e-5)
