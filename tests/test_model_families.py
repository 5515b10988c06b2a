"""What the families beyond Llama add, checked where the shared family tests
(test_torch_model.py, test_overlap.py, test_tensor_parallel.py, ...) do not look: Gemma's
sliding layers on their own bounded cache group, LongRoPE's long factors, and the config
features that are refused at load rather than run wrongly."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from iron_batch import CacheGroup, Scheduler
from iron_batch.backends.build import scheduler_config
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.models.registry import SUPPORTED_MODEL_TYPES
from tiny_models import (
    FAMILIES,
    backend,
    checkpoint,
    hf_greedy,
    random_prompts,
    reference_model,
    run_with_config,
)

BS = 4


# ---------------------------------------------------------------- sliding layers, own group


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_schedules_a_full_and_a_sliding_group(name: str) -> None:
    window = FAMILIES[name][1]["sliding_window"]
    cfg = scheduler_config(backend(name))
    assert [(g.kind, g.window) for g in cfg.cache_groups] == [("full", None),
                                                              ("sliding", window)]


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_sliding_layers_release_blocks_and_stay_exact(name: str) -> None:
    window = FAMILIES[name][1]["sliding_window"]
    be = backend(name, total_kv_blocks=256, kv_block_size=BS)
    prompts = random_prompts(70, [45, 30, 7, 52])
    cfg = scheduler_config(be, max_batch_tokens=16)
    peaks: list[tuple[int, int]] = []

    def on_step(s: Scheduler) -> None:
        full, sliding = s.group_stats()
        peaks.append((full["used"], sliding["used"]))

    outs, s = run_with_config(be, cfg, prompts, 40, on_step)
    assert outs == [hf_greedy(name, p, 40) for p in prompts]
    # Each sequence's sliding blocks: its window and a chunk of 16, plus one partly
    # filled block at each end; the full group keeps every token (92 of the longest).
    per_seq = -(-(window - 1 + 16) // BS) + 1
    assert max(p[1] for p in peaks) <= 4 * per_seq
    assert max(p[0] for p in peaks) >= -(-(52 + 39) // BS)
    assert s.stats()["sliding_blocks_released"] > 0
    assert [g["used"] for g in s.group_stats()] == [0, 0]


def test_gemma_stays_exact_when_the_sliding_pool_forces_preemption() -> None:
    name = "gemma3"
    window = FAMILIES[name][1]["sliding_window"]
    be = backend(name, total_kv_blocks=256, kv_block_size=BS)
    prefix = random_prompts(71, [29])[0]
    prompts = [prefix + tail for tail in random_prompts(72, [3, 9, 1, 5, 12, 2])]
    cfg = scheduler_config(be, max_batch_tokens=16)
    # Plenty of full blocks, few sliding ones: the sliding group is what runs out.
    cfg.cache_groups = [CacheGroup("full", 256), CacheGroup("sliding", 24, window=window)]
    outs, s = run_with_config(be, cfg, prompts, 30)
    assert outs == [hf_greedy(name, p, 30) for p in prompts]
    stats = s.stats()
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert [g["used"] for g in s.group_stats()] == [0, 0]


def test_a_memory_budget_is_split_between_the_groups_not_spent_twice() -> None:
    be = TorchBackend.from_model(str(checkpoint("gemma2")), device="cpu", dtype="float32",
                                 kv_block_size=BS, kv_cache_memory_gb=0.01)
    full, sliding = be.cache_groups
    per_token = be.model.kv_bytes_per_token()
    spent = (full.size * per_token[0] + sliding.size * per_token[1]) * BS
    assert 0.9 * 0.01 * 2**30 <= spent <= 0.01 * 2**30
    # As many sequences of 512 tokens (the tiny model's context) in each group: a decoding
    # sequence holds 128 full blocks and 7-8 sliding ones (its window of 24 and a block).
    assert 12 * sliding.size <= full.size <= 20 * sliding.size
    assert [t.shape[1] for t in be.model.kv_caches] == [sliding.size, full.size]


# ---------------------------------------------------------------- LongRoPE


def test_longrope_uses_the_long_factors_past_the_original_context() -> None:
    """The model's rotary table against transformers' own Phi-3 rotary module: short factors
    below ``original_max_position_embeddings``, long ones from there on (transformers picks
    one set per forward call, by its longest position: each call below stays on one side)."""
    model = reference_model("phi3")
    be = backend("phi3")
    rotary = be.model.rotaries[0]
    original = FAMILIES["phi3"][1]["original_max_position_embeddings"]
    for positions in (torch.arange(0, 40), torch.arange(original, original + 40)):
        x = torch.zeros(1, len(positions), 8)
        want_cos, want_sin = model.model.rotary_emb(x, positions[None, :])
        cos, sin = rotary.cos_sin(positions, int(positions.max()))
        torch.testing.assert_close(cos[:, 0], want_cos[0], rtol=0, atol=1e-6)
        torch.testing.assert_close(sin[:, 0], want_sin[0], rtol=0, atol=1e-6)
    short, _ = rotary.cos_sin(torch.tensor([original - 1]), original)
    long, _ = rotary.cos_sin(torch.tensor([original]), original)
    assert not torch.allclose(short, long, atol=0.05)  # the factors really differ


def test_partial_rotary_leaves_the_tail_of_each_head_alone() -> None:
    be = backend("phi3")
    head_dim = be.model.config.head_dim
    assert [layer.rotary_dim for layer in be.model.layers] == [head_dim * 3 // 4] * 2


def test_smollm3_nope_layer_has_no_rotary() -> None:
    be = backend("smollm3")
    assert [layer.rotary_dim for layer in be.model.layers] == [be.model.config.head_dim, 0]


# ---------------------------------------------------------------- refused at load


def _edited(tmp_path: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> str:
    folder = tmp_path / name
    shutil.copytree(checkpoint(name), folder)
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


def _load(path: str) -> TorchBackend:
    return TorchBackend.from_model(path, device="cpu", dtype="float32", total_kv_blocks=8)


def test_an_unknown_model_type_names_every_supported_one(tmp_path: Path) -> None:
    path = _edited(tmp_path, "olmo2", lambda c: c.update(model_type="olmo_hybrid"))
    with pytest.raises(ValueError) as err:
        _load(path)
    message = str(err.value)
    assert "\n" not in message and "olmo_hybrid" in message
    for family in ("gemma2", "gemma3_text", "phi3", "olmo2", "granite", "smollm3"):
        assert family in SUPPORTED_MODEL_TYPES and family in message


@pytest.mark.parametrize(("name", "edit", "named"), [
    ("granite", lambda c: c.update(hidden_act="relu"), "relu"),
    ("gemma2", lambda c: c.update(hidden_activation="gelu_new"), "gelu_new"),
    ("phi3", lambda c: c["rope_parameters"].update(rope_type="dynamic"), "dynamic"),
    ("phi3", lambda c: c["rope_parameters"].update(rope_type="yarn"), "yarn .*factor"),
    ("gemma3", lambda c: c.update(layer_types=["chunked_attention", "full_attention"]),
     "chunked_attention"),
    ("gemma3", lambda c: c.update(use_bidirectional_attention=True),
     "use_bidirectional_attention"),
    ("phi3", lambda c: c["rope_parameters"].update(partial_rotary_factor=0.3125),
     "partial_rotary_factor"),
])
def test_an_unimplemented_config_feature_is_refused_by_name(
    tmp_path: Path, name: str, edit: Callable[[dict[str, Any]], None], named: str
) -> None:
    path = _edited(tmp_path, name, edit)
    with pytest.raises(ValueError, match=named):
        _load(path)


def test_gemma3_inside_a_multimodal_checkpoint_serves_its_text_model(tmp_path: Path) -> None:
    """A ``gemma3`` (image and text) checkpoint: the text config nested, the text tensors
    under ``model.language_model``; the same tokens as the text-only checkpoint."""
    from safetensors.torch import load_file, save_file

    text = checkpoint("gemma3")
    folder = tmp_path / "gemma3-mm"
    folder.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(text / f, folder / f)
    cfg = json.loads((text / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({
        "model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": cfg, "vision_config": {"model_type": "siglip_vision_model"},
    }))
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(str(text / "model.safetensors")).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    prompts = random_prompts(73, [11, 26])
    from tiny_models import run_scheduler

    mm = TorchBackend.from_model(str(folder), device="cpu", dtype="float32",
                                 total_kv_blocks=64, kv_block_size=BS)
    outs, _ = run_scheduler(mm, prompts, 12)
    assert outs == [hf_greedy("gemma3", p, 12) for p in prompts]

