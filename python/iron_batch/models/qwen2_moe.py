"""Qwen2-MoE: Qwen2's attention (q/k/v bias), a softmax router, and a shared expert every
token runs, its output scaled by ``sigmoid(shared_expert_gate(x))`` and added to the
routed experts'. Sliding layers where ``layer_types`` says so."""

from __future__ import annotations

from typing import Any

from iron_batch.models.moe_decoder import MoEConfig, MoEDecoderModel
from iron_batch.models.qwen3_moe import moe_settings


class Qwen2MoeForCausalLM(MoEDecoderModel):
    model_types = ("qwen2_moe",)
    architectures = ("Qwen2MoeForCausalLM",)

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> MoEConfig:
        n = cfg["num_hidden_layers"]
        kinds = cfg.get("layer_types") or ["full_attention"] * n
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown} (supported: full_attention, "
                             "sliding_attention)")
        sliding = [k == "sliding_attention" for k in kinds]
        window = cfg.get("sliding_window") if any(sliding) else None
        shared = cfg.get("shared_expert_intermediate_size") or None
        return MoEConfig.from_hf(
            cfg, tie_default=False, qkv_bias=bool(cfg.get("qkv_bias", True)),
            sliding_window=window, sliding_layers=sliding if window else None,
            shared_intermediate_size=shared, **moe_settings(cfg))
