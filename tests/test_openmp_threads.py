"""The engine thread must not share the CPU with an idle OpenMP team of the loading thread.

With two libgomp teams alive (the thread that loaded the model, the engine thread that steps
it) libgomp stops spinning between parallel regions and batch-1 decode on the engine thread
ran ~1.8x slower than on the caller's thread (see iron_batch.platform.openmp). Speed is measured in
``benches/torch_throughput.py`` ("engine thread" row); this test pins the mechanism: once the
engine starts, the OpenMP workers the loading thread created are gone, and torch still
computes correctly on both threads.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_SCRIPT = textwrap.dedent(
    """
    import json, os
    import torch
    from iron_batch import Engine, SamplingParams
    from iron_batch.backends.mock import MockBackend

    def tids():
        return set(os.listdir("/proc/self/task"))

    torch.set_num_threads(2)
    before = tids()
    a = torch.randn(512, 512)
    expected = a @ a  # a parallel op on this thread: libgomp gives it a worker team
    workers = tids() - before
    engine = Engine(MockBackend())
    engine.start()  # pauses this thread's OpenMP runtime: its workers are joined
    left = sorted(workers & tids())
    same = bool(torch.equal(a @ a, expected))  # this thread gets a new team and still works
    engine.shutdown()
    print(json.dumps({"workers": sorted(workers), "left": left, "same": same}))
    """
)


@pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="the release and this check read /proc (off Linux release_thread_pool does nothing)",
)
def test_engine_start_releases_the_loading_threads_openmp_workers() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=120, check=True
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    # The op above must have started at least one worker, or the test shows nothing.
    assert result["workers"], "torch started no OpenMP worker thread on this machine"
    assert result["left"] == [], f"OpenMP workers of the loading thread still alive: {result}"
    assert result["same"]
