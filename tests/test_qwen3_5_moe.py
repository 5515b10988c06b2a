"""Qwen3.5-MoE: Qwen3.5's hybrid layers, each MLP a mixture of experts with a gated shared
expert, against transformers' Qwen3_5MoeForCausalLM on tiny random checkpoints (those of
tests/test_qwen3_5.py with 8 experts, top 2, per layer): the same greedy tokens alone, in
batches, in prompt chunks, under preemption, after prefix hits and with overlapped steps,
from the checkpoint ``save_pretrained`` writes (one tensor per expert) and from the fused
expert tensors the released checkpoints hold, on one rank and on two; the sparse layer
equal to transformers' block where every expert is chosen; bf16 logits within the dense
family's tolerance and bf16 and quantized experts within the MoE families'; every block
and state slot free after."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import test_qwen3_5 as qwen
import torch
from iron_batch.backends.build import scheduler_config
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.layers.moe import DECODE_MAX_ROWS, MoE
from iron_batch.llm import LLM
from iron_batch.models.qwen3_5 import AttentionLayer, LinearLayer
from iron_batch.models.registry import SUPPORTED_MODEL_TYPES
from iron_batch.sampling_params import SamplingParams
from safetensors.torch import save_file
from tiny_models import random_prompts, run_scheduler, run_with_config

NAME = "moe"


def _greedy(name: str, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [qwen.hf_greedy(name, p, n) for p in prompts]


def test_registered_with_a_mixture_of_experts_in_every_layer() -> None:
    assert {"qwen3_5_moe_text", "qwen3_5_moe"} <= set(SUPPORTED_MODEL_TYPES)
    be = qwen.backend(NAME)
    assert [g.kind for g in scheduler_config(be).cache_groups] == ["full", "state"]
    layers = be.model.layers
    assert [type(la) for la in layers] == [LinearLayer] * 3 + [AttentionLayer]
    for layer in layers:
        assert isinstance(layer.mlp, MoE)
        assert (layer.mlp.num_experts, layer.mlp.router.top_k) == (8, 2)
        assert layer.mlp.router.renormalize
        assert layer.mlp.shared is not None and layer.mlp.shared_gate is not None


@pytest.mark.parametrize("layer", [0, 3], ids=["linear", "attention"])
def test_sparse_layer_equals_transformers_when_every_and_when_few_experts_are_chosen(
    layer: int,
) -> None:
    moe = qwen.backend(NAME).model.layers[layer].mlp
    block = qwen.reference(NAME).model.layers[layer].mlp
    torch.manual_seed(4)
    wide = torch.randn(64, 64)
    for x in (wide, wide[:1]):
        _, ids = moe.router(x)
        chosen = set(ids.flatten().tolist())
        assert chosen == set(range(8)) if len(x) > 1 else len(chosen) < 8
        with torch.no_grad():
            want = block(x[None])[0]
        torch.testing.assert_close(moe(x), want, rtol=1e-5, atol=1e-5)


def test_alone_and_batched_match_transformers() -> None:
    be = qwen.backend(NAME)
    prompts = random_prompts(31, [1, 9, 40, 70, 3])
    want = _greedy(NAME, prompts, 20)
    outs, s = run_with_config(be, scheduler_config(be), prompts[:1], 20)
    assert outs == want[:1]
    qwen._all_free(s)
    outs, s = run_with_config(be, scheduler_config(be), prompts, 20)
    assert outs == want
    qwen._all_free(s)


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill_carries_the_state(chunk: int) -> None:
    be = qwen.backend(NAME)
    prompts = random_prompts(32, [45, 2, 23])
    cfg = scheduler_config(be, max_batch_tokens=chunk, enable_prefix_caching=False)
    outs, s = run_with_config(be, cfg, prompts, 12)
    assert outs == _greedy(NAME, prompts, 12)
    qwen._all_free(s)


def test_prefix_hits_resume_from_a_checkpoint() -> None:
    name = "moe_tied"
    be = qwen.backend(name)
    prefix = random_prompts(33, [27])[0]
    prompts = [prefix] + [prefix + tail for tail in random_prompts(34, [6, 1])]
    cfg = scheduler_config(be, max_batch_tokens=12, max_running_seqs=1)
    cfg.state_checkpoint_interval = 1
    outs, s = run_with_config(be, cfg, prompts, 10)
    assert outs == _greedy(name, prompts, 10)
    stats = s.stats()
    assert stats["state_checkpoint_hits"] >= 2 and stats["prefix_cache_hit_tokens"] >= 2 * 24
    qwen._all_free(s)


def test_preemption_overlap_and_wide_decode_batches_stay_exact() -> None:
    be = qwen.backend(NAME, total_kv_blocks=40)
    prompts = random_prompts(35, [17, 3, 9, 1, 12, 25, 4, 6, 11, 2])
    widths: list[int] = []
    outs, stats = run_scheduler(be, prompts, 16, max_batch_tokens=16, max_running_seqs=10,
                                overlap_depth=1,
                                on_step=lambda b: widths.append(len(b.sample_indices)))
    assert outs == _greedy(NAME, prompts, 16)
    assert stats["preemptions"] > 0
    assert max(widths) > DECODE_MAX_ROWS
    # (run_scheduler checks that every block and state slot is free at the end.)


def test_the_fused_expert_tensors_of_the_released_checkpoints_load(tmp_path: Path) -> None:
    """transformers' own parameters (``experts.gate_up_proj`` ``[E, 2I, H]``,
    ``experts.down_proj`` ``[E, H, I]``), as the released checkpoints store them."""
    model = qwen.reference(NAME)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen.checkpoint(NAME) / f, tmp_path / f)
    be = TorchBackend.from_model(str(tmp_path), device="cpu", dtype="float32",
                                 total_kv_blocks=64, kv_block_size=qwen.BS)
    prompts = random_prompts(36, [8, 30])
    outs, s = run_with_config(be, scheduler_config(be, max_batch_tokens=16), prompts, 12)
    assert outs == _greedy(NAME, prompts, 12)
    qwen._all_free(s)


def test_the_text_part_of_a_multimodal_checkpoint() -> None:
    qwen.check_the_text_part_of_a_multimodal_checkpoint(moe=True)


@pytest.mark.parametrize(("mode", "tolerance"), [(None, 0.02), ("int8", 0.03), ("int4", 0.2)],
                         ids=["bf16", "int8", "int4"])
def test_bf16_and_quantized_experts_stay_close_to_float32(
    mode: str | None, tolerance: float
) -> None:
    """As tests/test_moe.py: the sparse layer in bf16 (its experts quantized by ``mode``)
    against transformers' float32 block, by the experts kernel (a decode step's rows) and
    at more rows."""
    be = qwen.backend(NAME, dtype="bfloat16", quantization=mode)
    # Decode steps run the one-call stack, experts included (tests/test_qwen3_5_one_call.py
    # holds it to the layer path's logits); the layer itself is checked here.
    assert be.model.hybrid is not None
    torch.manual_seed(6)
    x = torch.randn(24, 64).bfloat16()
    for layer in (0, 3):
        moe = be.model.layers[layer].mlp
        assert moe.decode_kernel
        block = qwen.reference(NAME).model.layers[layer].mlp
        for rows in (DECODE_MAX_ROWS, 24):
            with torch.no_grad():
                want = block(x[:rows].float()[None])[0]
            err = (moe(x[:rows]).float() - want).norm() / want.norm()
            assert err < tolerance, (layer, rows, err)


def test_bf16_logits_stay_within_tolerance() -> None:
    # (Where rounding flips a token's chosen experts, the logits jump: transformers' own
    # bf16 run has such positions too, which the tolerance allows for. Quantized experts
    # are checked by layer, above.)
    qwen.check_logits_within_tolerance(NAME, None)


def test_attention_bias_is_refused_by_name(tmp_path: Path) -> None:
    shutil.copytree(qwen.checkpoint(NAME), tmp_path, dirs_exist_ok=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "attention_bias": True}))
    with pytest.raises(ValueError, match="unsupported attention_bias"):
        TorchBackend.from_model(str(tmp_path), device="cpu", dtype="float32",
                                total_kv_blocks=16, kv_block_size=qwen.BS)


def test_tp2_equals_tp1_and_transformers() -> None:
    kw = dict(device="cpu", dtype="float32", total_kv_blocks=128, kv_block_size=qwen.BS)
    path = str(qwen.checkpoint(NAME))
    prompts = random_prompts(37, [1, 11, 29])
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    llm = LLM(model=path, tensor_parallel_size=2, tp_timeout=600.0, **kw)
    try:
        tp2 = [o.token_ids for o in llm.generate(prompts, params)]
        qwen._all_free(llm.engine.scheduler)
    finally:
        llm.close()
    assert tp2 == [o.token_ids for o in LLM(model=path, **kw).generate(prompts, params)]
    assert tp2 == _greedy(NAME, prompts, 10)
