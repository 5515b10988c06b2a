"""Hand a thread's OpenMP workers back before another thread takes over the model.

torch's CPU kernels run on an OpenMP thread team, and with GNU OpenMP (libgomp, which the
PyPI wheels ship) every thread that runs a parallel op owns a team of its own. A process
that loads the model on its main thread and steps it on the engine thread therefore owns two
teams. Once libgomp manages more threads than there are CPUs, it cuts the time an idle
worker spins waiting for the next parallel region from ~300,000 iterations to 100, so the
workers of the stepping team fall asleep between the thousand-odd small ops of a decode step
and every op pays a futex wake-up. On a 2-core machine that made SmolLM2 batch-1 decode on
the engine thread ~1.8x slower than the same engine stepped on the caller's thread.

:func:`release_thread_pool` frees the calling thread's team (OpenMP 5.0
``omp_pause_resource_all``), so the only team left is the one of the thread that steps the
model. The engine calls it when it starts its thread, the remote worker before it serves.
A thread that runs a parallel op again later simply gets a new team.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1
_RUNTIMES = ("libgomp", "libiomp5", "libomp")


def loaded_runtime() -> str | None:
    """Path of an OpenMP runtime already mapped into this process (never loads one)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(None, 1)[-1]
                name = path.rsplit("/", 1)[-1]
                if path.startswith("/") and name.startswith(_RUNTIMES) and ".so" in name:
                    return path
    except OSError:
        return None
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker threads; True when a runtime did so.

    Does nothing (False) when no OpenMP runtime is loaded (the mock backend never imports
    torch), off Linux, or when the runtime lacks OpenMP 5.0's pause API.
    """
    path = loaded_runtime()
    if path is None:
        return False
    try:
        lib = ctypes.CDLL(path)
        pause = lib.omp_pause_resource_all
    except (OSError, AttributeError):
        logger.debug("OpenMP runtime %s has no omp_pause_resource_all", path)
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(_OMP_PAUSE_SOFT) == 0


@functools.cache
def entry_points() -> tuple[int, int, int] | None:
    """Addresses of GOMP_parallel, omp_get_thread_num and omp_get_num_threads in the
    OpenMP runtime torch loaded (libgomp, or libiomp5's GNU-compatible entry points): the
    Rust kernels split their work over the calling thread's team through them."""
    path = loaded_runtime()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        names = ("GOMP_parallel", "omp_get_thread_num", "omp_get_num_threads")
        addresses = tuple(ctypes.cast(getattr(lib, n), ctypes.c_void_p).value for n in names)
    except (OSError, AttributeError):
        return None
    if not all(addresses):
        return None
    return addresses  # type: ignore[return-value]
