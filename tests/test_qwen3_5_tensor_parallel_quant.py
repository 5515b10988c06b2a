"""Tensor parallelism over Qwen3.5 with quantized projections (bf16, ``--quantization
int8``: each rank quantizes its slice of every projection, the linear-attention ones
included) within the bounds tests/test_tensor_parallel_quant.py holds the other families
to; and from a ``qwen35`` GGUF, whose value heads the loader reorders before each rank cuts
its slice (float32: the same tokens as TP=1). A module of its own: a process holds one
tensor-parallel model at a time."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from iron_batch.llm import LLM
from iron_batch.sampling_params import SamplingParams
from test_qwen3_5 import checkpoint
from test_qwen3_5_gguf import write_gguf
from test_tensor_parallel_quant import GREEDY, _check
from tiny_models import random_prompts

#: Seconds rank 1 may take to start and each collective to wait: generous, so that a
#: loaded test machine does not fail the set-up.
TP_TIMEOUT = 600.0


def _runs(model: str, prompts: list[list[int]]) -> list[Any]:
    """For TP=1 and TP=2 under int8: greedy outputs, and the teacher-forced prompt
    log-probabilities of every prompt followed by TP=1's output (as the other families'
    test takes them)."""
    out = []
    forced: list[list[int]] | None = None
    for tp in (1, 2):
        llm = LLM(model=model, tensor_parallel_size=tp, device="cpu", dtype="bfloat16",
                  total_kv_blocks=128, kv_block_size=4, quantization="int8",
                  tp_timeout=TP_TIMEOUT if tp > 1 else None)
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


def test_tp2_agrees_with_tp1_under_int8() -> None:
    # Two key heads serving four value heads: one key head and two value heads a rank.
    prompts = random_prompts(90, [3, 11, 24, 7, 30, 16])
    _check(_runs(str(checkpoint("untied")), prompts), prompts)


def test_tp2_of_a_qwen35_gguf_equals_tp1(tmp_path: Path) -> None:
    path = str(write_gguf(checkpoint("untied"), tmp_path / "qwen35.gguf"))
    prompts = random_prompts(91, [5, 19, 33, 2])
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs = []
    for tp in (1, 2):
        llm = LLM(model=path, tensor_parallel_size=tp, device="cpu", dtype="float32",
                  total_kv_blocks=128, kv_block_size=4, max_batch_tokens=16,
                  tp_timeout=TP_TIMEOUT if tp > 1 else None)
        try:
            outs.append([o.token_ids for o in llm.generate(prompts, params)])
        finally:
            llm.close()
    assert all(len(o) == 12 for o in outs[0])
    assert outs[1] == outs[0]
