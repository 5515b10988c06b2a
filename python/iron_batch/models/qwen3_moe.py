"""Qwen3-MoE: Qwen3's attention (per-head q/k norms), a softmax router over ``num_experts``
experts taking ``num_experts_per_tok``, renormalised when ``norm_topk_prob``; no shared
expert; ``mlp_only_layers`` and ``decoder_sparse_step`` may keep some layers dense."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iron_batch.models.decoder import GGUF_NAMES
from iron_batch.models.moe_decoder import (
    MOE_NAMES,
    MoEConfig,
    MoEDecoderModel,
    gguf_expert_config,
    gguf_moe_names,
    sparse_layers,
)

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata


def moe_settings(cfg: dict[str, Any]) -> dict[str, Any]:
    """The expert settings of a Qwen-style MoE config (``num_experts``, renamed
    ``num_local_experts`` by transformers 5)."""
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
    return dict(
        num_experts=experts,
        top_k=int(cfg["num_experts_per_tok"]),
        expert_intermediate_size=int(cfg["moe_intermediate_size"]),
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
        moe_layers=sparse_layers(cfg, experts),
    )


class Qwen3MoeForCausalLM(MoEDecoderModel):
    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    gguf_architecture = "qwen3moe"
    gguf_names = {**GGUF_NAMES, **gguf_moe_names(MOE_NAMES)}

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> MoEConfig:
        bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
        return MoEConfig.from_hf(cfg, tie_default=False, qkv_bias=bias, o_bias=bias,
                                 qk_norm="head", sliding_window=window, **moe_settings(cfg))

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # llama.cpp's qwen3moe graph renormalises the chosen weights (every Qwen3-MoE
        # checkpoint sets norm_topk_prob) and makes every layer sparse.
        return gguf_expert_config(cfg, meta, renormalize=True,
                                  expert_size=cfg["intermediate_size"] // int(
                                      meta.require("expert_used_count")))
