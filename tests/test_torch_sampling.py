"""Sampling: statistics of each filter (fixed seeds, so never flaky), seeds, penalties."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from iron_batch.sampling import Sampler
from iron_batch.sampling_params import SamplingParams
from tiny_models import backend, checkpoint, random_prompts, reference_model, run_scheduler

LOGITS = torch.tensor([2.0, 1.0, 0.0, -1.0])
ROWS = 6000


def _frequencies(**params: object) -> np.ndarray:
    sampler = Sampler(4, torch.device("cpu"))
    states = [sampler.new_state([], SamplingParams(**params)) for _ in range(ROWS)]  # type: ignore[arg-type]
    tokens, _ = sampler.sample(LOGITS.repeat(ROWS, 1), states)
    return np.bincount(tokens.numpy(), minlength=4) / ROWS


def _close(freq: np.ndarray, probs: torch.Tensor) -> bool:
    # 6000 draws: 3 standard deviations of a frequency is below 0.02.
    return bool(np.abs(freq - probs.numpy()).max() < 0.02)


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_temperature_matches_softmax(temperature: float) -> None:
    freq = _frequencies(temperature=temperature)
    assert _close(freq, torch.softmax(LOGITS / temperature, dim=0))


def test_top_p_keeps_the_nucleus() -> None:
    # softmax = [.644, .237, .087, .032]: the first two reach 0.8.
    freq = _frequencies(temperature=1.0, top_p=0.8)
    assert freq[2] == freq[3] == 0
    assert _close(freq, torch.softmax(torch.tensor([2.0, 1.0, -1e9, -1e9]), dim=0))


def test_top_k_and_min_p() -> None:
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0, -1e9]), dim=0)
    assert _close(_frequencies(temperature=1.0, top_k=3), expected)
    # min_p 0.2: threshold 0.2 * 0.644 drops tokens 2 and 3.
    freq = _frequencies(temperature=1.0, min_p=0.2)
    assert freq[2] == freq[3] == 0 and freq[0] > 0.65


def test_penalties_follow_definitions() -> None:
    sampler = Sampler(4, torch.device("cpu"))
    state = sampler.new_state([0], SamplingParams(
        repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25))
    assert state.output_counts is not None
    state.output_counts[1] = 2  # token 1 generated twice
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.3]])
    out = sampler._apply_penalties(logits, [state])
    # token 0: prompt only -> 2 / 2; token 1: -1 * 2 - 0.25 * 2 - 0.5; others untouched.
    assert torch.allclose(out, torch.tensor([[1.0, -3.0, 0.5, 0.3]]))


def test_repetition_penalty_matches_transformers() -> None:
    prompt = random_prompts(60, [8])[0]
    params = SamplingParams(repetition_penalty=1.5)
    outs, _ = run_scheduler(backend("llama"), [prompt], 16, params=params)
    checkpoint("llama")
    with torch.no_grad():
        ref = reference_model("llama").generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, 8, dtype=torch.long),
            generation_config=transformers.GenerationConfig(
                max_new_tokens=16, do_sample=False, repetition_penalty=1.5, pad_token_id=0),
        )
    assert outs[0] == ref[0, 8:].tolist()


def test_top_k_one_equals_greedy() -> None:
    prompts = random_prompts(61, [5, 12, 3])
    be = backend("qwen2")
    greedy, _ = run_scheduler(be, prompts, 12)
    topk1, _ = run_scheduler(be, prompts, 12, params=SamplingParams(temperature=1.5, top_k=1))
    assert topk1 == greedy


def test_seed_is_reproducible_across_batch_mates_and_preemption() -> None:
    be = backend("qwen3")
    prompts = random_prompts(62, [6, 10, 4, 14, 9, 7])
    seeded = [SamplingParams(temperature=1.0, seed=100 + i) for i in range(len(prompts))]
    alone = [
        run_scheduler(be, [p], 20, params=[s])[0][0]
        for p, s in zip(prompts, seeded, strict=True)
    ]
    together, _ = run_scheduler(be, prompts, 20, params=seeded)
    assert together == alone
    # Unseeded batch mates and a pool small enough to preempt must not change anything.
    mixed = seeded + [SamplingParams(temperature=1.0)] * 3
    mates = prompts + random_prompts(63, [11, 5, 8])
    squeezed, stats = run_scheduler(be, mates, 20, params=mixed, total_kv_blocks=16)
    assert stats["preemptions"] > 0
    assert squeezed[: len(prompts)] == alone
    other_seed, _ = run_scheduler(be, prompts[:1], 20,
                                  params=[SamplingParams(temperature=1.0, seed=999)])
    assert other_seed[0] != alone[0]


def test_logprobs_reported_per_sample_row() -> None:
    be = backend("llama")
    prompts = random_prompts(64, [4, 6])
    params = [SamplingParams(logprobs=3), SamplingParams()]
    rows: list[tuple[float, list[tuple[int, float]]]] = []
    submit, wait = be.submit, be.wait
    sent: list[list[str]] = []

    def submit_(batch):  # type: ignore[no-untyped-def]
        sent.append(list(batch.sample_request_ids))
        return submit(batch)

    def wait_(handle):  # type: ignore[no-untyped-def]
        out = wait(handle)
        rids = sent.pop(0)
        if not rids:
            return out  # an empty step (overlap: nothing left to sample)
        lp = out.logprobs  # of the step just waited, not of a later submitted one
        assert lp is not None and len(lp) == len(out.tokens)
        rows.extend(r for r, rid in zip(lp, rids, strict=True) if rid == "r0")
        return out

    be.submit, be.wait = submit_, wait_  # type: ignore[method-assign]
    try:
        outs, _ = run_scheduler(be, prompts, 5, params=params, overlap_depth=1)
    finally:
        del be.submit, be.wait
    assert len(rows) == 5
    for (chosen, top), token in zip(rows, outs[0], strict=True):
        assert len(top) == 3 and top[0][0] == token and chosen == pytest.approx(top[0][1])
        assert chosen <= 0.0 and top[0][1] >= top[1][1] >= top[2][1]


def test_greedy_picks_what_torch_argmax_picks_on_ties_nan_and_masked_rows() -> None:
    """Greedy rows take the first largest logit (a NaN counts as largest), as torch's argmax
    does, whatever computes it."""
    sampler = Sampler(7, torch.device("cpu"))
    ninf, nan = float("-inf"), float("nan")
    logits = torch.tensor([
        [0.0, 3.0, 1.0, 3.0, -2.0, 3.0, 0.5],  # a three-way tie: the first one
        [1.0, nan, 2.0, nan, 9.0, 0.0, 0.0],  # a NaN wins, the first NaN
        [ninf] * 7,  # every token masked
        [ninf, ninf, ninf, ninf, ninf, -5.0, ninf],
    ])
    random = torch.randn(64, 7, generator=torch.Generator().manual_seed(3))
    for rows in (logits, random, random[:, :5], random.t()[:, :40].t()):
        states = [sampler.new_state([], SamplingParams()) for _ in range(len(rows))]
        tokens, _ = sampler.sample(rows.clone(), states)
        assert tokens.dtype == torch.int64
        assert tokens.tolist() == rows.argmax(dim=-1).tolist()
    assert sampler.sample(logits.clone(), [sampler.new_state([], SamplingParams())
                                           for _ in range(4)])[0].tolist() == [1, 1, 0, 5]
