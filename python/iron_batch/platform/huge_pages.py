"""CPU weights and KV cache in memory backed by 2 MiB pages, where Linux gives them.

At batch 1 a decode step streams every weight from DRAM once. On 4 KiB pages that stream
crosses a page every 64 cache lines: a TLB miss and a page walk each time, and the
hardware prefetchers, which do not cross a page, start over. Linux backs an anonymous
range with 2 MiB pages ("transparent huge pages") when the range is marked
``MADV_HUGEPAGE`` before it is first touched and the system's mode is ``madvise`` or
``always`` (``/sys/kernel/mm/transparent_hugepage/enabled``).

Everything here is a hint: where the call is missing (not Linux), refused or the mode is
``never``, the tensors are the same, on ordinary pages. ``IRON_BATCH_HUGE_PAGES=0`` turns
it off, for comparison (see ``platform/switches.py``).
"""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Sequence

import torch

_HUGE = 2 << 20
#: Each tensor an :class:`Arena` places starts on a 4 KiB boundary.
_ALIGN = 4096


def supported() -> bool:
    """Whether this system can be asked for huge pages at all (Linux)."""
    return sys.platform.startswith("linux")


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of ``numel`` elements, uninitialized, whose whole 2 MiB pages are
    marked for huge pages before anything is written to them.

    The memory is a mapping of its own, not the heap's: a heap block may reuse pages that
    earlier tensors already faulted in as 4 KiB pages (``platform/heap.py`` keeps freed
    memory in the process), and the hint does not change pages already there. The tensor
    holds the mapping, which is unmapped when the tensor is freed."""
    item = dtype.itemsize
    nbytes = numel * item + _HUGE
    flags = getattr(mmap, "MAP_PRIVATE", None)
    if flags is None:  # not a Unix: no mapping flags, and no huge pages to ask for
        return torch.empty(numel, dtype=dtype)
    # Private anonymous memory (Python's default anonymous mapping is shared, which the
    # kernel backs as shmem, outside the transparent huge page mode that matters here).
    mapping = mmap.mmap(-1, nbytes, flags=flags | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)
    addr = raw.data_ptr()
    start = -(-addr // _HUGE) * _HUGE - addr
    # Only whole huge pages inside this mapping.
    length = (nbytes - start) // _HUGE * _HUGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None and length > 0:
        try:
            mapping.madvise(advice, start, length)
        except OSError:
            pass  # a refusal leaves ordinary pages
    return raw[start : start + numel * item].view(dtype)


def zeros(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return empty(math.prod(shape), dtype).zero_().view(*shape)


class Arena:
    """One huge-page allocation of ``nbytes``, handed out as copies of tensors placed one
    after another, each on a 4 KiB boundary. Placing tensors one by one lets the caller
    drop each original as soon as its copy is made."""

    def __init__(self, nbytes: int) -> None:
        self._memory = empty(nbytes, torch.uint8)
        self._used = 0

    @staticmethod
    def size_of(t: torch.Tensor) -> int:
        """The bytes :meth:`place` takes for ``t``."""
        return -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of ``t`` (contiguous, CPU) in the arena's next free bytes."""
        at, nbytes = self._used, t.numel() * t.element_size()
        if at + self.size_of(t) > self._memory.numel():
            raise ValueError(f"arena of {self._memory.numel()} bytes is full")
        view = self._memory[at : at + nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        self._used += self.size_of(t)
        return view


def backed_by_huge_pages(t: torch.Tensor) -> bool:
    """Whether the memory under ``t`` lies in 2 MiB pages (reads ``/proc/self/smaps``;
    False where that is not available)."""
    addr = t.data_ptr()
    try:
        with open("/proc/self/smaps") as f:
            lines = f.read().splitlines()
    except OSError:
        return False
    inside = False
    for line in lines:
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) > 0
    return False
