"""Qwen3.5 decode steps with every layer in one Rust call (``layers/hybrid_stack.py``): the
Python layer path's logits and greedy choices in bf16 and quantized, dense and with experts
(Qwen3.5-MoE), alone and batched,
under preemption and prefix hits from state checkpoints; overlapped steps give the tokens of
steps taken one at a time; prompt steps keep the layer path; bad calls are refused and
change no cache and no state."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from iron_batch import CacheGroup, SamplingParams, Scheduler
from iron_batch.backends.build import scheduler_config
from iron_batch.backends.torch_backend import TorchBackend
from test_qwen3_5 import MOE_VARIANTS, VARIANTS, _all_free, checkpoint
from tiny_models import random_prompts, run_scheduler

BS = 4


def _backend(name: str, fused: bool, monkeypatch: pytest.MonkeyPatch,
             quantization: str | None = None, total_kv_blocks: int = 128) -> TorchBackend:
    monkeypatch.setenv("IRON_BATCH_CPU_DECODER", "1" if fused else "0")
    be = TorchBackend.from_model(str(checkpoint(name)), device="cpu", dtype="bfloat16",
                                 total_kv_blocks=total_kv_blocks, kv_block_size=BS,
                                 quantization=quantization)
    assert (be.model.hybrid is not None) == fused
    return be


def _counting(be: TorchBackend) -> list[int]:
    """The row counts of the steps the stack runs, recorded as they happen."""
    rows: list[int] = []
    stack = be.model.hybrid
    if stack is not None:
        decode = stack.decode

        def counted(h: torch.Tensor, *args, **kwargs):  # type: ignore[no-untyped-def]
            rows.append(h.shape[0])
            return decode(h, *args, **kwargs)

        stack.decode = counted  # type: ignore[method-assign]
    return rows


def _lockstep(fused: TorchBackend, plain: TorchBackend, cfg: Any,
              prompts: list[list[int]], max_new: int, steps: int = 4) -> Scheduler:
    """Both backends step through the same batches, each committed with the layer path's
    tokens (so that a near tie decided by rounding cannot send the two down different
    continuations); every step's logits of the stack must be the layer path's within four
    bf16 steps of the largest (its f32 sums add in another order than torch's, which now and
    then moves a value across a rounding boundary, and the recurrent state carries such a
    difference on), and its greedy choice the same wherever the layer path's best two logits
    are further apart than twice that (``steps``: four by default). Returns the
    scheduler."""
    captured: list[list[torch.Tensor]] = [[], []]
    for be, out in zip((fused, plain), captured, strict=True):
        forward = be.model._logits

        def keep(h: torch.Tensor, rows: np.ndarray, forward: Any = forward,
                 out: list[torch.Tensor] = out) -> torch.Tensor:
            logits = forward(h, rows)
            out.append(logits.float().clone())
            return logits

        be.model._logits = keep  # type: ignore[method-assign]
    scheds = [Scheduler(cfg), Scheduler(cfg)]
    for i, p in enumerate(prompts):
        for be, s in zip((fused, plain), scheds, strict=True):
            be.add_request(f"r{i}", p, SamplingParams())
            s.add_request(f"r{i}", p, max_new)
    events = None
    taken = 0
    while scheds[1].has_work():
        batches = [s.schedule() for s in scheds]
        assert np.array_equal(batches[0].input_ids, batches[1].input_ids)
        fused.execute(batches[0])
        tokens = plain.execute(batches[1])
        got, want = captured[0][-1], captured[1][-1]
        if want.numel():  # (a prompt chunk that samples nothing has no logits)
            step = 2.0 ** -7 * want.abs().max().item()
            torch.testing.assert_close(got, want, rtol=0, atol=steps * step)
            for g, w in zip(got, want, strict=True):
                best = w.topk(2).values
                if best[0] - best[1] > 2 * steps * step:
                    assert int(g.argmax()) == int(w.argmax())
        for s, batch in zip(scheds, batches, strict=True):
            events = s.commit(batch, tokens)
            s.check_invariants()
        for rid, finished in zip(events.request_ids, events.finished.tolist(), strict=True):
            if finished:
                fused.remove_request(rid)
                plain.remove_request(rid)
        taken += 1
    assert not scheds[0].has_work() and taken >= max_new
    for be in (fused, plain):
        del be.model._logits
    _all_free(scheds[0])
    return scheds[0]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("name", sorted(VARIANTS) + sorted(MOE_VARIANTS))
def test_one_call_decode_gives_the_layer_paths_logits(
    name: str, quantization: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    fused = _backend(name, True, monkeypatch, quantization)
    plain = _backend(name, False, monkeypatch, quantization)
    rows = _counting(fused)
    prompts = random_prompts(3, [40, 7, 19, 3, 28])
    for group in ([prompts[0]], [prompts[1]], prompts):
        _lockstep(fused, plain, scheduler_config(fused, max_batch_tokens=64), group, 24)
    # Decode steps of one sequence and of all five went through the stack; the prompt
    # steps (up to 64 tokens) did not.
    assert {1, 5} <= set(rows) and max(rows) <= 5


def test_preemption_prefix_hits_and_overlap_keep_the_layer_paths_logits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Preemption: a pool of 22 blocks for five sequences (states recomputed on resume).
    fused = _backend("untied", True, monkeypatch)
    plain = _backend("untied", False, monkeypatch)
    rows = _counting(fused)
    cfg = scheduler_config(fused, max_batch_tokens=16, enable_prefix_caching=False)
    cfg.cache_groups = [CacheGroup("full", 22, unit_bytes=cfg.cache_groups[0].unit_bytes),
                        cfg.cache_groups[1]]
    s = _lockstep(fused, plain, cfg, random_prompts(13, [21, 6, 30, 14, 9]), 30)
    assert s.stats()["preemptions"] > 0 and rows
    # Prefix hits: later prompts resume from the first one's state checkpoints.
    fused = _backend("tied", True, monkeypatch)
    plain = _backend("tied", False, monkeypatch)
    rows = _counting(fused)
    prefix = random_prompts(14, [27])[0]
    prompts = [prefix] + [prefix + tail for tail in random_prompts(15, [6, 1, 13])]
    cfg = scheduler_config(fused, max_batch_tokens=12, max_running_seqs=1)
    cfg.state_checkpoint_interval = 1
    s = _lockstep(fused, plain, cfg, prompts, 12)
    assert s.stats()["state_checkpoint_hits"] >= 3 and rows
    # Overlapped steps (token ids filled in on the device by the backend) give the tokens
    # of steps taken one at a time, through the same stack.
    fused = _backend("untied", True, monkeypatch, total_kv_blocks=40)
    rows = _counting(fused)
    prefix = random_prompts(16, [17])[0]
    prompts = [prefix + t for t in random_prompts(17, [3, 9, 1, 12])]
    runs = [run_scheduler(fused, prompts, 20, max_batch_tokens=16, max_running_seqs=4,
                          overlap_depth=depth)[0] for depth in (1, 0)]
    assert runs[0] == runs[1] and rows


def test_bad_calls_are_refused_and_change_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    be = _backend("untied", True, monkeypatch)
    model = be.model
    stack = model.hybrid
    assert stack is not None
    model.allocate_kv_cache([8, 4], BS)
    assert model.conv_states is not None and model.delta_states is not None
    for pool in (model.conv_states, model.delta_states, *model.kv_caches):
        pool.uniform_(-1.0, 1.0)
    before = [t.clone() for t in (model.conv_states, model.delta_states, *model.kv_caches)]
    c = model.config
    rotary = c.rotary_dim
    cos = torch.ones(2, rotary, dtype=torch.bfloat16)
    sin = torch.zeros(2, rotary, dtype=torch.bfloat16)
    h = torch.ones(2, c.hidden_size, dtype=torch.bfloat16)
    good = dict(slots=np.array([0, 4]), block_tables=np.array([[0], [1]]),
                seq_lens=np.array([1, 1]), state_slots=np.array([0, 1]))
    bad = [
        ("state slots must be distinct", dict(good, state_slots=np.array([1, 1]))),
        ("state slots must be distinct and below 4", dict(good, state_slots=np.array([0, 4]))),
        ("KV slot 32 outside", dict(good, slots=np.array([0, 32]))),
        ("block 9 outside", dict(good, block_tables=np.array([[0], [9]]))),
        ("does not fit its block table", dict(good, seq_lens=np.array([1, 5]))),
    ]
    for message, args in bad:
        with pytest.raises(ValueError, match=message):
            stack.decode(h.clone(), cos, sin, **args)
    with pytest.raises(ValueError, match="h must be"):
        stack.decode(torch.ones(9, c.hidden_size, dtype=torch.bfloat16),
                     cos[:1].expand(9, -1), sin[:1].expand(9, -1), **good)
    with pytest.raises(ValueError, match="rotary tables"):
        stack.decode(h.clone(), cos[:, :2], sin[:, :2], **good)
    after = [model.conv_states, model.delta_states, *model.kv_caches]
    for b, a in zip(before, after, strict=True):
        assert torch.equal(a, b)
    # The same call with good inputs does write: the refusals above were the checks'.
    stack.decode(h.clone(), cos, sin, **good)
    assert not torch.equal(model.delta_states, before[1])


def test_float32_and_the_switch_keep_the_layer_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IRON_BATCH_CPU_DECODER", "1")
    be = TorchBackend.from_model(str(checkpoint("untied")), device="cpu", dtype="float32",
                                 total_kv_blocks=64, kv_block_size=BS)
    assert be.model.hybrid is None
    _backend("untied", False, monkeypatch)  # asserts no stack with the switch off
