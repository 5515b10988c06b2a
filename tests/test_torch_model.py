"""Greedy output of our torch model equals transformers generate(), through the scheduler."""

from __future__ import annotations

import pytest
import torch  # noqa: F401 - these tests must fail, not skip, without torch
from tiny_models import FAMILIES, backend, hf_greedy, random_prompts, run_scheduler

FAMILY_NAMES = list(FAMILIES)


def _expected(name: str, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    return [hf_greedy(name, p, n) for p, n in zip(prompts, max_new, strict=True)]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_single_request_matches_transformers(name: str) -> None:
    prompt = random_prompts(10, [13])[0]
    outs, _ = run_scheduler(backend(name), [prompt], 24)
    assert outs == _expected(name, [prompt], [24])


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_sixteen_concurrent_requests(name: str) -> None:
    lengths = [1, 2, 3, 5, 8, 11, 16, 17, 23, 31, 4, 9, 40, 6, 27, 12]
    max_new = [12, 3, 20, 7, 16, 1, 9, 14, 5, 18, 11, 2, 8, 13, 6, 10]
    prompts = random_prompts(20, lengths)
    decode_widths: list[int] = []

    def on_step(batch: object) -> None:
        decode_widths.append(len(batch.sample_indices))  # type: ignore[attr-defined]

    outs, _ = run_scheduler(backend(name), prompts, max_new, on_step=on_step)
    assert outs == _expected(name, prompts, max_new)
    assert max(decode_widths) > 8  # decodes really were batched together


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_shared_prefix_hits_prefix_cache(name: str) -> None:
    prefix = random_prompts(30, [37])[0]
    suffixes = random_prompts(31, [3, 5, 1, 9, 4, 2])
    prompts = [prefix + s for s in suffixes]
    be = backend(name)
    # First request alone fills the cache; the rest then reuse its full blocks.
    first, _ = run_scheduler(be, prompts[:1], 10)
    outs, stats = run_scheduler(be, prompts, 10, max_running_seqs=2)
    assert stats["prefix_cache_hit_tokens"] > 0
    assert [first[0], *outs[1:]] == _expected(name, prompts, [10] * len(prompts))
    assert outs[0] == first[0]


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_preemption_keeps_output_exact(name: str) -> None:
    lengths = [9, 14, 6, 11, 17, 8, 12, 5]
    prompts = random_prompts(40, lengths)
    max_new = [22] * len(prompts)
    # 18 blocks of 4 tokens: far less than the ~270 tokens these requests need at once.
    outs, stats = run_scheduler(
        backend(name), prompts, max_new, total_kv_blocks=18, max_running_seqs=8
    )
    assert stats["preemptions"] > 0
    assert outs == _expected(name, prompts, max_new)


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_chunked_prefill(name: str) -> None:
    prompts = random_prompts(50, [45, 29, 7, 33])
    chunks: list[int] = []

    def on_step(batch: object) -> None:
        chunks.append(batch.num_tokens)  # type: ignore[attr-defined]

    outs, _ = run_scheduler(backend(name), prompts, 9, max_batch_tokens=7, on_step=on_step)
    assert max(chunks) <= 7
    assert outs == _expected(name, prompts, [9] * len(prompts))
