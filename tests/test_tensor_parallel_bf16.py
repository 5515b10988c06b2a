"""Tensor parallelism in bfloat16 on CPU (in its own module: a process holds one
tensor-parallel model at a time, and test_tensor_parallel.py keeps one alive per module)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams
from tiny_models import random_prompts, uneven_checkpoint


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
