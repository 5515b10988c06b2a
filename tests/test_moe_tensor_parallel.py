"""Tensor parallelism over mixture-of-experts models: each expert's intermediate rows (and
the shared expert's) split across 2 ranks give TP=1's greedy tokens."""

from __future__ import annotations

import pytest
from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams
from tiny_models import checkpoint, random_prompts


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_tp2_equals_tp1(name: str) -> None:
    kw = dict(device="cpu", dtype="float32", total_kv_blocks=256, kv_block_size=4)
    prompts = random_prompts(20, [1, 5, 11, 17, 23, 40])
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    path = str(checkpoint(name))
    tp1 = [o.token_ids for o in LLM(model=path, **kw).generate(prompts, params)]
    llm = LLM(model=path, tensor_parallel_size=2, **kw)
    try:
        tp2 = [o.token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.close()
    assert all(len(o) == 12 for o in tp1)
    assert tp2 == tp1
