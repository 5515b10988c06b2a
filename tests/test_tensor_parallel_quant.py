"""Tensor parallelism with quantized weights (``--tensor-parallel-size 2 --quantization
int8|int4|gguf``): each rank cuts its slice of every projection before quantizing it (GGUF
blocks are cut on block bounds), so TP=2 agrees with TP=1 under the same quantization.

Partial sums are rounded to bf16 before the all-reduce, so TP=2's logits differ from
TP=1's by rounding, and a greedy token may flip where two tokens are nearly tied: the tests
hold every teacher-forced log-probability to a bound and every differing token to a near
tie (in a module of its own: a process holds one tensor-parallel model at a time).
"""

from __future__ import annotations

from typing import Any

import pytest
from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams
from tiny_models import checkpoint, random_prompts

GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
#: The bound the quantized tests hold logits to against transformers on the same weights
#: (test_quantization.py); two runs each within it of one reference differ by at most twice
#: that in logits, and log-probabilities move by at most twice what the logits move.
LOGIT_TOLERANCE = 0.4
LOGPROB_BOUND = 4 * LOGIT_TOLERANCE


def _runs(model: str, quantization: str, prompts: list[list[int]]) -> list[Any]:
    """For TP=1 and TP=2: greedy outputs, and the teacher-forced prompt log-probabilities
    of every prompt followed by TP=1's output."""
    kw: dict[str, Any] = dict(device="cpu", dtype="bfloat16", total_kv_blocks=128,
                              kv_block_size=4, quantization=quantization)
    out = []
    forced: list[list[int]] | None = None
    for tp in (1, 2):
        llm = LLM(model=model, tensor_parallel_size=tp, **kw)
        try:
            tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
            if forced is None:
                forced = [p + t for p, t in zip(prompts, tokens, strict=True)]
            scored = llm.generate(forced, SamplingParams(max_new_tokens=1, prompt_logprobs=2,
                                                         ignore_eos=True))
            out.append((tokens, [o.prompt_logprobs for o in scored]))
        finally:
            llm.close()
    return out


def _check(runs: list[Any], prompts: list[list[int]]) -> float:
    """Asserts the agreement described above; returns the share of greedy tokens that
    differ (after the first difference of a sequence, TP=2 continues its own text)."""
    (tokens1, scores1), (tokens2, scores2) = runs
    flipped = total = 0
    for prompt, t1, t2, s1, s2 in zip(prompts, tokens1, tokens2, scores1, scores2,
                                      strict=True):
        assert len(t1) == len(t2) == GREEDY.max_new_tokens
        for a, b in zip(s1[1:], s2[1:], strict=True):
            assert abs(a[0] - b[0]) <= LOGPROB_BOUND
        total += len(t1)
        first = next((i for i, (x, y) in enumerate(zip(t1, t2, strict=True)) if x != y), None)
        if first is None:
            continue
        flipped += len(t1) - first
        # Where TP=2 first parts from TP=1, TP=1's own top two were nearly tied.
        top = s1[len(prompt) + first][1]
        assert len(top) == 2 and top[0][1] - top[1][1] <= 2 * LOGIT_TOLERANCE
    return flipped / total


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma4"])
def test_tp2_agrees_with_tp1_under_the_same_quantization(name: str, quantization: str) -> None:
    # llama: 2 KV heads (one per rank); qwen3: 1 KV head, replicated on both ranks;
    # gemma4: both in one model (sliding and global layers), MLPs of two widths.
    prompts = random_prompts(90, [3, 11, 24, 7, 30, 16])
    _check(_runs(str(checkpoint(name)), quantization, prompts), prompts)


def test_tp2_keeps_smollm2s_gguf_blocks_and_agrees_with_tp1() -> None:
    llm = LLM(model="smollm2-135m", tensor_parallel_size=2, device="cpu",
              total_kv_blocks=64, kv_block_size=16, quantization="gguf")
    try:
        tok = llm.backend.tokenizer
        assert tok is not None
        # Every projection's slice is cut on block bounds: nothing falls back to bf16.
        assert llm.backend.model.dequantized == []
    finally:
        llm.close()
    prompts = [tok.encode(t) for t in ("The capital of France is", "def add(a, b):",
                                       "Once upon a time")]
    _check(_runs("smollm2-135m", "gguf", prompts), prompts)
