"""Qwen2-MoE: Qwen2's attention (q/k/v bias), a softmax router, and a shared expert every
token runs, its output scaled by ``sigmoid(shared_expert_gate(x))`` and added to the
routed experts'. Sliding layers where ``layer_types`` says so."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iron_batch.models.decoder import GGUF_NAMES
from iron_batch.models.moe_decoder import (
    MOE_NAMES,
    MoEConfig,
    MoEDecoderModel,
    gguf_expert_config,
    gguf_moe_names,
)
from iron_batch.models.qwen3_moe import moe_settings

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata


class Qwen2MoeForCausalLM(MoEDecoderModel):
    model_types = ("qwen2_moe",)
    architectures = ("Qwen2MoeForCausalLM",)
    gguf_architecture = "qwen2moe"
    gguf_names = {**GGUF_NAMES, **gguf_moe_names(MOE_NAMES)}

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

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # llama.cpp's qwen2moe graph: chosen weights not renormalised, the shared expert
        # gated by a sigmoid; q/k/v biases come with the tensors.
        return {**gguf_expert_config(cfg, meta, renormalize=False,
                                   expert_size=cfg["intermediate_size"]), "qkv_bias": True}
