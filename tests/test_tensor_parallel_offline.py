"""Offline tensor parallelism in bfloat16, and a lost rank under ``LLM`` (in a module of
their own: a process holds one tensor-parallel model at a time, and test_tensor_parallel.py
keeps one alive for its whole module)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import children
from iron_batch.backends.build import BackendConfigError
from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams
from tiny_models import checkpoint, random_prompts, uneven_checkpoint


def test_bfloat16_shards_run_the_cpu_kernels_to_the_same_first_tokens(
        tmp_path: Path) -> None:
    # bf16 takes the prepacked, GEMV and fused CPU paths on every shard (uneven ones too).
    # Partial sums rounded to bf16 before the all-reduce differ from TP=1 by rounding (the
    # logits' error against float32 is the same size either way), so later greedy tokens may
    # part on these near-tied random models; the first token of each prompt may not.
    model = str(uneven_checkpoint(tmp_path / "uneven"))
    prompts = random_prompts(80, [1, 2, 5, 17, 31, 40])
    params = SamplingParams(max_new_tokens=3, ignore_eos=True)
    kw: dict[str, Any] = dict(device="cpu", dtype="bfloat16", total_kv_blocks=64,
                              kv_block_size=4)
    tp1 = LLM(model=model, **kw).generate(prompts, params)
    llm = LLM(model=model, tensor_parallel_size=2, **kw)
    try:
        tp2 = llm.generate(prompts, params)
    finally:
        llm.close()
    assert all(len(o.token_ids) == 3 for o in tp2)
    assert [o.token_ids[0] for o in tp2] == [o.token_ids[0] for o in tp1]


def test_a_rank_killed_under_llm_raises_instead_of_hanging() -> None:
    llm = LLM(model=str(checkpoint("qwen2")), tensor_parallel_size=2, device="cpu",
              dtype="float32", total_kv_blocks=64, kv_block_size=4, tp_timeout=10)
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        assert len(llm.generate([[5, 6, 7]], params)[0].token_ids) == 4
        ranks = [pid for pid in children(os.getpid())
                 if b"iron_batch.parallel.shard_loop" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        with pytest.raises(RuntimeError, match="tensor-parallel"):
            llm.generate([[5, 6, 7], [8, 9]], params)
    finally:
        llm.close()
    # Closed, the failed group is gone: a new model starts in this process.
    again = LLM(model=str(checkpoint("qwen2")), tensor_parallel_size=2, device="cpu",
                dtype="float32", total_kv_blocks=64, kv_block_size=4)
    try:
        assert len(again.generate([[5, 6, 7]], params)[0].token_ids) == 4
    finally:
        again.close()


def test_a_rank_that_dies_before_joining_fails_the_start_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/bin/false")  # what rank 1 is spawned with
    start = time.monotonic()
    with pytest.raises(BackendConfigError, match="rank 1 exited with status 1 before joining"):
        LLM(model=str(checkpoint("qwen2")), tensor_parallel_size=2, device="cpu",
            dtype="float32", total_kv_blocks=64)
    assert time.monotonic() - start < 30  # not the 120 s collective timeout
