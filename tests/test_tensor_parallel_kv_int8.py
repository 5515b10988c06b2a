"""An int8 KV cache on a tensor-parallel model (a module of its own: a process holds one
tensor-parallel model at a time). Each rank quantizes its own KV heads' rows, as a single
process quantizes the same rows, so in float32 the greedy tokens are a single process's."""

from __future__ import annotations

from typing import Any

import pytest
from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams
from tiny_models import checkpoint, random_prompts

BLOCK = 4
#: An int8 row of a head of 16 or 32: its values and a float32 scale.
ROW_16, ROW_32 = 16 + 4, 32 + 4

#: Bytes of one block (K and V of every layer that stores them), in a single process and
#: on each of two ranks. llama: 2 layers of 2 KV heads of 16, one of them on each rank.
#: gemma4: sliding layer 0's 2 KV heads of 16 (one on each rank) and global layer 1's one
#: KV head of 32, which both ranks' query heads attend to (each holds it); the two layers
#: that share their K/V store nothing.
BLOCK_BYTES = {
    "llama": (BLOCK * 2 * 2 * 2 * ROW_16, BLOCK * 2 * 2 * 1 * ROW_16),
    "gemma4": (BLOCK * 2 * (2 * ROW_16 + ROW_32), BLOCK * 2 * (ROW_16 + ROW_32)),
}


@pytest.mark.parametrize("name", sorted(BLOCK_BYTES))
def test_ranks_keep_int8_caches_and_give_the_single_process_tokens(name: str) -> None:
    model = str(checkpoint(name))
    prompts = random_prompts(21, [1, 5, 17, 30])
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    kw: dict[str, Any] = dict(device="cpu", dtype="float32", kv_block_size=BLOCK,
                              kv_cache_memory_gb=1 / 1024, kv_cache_dtype="int8")
    single = LLM(model=model, **kw)
    one = single.generate(prompts, params)
    whole, part = BLOCK_BYTES[name]
    assert single.backend.describe().kv_bytes_per_block == whole
    llm = LLM(model=model, tensor_parallel_size=2, **kw)
    try:
        assert llm.backend.describe().kv_cache_dtype == "int8"
        assert llm.backend.describe().kv_bytes_per_block == part
        # Each rank holds fewer KV heads: the same budget gives it more blocks (llama:
        # half a single process's bytes per block, so twice the blocks; gemma4: its
        # global layer's, which take the most, are whole on each rank).
        blocks, single_blocks = (x.engine.config.total_kv_blocks for x in (llm, single))
        if name == "llama":
            assert blocks == 2 * single_blocks
        else:
            assert blocks > single_blocks
        two = llm.generate(prompts, params)
        stats = llm.engine.scheduler.stats()
        assert stats["free_blocks"] == stats["total_blocks"]
    finally:
        llm.close()
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
