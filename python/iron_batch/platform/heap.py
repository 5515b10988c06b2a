"""Freed CPU activations kept by the allocator instead of handed back to the kernel.

glibc's malloc serves a block above its mmap threshold (128 KiB at first, raised as such
blocks are freed) with fresh pages from the kernel, and hands freed memory back once more
than its trim threshold lies unused at the top of the heap. A forward pass allocates and
frees much the same activations every step, and a prompt chunk's are large (2048 tokens x
3072 bf16 is 12 MiB), so steps kept faulting their activations in again, each page zeroed
by the kernel first. SmolLM2's 64 x 128-token workload in process faulted 440-470
thousand pages a run (1.8 GB); with the memory kept, 170 thousand (blocks above 32 MiB,
which glibc always maps on their own), and its prompt steps took 2.7-2.8 s against
2.9-3.2 s.

:func:`keep_freed_memory` raises both thresholds (``mallopt``) and turns off glibc's own
mappings of large blocks (``M_MMAP_MAX`` 0): every block comes from the heap, and up to
1 GiB of freed memory stays there for the next step. Without the last setting, blocks
above 32 MiB (glibc's limit for the threshold) were still mapped and faulted in each time:
a step of 64 Qwen3.5-0.8B prompts of 128 tokens (8192 rows, float32 temporaries of 100-200
MB) took 23.6-30.6 s against 15.2-15.5 s with them kept, the time of four steps of 2048
rows. Where the call does not exist (not glibc) nothing changes.
``IRON_BATCH_KEEP_FREED_MEMORY=0`` (``platform/switches.py``) keeps the model from calling it,
for comparison.

Those thresholds hold for glibc's main arena. Every other thread that allocates gets an
arena of its own, whose heaps are at most 64 MiB: a block larger than that (a step's
float32 logits over a large vocabulary: 64 rows x 262k is 67 MB) is mapped fresh and
faulted in at every step. When the server ran its steps on a thread of their own,
Gemma-3-1B's 64 x 128 x 64 workload faulted 1.2-1.5 million pages a run there, about 100
on the caller's thread. The server now steps the model on its main thread
(``Engine.run``, ``server/cli.py``) and serves HTTP from another: Qwen3.5-0.8B's W through
the server rose 1.05x. An engine started on a thread of its own (``Engine.start``) still
allocates from that thread's arena. :func:`one_arena` caps glibc at one arena, so every
thread shares the main one (``IRON_BATCH_ONE_MALLOC_ARENA=1``); it cost SmolLM2's batch 1
1.08-1.28x (the threads share the arena's lock), so it is off by default. The LM head
writes a large vocabulary's logits into a buffer it keeps (``layers/embedding.py``).
"""

from __future__ import annotations

import ctypes

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_M_MMAP_MAX = -4
_M_ARENA_MAX = -8
_MMAP_THRESHOLD = 32 << 20
#: Blocks up to this size are meant to come from the heap (under the threshold, with room).
HEAP_BLOCK = 24 << 20
_TRIM_THRESHOLD = 1 << 30

_done = False


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's ``mallopt`` for each (parameter, value); False where there is none (not
    glibc) or a setting is refused."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return all(bool(mallopt(param, value)) for param, value in settings)


def keep_freed_memory() -> bool:
    """Sets the process's malloc thresholds once; True when they are set."""
    global _done
    if not _done:
        _done = _mallopt((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
                         (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD), (_M_MMAP_MAX, 0))
    return _done


def one_arena() -> bool:
    """Caps glibc's malloc at one arena (threads that allocate later share the main one,
    with the thresholds of :func:`keep_freed_memory`); True when it is set."""
    return _mallopt((_M_ARENA_MAX, 1))
