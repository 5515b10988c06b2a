"""Mistral's sliding window as a sliding cache group: the scheduler releases the blocks
before the window, and the tokens still equal transformers' greedy ones, with chunked
prefill, preemption and prefix hits."""

from __future__ import annotations

import torch  # noqa: F401 - these tests must fail, not skip, without torch
from iron_batch import CacheGroup, Scheduler
from iron_batch.backends.build import scheduler_config
from tiny_models import backend, hf_greedy, random_prompts
from tiny_models import run_with_config as run

WINDOW = 24  # tiny_models' mistral
BS = 4


def test_the_backend_asks_for_one_sliding_group() -> None:
    cfg = scheduler_config(backend("mistral"))
    assert [(g.kind, g.window, g.size) for g in cfg.cache_groups] == [
        ("sliding", WINDOW, cfg.total_kv_blocks)]
    assert scheduler_config(backend("llama")).cache_groups == []


def test_mistral_matches_transformers_with_bounded_blocks() -> None:
    be = backend("mistral", total_kv_blocks=256, kv_block_size=BS)
    prompts = random_prompts(60, [45, 30, 7, 52])
    cfg = scheduler_config(be, max_batch_tokens=16)
    peaks: list[int] = []

    def on_step(s: Scheduler) -> None:
        peaks.append(s.group_stats()[0]["used"])

    outs, s = run(be, cfg, prompts, 40, on_step)
    assert outs == [hf_greedy("mistral", p, 40) for p in prompts]
    # Each of the 4 sequences holds at most its window and a chunk of 16: (23 + 16) / 4
    # rounded up, plus 1 = 11 blocks; all-full accounting needs up to 23 for the longest.
    assert max(peaks) <= 4 * 11
    assert s.stats()["sliding_blocks_released"] > 0
    assert s.group_stats()[0]["used"] == 0


def test_mistral_stays_exact_through_preemption_and_prefix_hits() -> None:
    be = backend("mistral", total_kv_blocks=256, kv_block_size=BS)
    prefix = random_prompts(61, [33])[0]
    prompts = [prefix + tail for tail in random_prompts(62, [3, 9, 1, 5, 12, 2])]
    # 30 blocks for six sequences that each want up to 11 at once.
    cfg = scheduler_config(be, max_batch_tokens=16)
    cfg.cache_groups = [CacheGroup("sliding", 30, window=WINDOW)]
    outs, s = run(be, cfg, prompts, 30)
    assert outs == [hf_greedy("mistral", p, 30) for p in prompts]
    stats = s.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0

