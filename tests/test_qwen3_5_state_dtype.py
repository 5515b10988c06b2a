"""Qwen3.5 with its delta-rule states kept in bf16 (``--recurrent-state-dtype bfloat16``):
half the bytes per state slot, so about twice the slots in the same memory; logits within
the bf16 tolerance against transformers' float32 model, and within a few bf16 steps of the
float32-state run step by step (decode through the one-call stack, through the layer path's
kernels and through torch ops, prompt chunks, preemption, prefix hits from checkpoints);
every slot free after; the option refused where it does not apply."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from iron_batch import LLM, CacheGroup, SamplingParams, Scheduler
from iron_batch.backends.build import BackendConfigError, build_backend, scheduler_config
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.batch import model_inputs, state_model_inputs
from test_qwen3_5 import (
    BF16_ERROR_FACTOR,
    TINY_LOGIT_TOLERANCE,
    _all_free,
    _hf_with_weights,
    checkpoint,
)
from test_qwen3_5_one_call import _counting, _lockstep
from tiny_models import checkpoint as llama_checkpoint
from tiny_models import random_prompts

BS = 4

#: The route a decode row takes: the one-call Rust stack, the layer path over the Rust
#: delta-rule kernels, or the layer path over torch ops.
ROUTES = {
    "stack": {"IRON_BATCH_CPU_DECODER": "1"},
    "layer-kernels": {"IRON_BATCH_CPU_DECODER": "0"},
    "torch": {"IRON_BATCH_CPU_DECODER": "0", "IRON_BATCH_CPU_ATTENTION": "torch"},
}


def _backend(name: str, state_dtype: str, total_kv_blocks: int = 128,
             kv_cache_memory_gb: float | None = None) -> TorchBackend:
    return TorchBackend.from_model(str(checkpoint(name)), device="cpu", dtype="bfloat16",
                                   total_kv_blocks=total_kv_blocks, kv_block_size=BS,
                                   kv_cache_memory_gb=kv_cache_memory_gb,
                                   recurrent_state_dtype=state_dtype)


def _teacher_forced_logits(be: TorchBackend, tokens: list[int], prompt_len: int,
                           chunk: int) -> torch.Tensor:
    """Our logits at positions 0 .. len(tokens) - 2: the prompt in chunks of ``chunk``
    tokens, then one decode step per token, each committed with ``tokens``' next token."""
    cfg = scheduler_config(be, max_batch_tokens=chunk, enable_prefix_caching=False)
    s = Scheduler(cfg)
    s.add_request("a", tokens[:prompt_len], len(tokens) - prompt_len)
    rows = []
    fed = 0
    while s.has_work():
        batch = s.schedule()
        inputs: dict[str, Any] = {**model_inputs(batch), **state_model_inputs(batch)}
        n = len(batch.input_ids)
        inputs["sample_indices"] = np.arange(n)
        rows.append(be.model.forward(**inputs).float())
        fed += n
        sampled = len(batch.sample_indices)
        s.commit(batch, np.array([tokens[fed]] if sampled else [], dtype=np.int64))
    _all_free(s)
    return torch.cat(rows)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_bf16_state_keeps_the_logits_within_the_bf16_tolerance(
    route: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key, value in ROUTES[route].items():
        monkeypatch.setenv(key, value)
    name = "untied"
    be = _backend(name, "bfloat16")
    assert (be.model.hybrid is not None) == (route == "stack")
    rows = _counting(be)
    ref = _hf_with_weights(name, be)
    theirs = _hf_with_weights(name, be).to(torch.bfloat16)
    for prompt in random_prompts(31, [9, 26]):
        with torch.no_grad():
            tokens = ref.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                  dtype=torch.long),
                max_new_tokens=40, do_sample=False, pad_token_id=0, eos_token_id=None,
            )[0].tolist()
            want = ref(torch.tensor([tokens])).logits[0, :-1]
            theirs_error = (theirs(torch.tensor([tokens])).logits[0, :-1].float()
                            - want).abs().max().item()
        got = _teacher_forced_logits(be, tokens, len(prompt), chunk=5)
        tolerance = max(TINY_LOGIT_TOLERANCE * max(1.0, want.abs().max().item() / 5.0),
                        BF16_ERROR_FACTOR * theirs_error)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= tolerance
    if route == "stack":
        assert 1 in rows  # the decode rows went through the one-call stack


#: Logits of the bf16-state run within this many bf16 steps of the largest logit of the
#: float32-state run's (the same greedy choice wherever that run's best two are twice as
#: far apart). The rounding of the state each token moves a logit by at most ~4.3 steps
#: over these workloads (measured); the one-call stack and the layer path, both on
#: float32 states, stay within 4.
STEPS = 6


def test_a_bf16_state_follows_the_float32_state_under_preemption_and_prefix_hits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IRON_BATCH_CPU_DECODER", "1")
    # Preemption: 22 blocks for five sequences (states recomputed from the tokens).
    half, full = _backend("untied", "bfloat16"), _backend("untied", "float32")
    assert half.model.delta_states.dtype == torch.bfloat16
    cfg = scheduler_config(full, max_batch_tokens=16, enable_prefix_caching=False)
    cfg.cache_groups = [CacheGroup("full", 22, unit_bytes=cfg.cache_groups[0].unit_bytes),
                        cfg.cache_groups[1]]
    s = _lockstep(half, full, cfg, random_prompts(13, [21, 6, 30, 14, 9]), 30,
                  steps=STEPS)
    assert s.stats()["preemptions"] > 0
    # Prefix hits: later prompts resume from the first one's (bf16) state checkpoints.
    half, full = _backend("tied", "bfloat16"), _backend("tied", "float32")
    prefix = random_prompts(14, [27])[0]
    prompts = [prefix] + [prefix + tail for tail in random_prompts(15, [6, 1, 13])]
    cfg = scheduler_config(full, max_batch_tokens=12, max_running_seqs=1)
    cfg.state_checkpoint_interval = 1
    s = _lockstep(half, full, cfg, prompts, 12, steps=STEPS)
    assert s.stats()["state_checkpoint_hits"] >= 3


def test_a_bf16_state_slot_takes_half_the_matrix_bytes_so_more_slots_fit() -> None:
    # TEXT: 3 linear layers; conv channels 2 * 2 * 16 + 4 * 16 = 128 over a window of 3
    # (float32 either way); 4 value heads of 16 x 16 matrices.
    window, matrices = 128 * 3, 4 * 16 * 16
    half = _backend("untied", "bfloat16", total_kv_blocks=None, kv_cache_memory_gb=0.005)
    full = _backend("untied", "float32", total_kv_blocks=None, kv_cache_memory_gb=0.005)
    groups = [scheduler_config(be).cache_groups for be in (half, full)]
    assert groups[0][1].unit_bytes == 3 * (4 * window + 2 * matrices)
    assert groups[1][1].unit_bytes == 3 * (4 * window + 4 * matrices)
    # The same memory budget holds more sequences' states (slots are 1.57x smaller
    # here; about 1.9x in the full-size shapes, where the matrices are most of a slot),
    # and the KV blocks they would have taken go to the attention layers.
    assert groups[0][1].size >= 1.4 * groups[1][1].size
    assert groups[0][0].size >= groups[1][0].size


def test_the_offline_engine_and_the_server_flag_take_it() -> None:
    llm = LLM(model=str(checkpoint("untied")), device="cpu", dtype="bfloat16",
              total_kv_blocks=64, kv_block_size=BS, max_batch_tokens=16,
              recurrent_state_dtype="bfloat16")
    prompts = random_prompts(32, [12, 40, 3, 25])
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [10] * 4
    assert llm.backend.model.delta_states.dtype == torch.bfloat16
    _all_free(llm.engine.scheduler)

    from iron_batch.server.cli import build_engine, build_parser

    parser = build_parser()
    args = parser.parse_args(["--backend", "torch", "--model", str(checkpoint("untied")),
                              "--device", "cpu", "--dtype", "bfloat16",
                              "--total-kv-blocks", "32", "--recurrent-state-dtype",
                              "bfloat16"])
    engine = build_engine(args, parser)
    assert engine.backend.model.delta_states.dtype == torch.bfloat16
    with pytest.raises(SystemExit):
        parser.parse_args(["--recurrent-state-dtype", "float16"])


def test_it_is_refused_where_it_does_not_apply() -> None:
    # A model without recurrent state: refused at load, by name.
    with pytest.raises(BackendConfigError, match="recurrent-state-dtype bfloat16.*no recurrent"):
        build_backend("torch", model=str(llama_checkpoint("llama")), device="cpu",
                      recurrent_state_dtype="bfloat16")
    # float32 is every model's default.
    build_backend("torch", model=str(llama_checkpoint("llama")), device="cpu",
                  total_kv_blocks=16, recurrent_state_dtype="float32")
    with pytest.raises(BackendConfigError, match="only applies to --backend torch"):
        build_backend("mock", recurrent_state_dtype="bfloat16")
    with pytest.raises(BackendConfigError, match="not one of float32, bfloat16"):
        build_backend("torch", model=str(checkpoint("untied")), recurrent_state_dtype="fp8")


def test_tensor_parallel_ranks_keep_their_heads_states_in_bf16() -> None:
    # float32 weights, so that TP=2 and TP=1 differ only in how the projections' sums
    # split; each rank's slots hold its value heads' bf16 matrices.
    import test_qwen3_5_tensor_parallel as tp

    path, _ = tp._checkpoint("even")
    kw = {**tp.KW, "recurrent_state_dtype": "bfloat16"}
    prompts = random_prompts(33, [14, 37, 5])
    one = LLM(model=path, **kw)
    want = [o.token_ids for o in one.generate(prompts, tp.GREEDY)]
    two = LLM(model=path, tensor_parallel_size=2, tp_timeout=tp.TP_TIMEOUT, **kw)
    try:
        assert two.backend.model.delta_states.dtype == torch.bfloat16
        assert two.backend.model.delta_states.shape[2] == 2  # one key head's 2 value heads
        assert [o.token_ids for o in two.generate(prompts, tp.GREEDY)] == want
        _all_free(two.engine.scheduler)
    finally:
        two.close()
