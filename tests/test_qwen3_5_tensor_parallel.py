"""Tensor parallelism over Qwen3.5 (float32, gloo, 2 ranks): the full-attention heads and
the linear-attention key/value heads split across the ranks, each rank's state slots
holding its heads' windows and matrices; TP=2 gives TP=1's greedy tokens (and
transformers') in batches, under preemption, in prompt chunks and after prefix hits that
resume from state checkpoints; every block and state slot free after."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import test_qwen3_5 as qwen
import transformers
from iron_batch.backends.build import BackendConfigError
from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams
from tiny_models import random_prompts, write_byte_tokenizer

GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
KW: dict[str, Any] = dict(device="cpu", dtype="float32", total_kv_blocks=256, kv_block_size=4)
#: Seconds rank 1 may take to start and each collective to wait: generous, so that a
#: loaded test machine does not fail the set-up (a lost rank still ends the test).
TP_TIMEOUT = 600.0

#: name -> config changes from test_qwen3_5.TEXT (4 query / 2 KV heads, 2 key heads
#: serving 4 value heads): "even" one KV head and one key head (two value heads) per
#: rank; "replicated" one KV head and one key head, each on both ranks, which split its
#: query heads and its 4 value heads; "uneven" 3 KV heads and 3 key heads (2 + 1 a rank).
SPLITS: dict[str, dict[str, Any]] = {
    "even": dict(tie_word_embeddings=False),
    "replicated": dict(tie_word_embeddings=True, num_key_value_heads=1,
                       linear_num_key_heads=1, linear_num_value_heads=4),
    "uneven": dict(tie_word_embeddings=False, num_attention_heads=6, num_key_value_heads=3,
                   head_dim=16, linear_num_key_heads=3, linear_num_value_heads=6),
}


def _checkpoint(name: str) -> tuple[str, Any]:
    folder = qwen._ROOT / f"tp-{name}"
    config = transformers.Qwen3_5TextConfig(**{**qwen.TEXT, **SPLITS[name]})
    model = qwen._randomize(transformers.Qwen3_5ForCausalLM(config), sum(map(ord, name)))
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return str(folder), model


@pytest.fixture(scope="module", params=sorted(SPLITS))
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[Any, Any, Any]]:
    """(TP=1 backend, TP=2 backend, transformers model) of one checkpoint; one
    tensor-parallel model in the process at a time (pytest runs every test of one param
    before the next)."""
    path, model = _checkpoint(request.param)
    tp1 = LLM(model=path, **KW).backend
    tp2 = LLM(model=path, tensor_parallel_size=2, tp_timeout=TP_TIMEOUT, **KW)
    yield tp1, tp2.backend, model
    tp2.close()


def _both(pair: tuple[Any, Any, Any], prompts: list[list[int]],
          params: SamplingParams = GREEDY, **scheduler: Any
          ) -> tuple[list[list[int]], list[list[int]], dict[str, int]]:
    outs = []
    for be in pair[:2]:
        llm = LLM(backend=be, kv_block_size=4, **scheduler)
        outs.append([o.token_ids for o in llm.generate(prompts, params)])
        stats = llm.engine.scheduler.stats()
        for g in llm.engine.scheduler.group_stats():  # every block and state slot free
            assert (g["used"], g["free"]) == (0, g["total"]), g
    return outs[0], outs[1], stats


def _hf(model: Any, prompt: list[int], n: int) -> list[int]:
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]),
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    return out[0, len(prompt):].tolist()


def test_each_rank_holds_its_heads_and_their_state(pair: tuple[Any, Any, Any]) -> None:
    tp1, tp2, _ = pair
    whole, part = tp1.model, tp2.model
    assert tp2.cache_groups[1].kind == "state"
    # Rank 0's state slots hold its value heads' matrices and its channels' windows only.
    assert part.delta_states.shape[2] < whole.delta_states.shape[2]
    assert part.conv_states.shape[2] < whole.conv_states.shape[2]
    assert part.state_slot_bytes() < whole.state_slot_bytes()
    assert tp2.cache_groups[1].unit_bytes == part.state_slot_bytes()


def test_tp2_equals_tp1_and_transformers_on_batched_requests(
    pair: tuple[Any, Any, Any],
) -> None:
    prompts = random_prompts(20, [1, 3, 8, 17, 31, 40, 6, 12])
    tp1, tp2, _ = _both(pair, prompts)
    assert tp1 == [_hf(pair[2], p, 12) for p in prompts]
    assert tp2 == tp1


def test_tp2_equals_tp1_under_preemption(pair: tuple[Any, Any, Any]) -> None:
    prompts = random_prompts(40, [9, 14, 6, 11, 17, 8])
    params = SamplingParams(max_new_tokens=22, ignore_eos=True)
    tp1, tp2, stats = _both(pair, prompts, params, total_kv_blocks=18, max_running_seqs=6,
                            enable_prefix_caching=False)
    assert stats["preemptions"] > 0
    assert tp2 == tp1


def test_tp2_equals_tp1_with_chunked_prefill(pair: tuple[Any, Any, Any]) -> None:
    tp1, tp2, _ = _both(pair, random_prompts(50, [45, 29, 7, 33]), max_batch_tokens=7,
                        enable_prefix_caching=False)
    assert tp2 == tp1


def test_tp2_equals_tp1_after_prefix_hits_from_state_checkpoints(
    pair: tuple[Any, Any, Any],
) -> None:
    prefix = random_prompts(30, [27])[0]
    prompts = [prefix] + [prefix + s for s in random_prompts(31, [6, 1, 13])]
    tp1, tp2, stats = _both(pair, prompts, max_running_seqs=1, max_batch_tokens=12)
    assert stats["state_checkpoint_hits"] >= 3 and stats["prefix_cache_hit_tokens"] >= 72
    assert tp2 == tp1


def test_linear_heads_that_cannot_be_split_are_refused_with_one_line() -> None:
    # One key head serving one value head: two ranks cannot share it.
    folder = qwen._ROOT / "tp-unsplittable"
    config = transformers.Qwen3_5TextConfig(**{**qwen.TEXT, "linear_num_key_heads": 1,
                                               "linear_num_value_heads": 1})
    transformers.Qwen3_5ForCausalLM(config).save_pretrained(folder)
    with pytest.raises(BackendConfigError, match="cannot split qwen3_5_text over 2 ranks: "
                       "its linear-attention layers' 1 key heads and 1 value heads") as info:
        LLM(model=str(folder), tensor_parallel_size=2, device="cpu")
    assert "\n" not in str(info.value)
