"""An int8 KV cache on a tensor-parallel model (a module of its own: a process holds one
tensor-parallel model at a time). Each rank quantizes its own KV heads' rows, as a single
process quantizes the same rows, so in float32 the greedy tokens are a single process's."""

from __future__ import annotations

from typing import Any

from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams
from tiny_models import checkpoint, random_prompts


def test_ranks_keep_int8_caches_and_give_the_single_process_tokens() -> None:
    model = str(checkpoint("llama"))
    prompts = random_prompts(21, [1, 5, 17, 30])
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    kw: dict[str, Any] = dict(device="cpu", dtype="float32", kv_block_size=4,
                              kv_cache_memory_gb=1 / 1024, kv_cache_dtype="int8")
    single = LLM(model=model, **kw)
    one = single.generate(prompts, params)
    llm = LLM(model=model, tensor_parallel_size=2, **kw)
    try:
        assert llm.backend.describe().kv_cache_dtype == "int8"
        # Each rank holds one of llama's two KV heads: half a single process's bytes per
        # block, so the same budget gives each rank twice the blocks.
        assert llm.engine.config.total_kv_blocks == 2 * single.engine.config.total_kv_blocks
        two = llm.generate(prompts, params)
        stats = llm.engine.scheduler.stats()
        assert stats["free_blocks"] == stats["total_blocks"]
    finally:
        llm.close()
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
