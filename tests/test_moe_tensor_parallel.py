"""Tensor parallelism over mixture-of-experts models: each expert's intermediate rows (and
the shared expert's) split across 2 ranks give TP=1's greedy tokens."""

from __future__ import annotations

import pytest
from tiny_models import checkpoint, greedy_on_one_and_two_ranks, random_prompts


@pytest.mark.parametrize("name", ["qwen2_moe", "mixtral"])
def test_tp2_equals_tp1(name: str) -> None:
    tp1, tp2 = greedy_on_one_and_two_ranks(
        str(checkpoint(name)), random_prompts(20, [1, 5, 11, 17, 23, 40]), 12)
    assert all(len(o) == 12 for o in tp1)
    assert tp2 == tp1
