"""Qwen3.5 (dense): Gated DeltaNet layers whose state lives in the state cache group, and
gated full-attention layers in paged KV, against transformers' Qwen3_5ForCausalLM on tiny
random checkpoints: the same greedy tokens alone, in batches, in prompt chunks cut
anywhere, under preemption (the state recomputed), after prefix hits (the state resumed
from a checkpoint) and with overlapped steps; every block and state slot free after."""

from __future__ import annotations

import copy
import tempfile
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import transformers
from iron_batch import CacheGroup
from iron_batch.backends.build import scheduler_config
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.models.registry import SUPPORTED_MODEL_TYPES
from tiny_models import random_prompts, run_scheduler, run_with_config, write_byte_tokenizer

BS = 4
_ROOT = Path(tempfile.mkdtemp(prefix="iron_batch_qwen3_5_"))

#: Three linear-attention layers to one full-attention one, as the released models; two
#: key heads serving four value heads; partial rotary (a quarter of each 32-wide head).
TEXT = dict(
    vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
    linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, max_position_embeddings=512, rms_norm_eps=1e-5,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
VARIANTS: dict[str, dict[str, Any]] = {
    "untied": dict(tie_word_embeddings=False),
    # Full attention first and last, tied head.
    "tied": dict(tie_word_embeddings=True, num_hidden_layers=5,
                 layer_types=["full_attention", "linear_attention", "linear_attention",
                              "linear_attention", "full_attention"]),
}
#: Qwen3.5-MoE checkpoints (tests/test_qwen3_5_moe.py): TEXT's layers, each MLP 8 experts
#: (top 2) and a shared expert; "moe_tied" with full attention first and last.
MOE_VARIANTS: dict[str, dict[str, Any]] = {
    "moe": dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2,
                moe_intermediate_size=32, shared_expert_intermediate_size=64),
}
MOE_VARIANTS["moe_tied"] = {**MOE_VARIANTS["moe"], **VARIANTS["tied"]}


def _randomize(model: Any, seed: int) -> Any:
    """Weights wider than the default init (logits far apart: greedy choices are not
    decided by rounding); decay parameters spread so that some heads forget fast."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(-0.5, 0.5)
            elif name.endswith(("A_log", "dt_bias")):
                p.uniform_(-1.0, 1.0)
            else:
                p.normal_(0.0, 0.15)
    return model.eval()


@cache
def reference(name: str) -> Any:
    if name in MOE_VARIANTS:
        config = transformers.Qwen3_5MoeTextConfig(**{**TEXT, **MOE_VARIANTS[name]})
        model = transformers.Qwen3_5MoeForCausalLM(config)
    else:
        model = transformers.Qwen3_5ForCausalLM(
            transformers.Qwen3_5TextConfig(**{**TEXT, **VARIANTS[name]}))
    return _randomize(model, sum(map(ord, name)))


@cache
def checkpoint(name: str) -> Path:
    folder = _ROOT / name
    reference(name).save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder


def backend(name: str, total_kv_blocks: int = 128, dtype: str = "float32",
            quantization: str | None = None) -> TorchBackend:
    return TorchBackend.from_model(str(checkpoint(name)), device="cpu", dtype=dtype,
                                   total_kv_blocks=total_kv_blocks, kv_block_size=BS,
                                   quantization=quantization)


def hf_greedy(name: str, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = reference(name).generate(
            torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def _all_free(s: Any) -> None:
    for g in s.group_stats():
        assert (g["used"], g["free"]) == (0, g["total"]), g


def test_registered_with_a_full_and_a_state_group() -> None:
    assert {"qwen3_5_text", "qwen3_5"} <= set(SUPPORTED_MODEL_TYPES)
    be = backend("untied")
    cfg = scheduler_config(be)
    assert [g.kind for g in cfg.cache_groups] == ["full", "state"]
    # One slot holds every linear layer's conv window and delta-rule matrices, float32.
    channels = 2 * 2 * 16 + 4 * 16
    assert cfg.cache_groups[1].unit_bytes == 3 * 4 * (channels * 3 + 4 * 16 * 16)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_alone_and_batched_match_transformers(name: str) -> None:
    be = backend(name)
    prompts = random_prompts(11, [1, 9, 40, 70, 3])
    want = [hf_greedy(name, p, 24) for p in prompts]
    for p, w in zip(prompts[:2], want[:2], strict=True):
        outs, s = run_with_config(be, scheduler_config(be), [p], 24)
        assert outs == [w]
        _all_free(s)
    outs, s = run_with_config(be, scheduler_config(be), prompts, 24)
    assert outs == want
    _all_free(s)


@pytest.mark.parametrize("chunk", [5, 7, 16])
def test_chunked_prefill_carries_the_state(chunk: int) -> None:
    # Chunks of 5 and 7 tokens end anywhere in a block and in the delta rule's blocks.
    name = "untied"
    be = backend(name)
    prompts = random_prompts(12, [70, 23, 2])
    cfg = scheduler_config(be, max_batch_tokens=chunk, enable_prefix_caching=False)
    outs, s = run_with_config(be, cfg, prompts, 16)
    assert outs == [hf_greedy(name, p, 16) for p in prompts]
    _all_free(s)


def test_preemption_recomputes_the_state() -> None:
    name = "untied"
    be = backend(name)
    prompts = random_prompts(13, [21, 6, 30, 14, 9])
    cfg = scheduler_config(be, max_batch_tokens=16, enable_prefix_caching=False)
    cfg.cache_groups = [CacheGroup("full", 22, unit_bytes=cfg.cache_groups[0].unit_bytes),
                        cfg.cache_groups[1]]
    outs, s = run_with_config(be, cfg, prompts, 30)
    assert outs == [hf_greedy(name, p, 30) for p in prompts]
    assert s.stats()["preemptions"] > 0
    _all_free(s)


@pytest.mark.parametrize("interval", [0, 1])
def test_prefix_hits_resume_from_a_checkpoint(interval: int) -> None:
    # One sequence at a time: the first prompt leaves a checkpoint at the end of its last
    # full block (24 tokens; with an interval of 1, at every block too), and each later
    # prompt, which shares those 24 tokens, resumes from it.
    name = "tied"
    be = backend(name)
    prefix = random_prompts(14, [27])[0]
    prompts = [prefix] + [prefix + tail for tail in random_prompts(15, [6, 1, 13])]
    cfg = scheduler_config(be, max_batch_tokens=12, max_running_seqs=1)
    cfg.state_checkpoint_interval = interval
    outs, s = run_with_config(be, cfg, prompts, 12)
    assert outs == [hf_greedy(name, p, 12) for p in prompts]
    stats = s.stats()
    assert stats["state_checkpoint_hits"] >= 3 and stats["prefix_cache_hit_tokens"] >= 3 * 24
    _all_free(s)


def test_overlapped_steps_and_tiny_pools_stay_exact() -> None:
    name = "untied"
    be = backend(name, total_kv_blocks=40)
    prefix = random_prompts(16, [17])[0]
    prompts = [prefix + t for t in random_prompts(17, [3, 9, 1, 12])] + random_prompts(
        18, [25, 4])
    outs, stats = run_scheduler(be, prompts, 20, max_batch_tokens=16, max_running_seqs=4,
                                overlap_depth=1)
    assert outs == [hf_greedy(name, p, 20) for p in prompts]
    assert stats["preemptions"] > 0
    # (run_scheduler checks that every block and state slot is free at the end.)


def test_the_rust_kernels_serve_by_default_and_the_torch_route_matches_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    name = "untied"
    from iron_batch.models.qwen3_5 import LinearLayer

    prompts = random_prompts(21, [90, 4, 33])
    want = [hf_greedy(name, p, 12) for p in prompts]
    by_kernel = backend(name)
    mixers = [layer.mixer for layer in by_kernel.model.layers if isinstance(layer, LinearLayer)]
    assert mixers and all(m.kernels for m in mixers)
    monkeypatch.setenv("IRON_BATCH_CPU_ATTENTION", "torch")
    by_torch = backend(name)
    assert not any(layer.mixer.kernels for layer in by_torch.model.layers
                   if isinstance(layer, LinearLayer))
    for be in (by_kernel, by_torch):
        outs, s = run_with_config(be, scheduler_config(be, max_batch_tokens=24), prompts, 12)
        assert outs == want
        _all_free(s)


def test_the_offline_engine_serves_it_and_frees_every_slot() -> None:
    from iron_batch import LLM, SamplingParams

    name = "untied"
    llm = LLM(model=str(checkpoint(name)), device="cpu", dtype="float32", total_kv_blocks=64,
              kv_block_size=BS, max_batch_tokens=16)
    prompts = random_prompts(22, [12, 40, 3, 25])
    outs = llm.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(name, p, 10) for p in prompts]
    groups = llm.engine.scheduler.group_stats()
    assert [g["kind"] for g in groups] == ["full", "state"]
    _all_free(llm.engine.scheduler)


def test_a_batch_without_state_slots_is_refused() -> None:
    from iron_batch import Scheduler, SchedulerConfig

    be = backend("untied")
    s = Scheduler(SchedulerConfig(total_kv_blocks=128, kv_block_size=BS))  # no state group
    s.add_request("a", [5, 6, 7], 2)
    with pytest.raises(ValueError, match="recurrent state"):
        be.execute(s.schedule())


def _multimodal_checkpoint(moe: bool = False) -> tuple[Path, Any]:
    folder = _ROOT / ("multimodal-moe" if moe else "multimodal")
    text = {**TEXT, **MOE_VARIANTS["moe"]} if moe else {**TEXT, "tie_word_embeddings": False}
    family = "Qwen3_5Moe" if moe else "Qwen3_5"
    config = getattr(transformers, f"{family}Config")(
        text_config=text,
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           out_hidden_size=64, patch_size=4, temporal_patch_size=1,
                           spatial_merge_size=1),
        tie_word_embeddings=False)
    model = _randomize(getattr(transformers, f"{family}ForConditionalGeneration")(config), 5)
    model.save_pretrained(folder)
    write_byte_tokenizer(folder)
    return folder, model


def test_the_text_part_of_a_multimodal_checkpoint() -> None:
    check_the_text_part_of_a_multimodal_checkpoint(moe=False)


def check_the_text_part_of_a_multimodal_checkpoint(moe: bool) -> None:
    folder, model = _multimodal_checkpoint(moe)
    be = TorchBackend.from_model(str(folder), device="cpu", dtype="float32",
                                 total_kv_blocks=64, kv_block_size=BS)
    prompts = random_prompts(19, [8, 33])
    outs, s = run_with_config(be, scheduler_config(be, max_batch_tokens=16), prompts, 12)
    want = []
    with torch.no_grad():
        for p in prompts:
            got = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                 dtype=torch.long), max_new_tokens=12, do_sample=False,
                                 pad_token_id=0, eos_token_id=None)
            want.append(got[0, len(p):].tolist())
    assert outs == want
    _all_free(s)


# ---------------------------------------------------------------- bf16 and quantized


def _every_logit(be: TorchBackend, tokens: list[int]) -> torch.Tensor:
    """Our logits at every position of ``tokens``: one prefill in chunks of 5 (state and
    KV carried from chunk to chunk), through the scheduler's own batches."""
    from iron_batch import Scheduler

    cfg = scheduler_config(be, max_batch_tokens=5, enable_prefix_caching=False)
    s = Scheduler(cfg)
    s.add_request("a", tokens, 1)
    rows = []
    while s.has_work():
        batch = s.schedule()
        from iron_batch.batch import model_inputs, state_model_inputs

        inputs: dict[str, Any] = {**model_inputs(batch), **state_model_inputs(batch)}
        n = len(batch.input_ids)
        inputs["sample_indices"] = np.arange(n)
        logits = be.model.forward(**inputs)
        rows.append(logits)
        s.commit(batch, np.array([int(logits[-1].argmax())] if len(batch.sample_indices)
                                 else [], dtype=np.int64))
    _all_free(s)
    return torch.cat(rows)


#: As tests/test_quantization.py: the largest |logit difference| over a prompt and its
#: continuation, for logits spanning about +-5 (scaled by a wider span)...
TINY_LOGIT_TOLERANCE = 0.4
#: ... or, where larger, this many times transformers' own bf16 error on the same weights
#: and tokens. The linear layers l2-normalize q and k from bf16 convolution outputs, which
#: amplifies rounding where those are small: transformers' bf16 run measures 0.04-0.25
#: here, ours 0.04-0.2 at most positions with single positions up to 0.56 (int4).
BF16_ERROR_FACTOR = 3.0


def _hf_with_weights(name: str, be: TorchBackend) -> Any:
    """transformers' float32 model with our (dequantized) projection weights."""
    from iron_batch.layers import quant
    from iron_batch.layers.moe import MoE
    from iron_batch.models.qwen3_5 import LinearLayer

    def dense(lin: Any) -> torch.Tensor:
        w = lin.weight
        return (w.dequantize() if isinstance(w, quant.QuantWeight) else w).float()

    ref = type(reference(name))(reference(name).config)
    ref.load_state_dict(reference(name).state_dict())
    with torch.no_grad():
        for layer, theirs in zip(be.model.layers, ref.model.layers, strict=True):
            if isinstance(layer, LinearLayer):
                la = theirs.linear_attn
                parts = [la.in_proj_qkv, la.in_proj_z, la.in_proj_b, la.in_proj_a]
                w = dense(layer.mixer.in_proj)
                for p, chunk in zip(parts, w.split([p.weight.shape[0] for p in parts]),
                                    strict=True):
                    p.weight.copy_(chunk)
                la.out_proj.weight.copy_(dense(layer.mixer.out_proj))
            else:
                sa = theirs.self_attn
                parts = [sa.q_proj, sa.k_proj, sa.v_proj]
                w = dense(layer.qkv)
                for p, chunk in zip(parts, w.split([p.weight.shape[0] for p in parts]),
                                    strict=True):
                    p.weight.copy_(chunk)
                sa.o_proj.weight.copy_(dense(layer.o))
            mlp, ours = theirs.mlp, layer.mlp
            if isinstance(ours, MoE):  # the stacked experts into the fused tensors
                experts = mlp.experts
                experts.gate_up_proj.copy_(dense(ours.gate_up).view_as(experts.gate_up_proj))
                experts.down_proj.copy_(dense(ours.down).view_as(experts.down_proj))
                assert ours.shared is not None
                mlp, ours = mlp.shared_expert, ours.shared
            gate, up = dense(ours.gate_up).chunk(2)
            mlp.gate_proj.weight.copy_(gate)
            mlp.up_proj.weight.copy_(up)
            mlp.down_proj.weight.copy_(dense(ours.down))
        ref.lm_head.weight.copy_(dense(be.model.lm_head.linear))
    return ref.eval()


@pytest.mark.parametrize("mode", [None, "int8", "int4"], ids=["bf16", "int8", "int4"])
def test_bf16_and_quantized_logits_stay_within_tolerance(mode: str | None) -> None:
    check_logits_within_tolerance("untied", mode)


def check_logits_within_tolerance(name: str, mode: str | None) -> None:
    """Checkpoint ``name`` in bf16 (``mode``: its projections quantized) against
    transformers' float32 model with the same (dequantized) weights."""
    be = backend(name, dtype="bfloat16", quantization=mode)
    ref = _hf_with_weights(name, be)
    for prompt in random_prompts(20, [5, 30]):
        with torch.no_grad():
            tokens = ref.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                                                                  dtype=torch.long),
                max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None,
            )[0].tolist()
            want = ref(torch.tensor([tokens])).logits[0]
            theirs = copy.deepcopy(ref).to(torch.bfloat16)
            theirs_error = (theirs(torch.tensor([tokens])).logits[0].float() - want).abs().max()
        got = _every_logit(be, tokens)
        tolerance = max(TINY_LOGIT_TOLERANCE * max(1.0, want.abs().max().item() / 5.0),
                        BF16_ERROR_FACTOR * theirs_error.item())
        assert (got - want).abs().max().item() <= tolerance
