"""Gemma 4 where the shared family tests do not look: layers that share K/V hold no cache
of their own, the global layers' values come from the k projection, per-layer embeddings
on and off (and values from a v projection) are each exact against transformers, the
proportional rope equals transformers', every position's logits agree in float32, the
sliding layers release their blocks, two tensor-parallel ranks give transformers' tokens
where the global layers have fewer or more K/V heads than the sliding ones, and the
features not implemented are refused by name. The mixture-of-experts layers have tests of
their own (``test_gemma4_moe.py``)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import torch
from iron_batch import Scheduler
from iron_batch.backends.build import scheduler_config
from iron_batch.layers.rotary import rope_inv_freq
from iron_batch.llm import LLM
from iron_batch.models.gemma4 import Gemma4ForCausalLM, Gemma4Layer
from iron_batch.sampling_params import SamplingParams
from tiny_models import (
    FAMILIES,
    VARIANTS,
    backend,
    checkpoint,
    hf_greedy,
    random_prompts,
    reference_model,
    run_scheduler,
    run_with_config,
)

_BASE = FAMILIES["gemma4"][1]
VARIANTS.update({
    # No per-layer embeddings. (Without sharing too: transformers' own forward fails for a
    # prompt of several tokens when it shares K/V without per-layer inputs.)
    "gemma4_no_ple": ("Gemma4TextConfig", {**_BASE, "hidden_size_per_layer_input": 0,
                                           "num_kv_shared_layers": 0}),
    # Global layers with a v projection of their own; K/V still shared.
    "gemma4_v_proj": ("Gemma4TextConfig", {**_BASE, "attention_k_eq_v": False}),
    # More K/V heads on the global layers than on the sliding ones (1 and 2).
    "gemma4_global_kv2": ("Gemma4TextConfig", {**_BASE, "num_key_value_heads": 1,
                                               "num_global_key_value_heads": 2}),
    # The head is the token table (as in the released checkpoints).
    "gemma4_tied": ("Gemma4TextConfig", {**_BASE, "tie_word_embeddings": True}),
})


def _layers(name: str) -> list[Gemma4Layer]:
    layers = backend(name).model.layers
    assert all(isinstance(layer, Gemma4Layer) for layer in layers)
    return layers  # type: ignore[return-value]


def test_the_config_reads_per_layer_shapes_and_sharing() -> None:
    c = backend("gemma4").model.config
    assert c.layer_head_dims == [16, 32, 16, 32]
    assert c.layer_kv_heads == [2, 1, 2, 1]
    assert c.kv_sources == [None, None, 0, 1]  # each reads the last earlier one of its kind
    assert c.sliding_layers == [True, False, True, False]
    assert c.ple_dim == 8 and c.k_eq_v and c.final_softcap == 6.0


def test_layers_that_share_kv_store_nothing_of_their_own() -> None:
    be = backend("gemma4")
    model = be.model
    layers = _layers("gemma4")
    heads = model.config.num_heads
    for i, layer in enumerate(layers):
        src = layer.kv_source
        if src is None:
            continue
        # No k/v projection or norms, and the source layer's cache tensor itself.
        assert layer.qkv.shape[0] == heads * layer.head_dim
        assert layer.k_norm is None and layer.v_norm is None
        assert model.kv_caches[i] is model.kv_caches[src]
        assert layers[src].cache_group == layer.cache_group
    # Distinct cache tensors: the storing layers' only.
    assert len({c.data_ptr() for c in model.kv_caches}) == 2
    # The memory per token counts the storing layers (float32): sliding layer 0 holds
    # 2 heads of 16, global layer 1 one head of 32, K and V each.
    full, sliding = model.cache_groups.index(("full", None)), model.cache_groups.index(
        ("sliding", 20))
    per_token = model.kv_bytes_per_token()
    assert per_token[sliding] == 2 * 2 * 16 * 4 and per_token[full] == 2 * 1 * 32 * 4
    assert [g.unit_bytes for g in be.cache_groups] == [b * be.kv_block_size
                                                       for b in per_token]
    # The double-wide MLP of the sharing layers comes from the checkpoint's shapes.
    inter = model.config.intermediate_size
    assert [layer.mlp.gate_up.shape[0] for layer in layers] == [2 * inter, 2 * inter,
                                                               4 * inter, 4 * inter]


def test_global_layers_take_their_values_from_the_k_projection() -> None:
    model = backend("gemma4").model
    layers = _layers("gemma4")
    heads = model.config.num_heads
    # Global producing layer: q and k rows only; sliding: q, k and v.
    glob, slide = layers[1], layers[0]
    assert glob.v_from_k and not slide.v_from_k
    assert glob.qkv.shape[0] == (heads + glob.kv_heads) * glob.head_dim
    assert slide.qkv.shape[0] == (heads + 2 * slide.kv_heads) * slide.head_dim
    # After a prompt, position 0 (no rotation) holds K = k_norm(x) and V = the weightless
    # norm of the same x: K is V times the k norm's weight.
    fresh = backend("gemma4", total_kv_blocks=64)  # a pool of its own: slot 0 known
    model = fresh.model
    prompt = random_prompts(4, [6])[0]
    model.forward(
        input_ids=np.array(prompt), positions=np.arange(6), slot_mapping=np.arange(6),
        group_slot_mapping=np.arange(6)[None], query_start_loc=np.array([0, 6], np.int32),
        seq_lens=np.array([6], np.int32), num_computed_before=np.zeros(1, np.int32),
        block_tables=np.arange(2, dtype=np.int32)[None],
        group_block_tables=np.arange(2, dtype=np.int32)[None], sample_indices=np.array([5]))
    for i in (0, 1):
        layer = model.layers[i]
        assert isinstance(layer, Gemma4Layer) and layer.k_norm is not None
        k0 = model.kv_caches[i][0, 0, 0]  # [kv_heads, head_dim]
        v0 = model.kv_caches[i][1, 0, 0]
        related = torch.allclose(k0, v0 * layer.k_norm.weight, atol=1e-5)
        assert related == layer.v_from_k, i


@pytest.mark.parametrize("name", ["gemma4", "gemma4_no_ple", "gemma4_v_proj"])
def test_each_variant_is_exact_against_transformers(name: str) -> None:
    # Longer than the 20-token window; chunked prefill and preemption on a small pool.
    be = backend(name)
    prompts = random_prompts(11, [45, 7, 26, 3])
    outs, stats = run_scheduler(be, prompts, 16, max_batch_tokens=16, total_kv_blocks=24)
    assert outs == [hf_greedy(name, p, 16) for p in prompts]
    assert stats["preemptions"] > 0


@pytest.mark.parametrize("name", ["gemma4_v_proj", "gemma4_global_kv2", "gemma4_tied"])
def test_two_ranks_give_transformers_tokens(name: str) -> None:
    # Each rank holds 2 of the 4 query heads in every layer and, per layer, the one K/V
    # head they attend to. gemma4_v_proj and gemma4_tied: the sliding layers' 2 K/V heads
    # one per rank, the global layers' one on both; gemma4_global_kv2: the other way
    # round. The layers that share K/V read them from the rank's own cache; a tied head
    # is the rank's rows of the token table. Longer than the 20-token window; chunked
    # prefill and preemption on a small pool.
    prompts = random_prompts(11, [45, 7, 26, 3])
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    llm = LLM(model=str(checkpoint(name)), tensor_parallel_size=2, device="cpu",
              dtype="float32", kv_block_size=4, total_kv_blocks=24, max_batch_tokens=16)
    try:
        assert [layer.kv_heads for layer in llm.backend.model.layers] == [1, 1, 1, 1]
        outs = [o.token_ids for o in llm.generate(prompts, params)]
        stats = llm.engine.scheduler.stats()
    finally:
        llm.close()
    assert stats["preemptions"] > 0
    assert stats["free_blocks"] == stats["total_blocks"]
    assert outs == [hf_greedy(name, p, 16) for p in prompts]


def test_per_layer_embeddings_are_loaded_only_where_configured() -> None:
    with_ple, without = backend("gemma4").model, backend("gemma4_no_ple").model
    assert with_ple.ple_embed is not None and with_ple.ple_model_proj is not None
    assert all(layer.ple_gate is not None for layer in _layers("gemma4"))
    assert without.ple_embed is None and without.ple_model_proj is None
    assert all(layer.ple_gate is None for layer in _layers("gemma4_no_ple"))


@pytest.mark.parametrize("name", ["gemma4", "gemma4_no_ple", "gemma4_moe"])
def test_every_positions_logits_match_transformers_in_float32(name: str) -> None:
    model = backend(name, total_kv_blocks=64).model
    tokens = random_prompts(12, [41])[0]
    n = len(tokens)
    blocks = np.arange(-(-n // 4), dtype=np.int32)[None]
    got = model.forward(
        input_ids=np.array(tokens), positions=np.arange(n), slot_mapping=np.arange(n),
        group_slot_mapping=np.arange(n)[None], query_start_loc=np.array([0, n], np.int32),
        seq_lens=np.array([n], np.int32), num_computed_before=np.zeros(1, np.int32),
        block_tables=blocks, group_block_tables=blocks, sample_indices=np.arange(n))
    with torch.no_grad():
        want = reference_model(name)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)


def test_proportional_rope_equals_transformers() -> None:
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "proportional", "partial_rotary_factor": 0.25,
              "rope_theta": 1_000_000.0, "factor": 2.0}
    config = Gemma4TextConfig(
        num_hidden_layers=2, head_dim=16, global_head_dim=64,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"full_attention": params,
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    want, _ = ROPE_INIT_FUNCTIONS["proportional"](
        config.per_layer_config["full_attention"], layer_type="full_attention")
    got = rope_inv_freq(64, 1_000_000.0, params)
    torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    assert int((got != 0).sum()) == 8  # a quarter of the 32 frequency pairs turn


@pytest.mark.parametrize("name", ["gemma4", "gemma4_moe"])
def test_sliding_layers_release_blocks_and_stay_exact(name: str) -> None:
    be = backend(name, total_kv_blocks=256, kv_block_size=4)
    cfg = scheduler_config(be, max_batch_tokens=16)
    assert [(g.kind, g.window) for g in cfg.cache_groups] == [("full", None),
                                                              ("sliding", 20)]
    prompts = random_prompts(70, [45, 30, 52])
    peaks: list[int] = []

    def on_step(s: Scheduler) -> None:
        peaks.append(s.group_stats()[1]["used"])

    outs, s = run_with_config(be, cfg, prompts, 30, on_step)
    assert outs == [hf_greedy(name, p, 30) for p in prompts]
    assert s.stats()["sliding_blocks_released"] > 0
    assert max(peaks) <= 3 * (-(-(20 - 1 + 16) // 4) + 1)


def _config(**over: Any) -> dict[str, Any]:
    folder = checkpoint("gemma4")
    return {**json.loads((folder / "config.json").read_text()), **over}


@pytest.mark.parametrize(("over", "named"), [
    # Experts are served (tests/test_gemma4_moe.py); a config that does not size them is
    # refused naming what it lacks.
    ({"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
      "moe_intermediate_size": None}, "enable_moe_block without moe_intermediate_size"),
    ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 2.0,
                                             "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "default"}}}, "'yarn'"),
    ({"num_kv_shared_layers": 4}, "num_kv_shared_layers"),
    ({"hidden_activation": "relu"}, "'relu'"),
    ({"per_layer_config": {"1": {"head_dim": 32, "sliding_window": 8}}},
     "per_layer_config"),
])
def test_features_not_implemented_are_refused_by_name(over: dict[str, Any],
                                                      named: str) -> None:
    with pytest.raises(ValueError, match=named) as info:
        Gemma4ForCausalLM.config_from_hf(_config(**over))
    assert "\n" not in str(info.value)


def test_a_config_without_per_layer_config_reads_the_global_head_fields() -> None:
    cfg = _config()
    del cfg["per_layer_config"]
    c = Gemma4ForCausalLM.config_from_hf(
        {**cfg, "global_head_dim": 32, "num_global_key_value_heads": 1})
    assert c.layer_head_dims == [16, 32, 16, 32] and c.layer_kv_heads == [2, 1, 2, 1]
