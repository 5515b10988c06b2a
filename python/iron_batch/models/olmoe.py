"""OLMoE: Llama's pre-norm layer with q/k RMSNorms over the whole q and k projections (as
OLMo 2's) and a softmax router over ``num_experts`` experts in every layer, renormalised
when ``norm_topk_prob``. ``clip_qkv`` is refused."""

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

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata


class OlmoeForCausalLM(MoEDecoderModel):
    model_types = ("olmoe",)
    architectures = ("OlmoeForCausalLM",)
    gguf_architecture = "olmoe"
    gguf_names = {**GGUF_NAMES, **gguf_moe_names(MOE_NAMES)}

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> MoEConfig:
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"unsupported clip_qkv {cfg['clip_qkv']} (supported: none)")
        bias = bool(cfg.get("attention_bias", False))
        return MoEConfig.from_hf(
            cfg, tie_default=False, qkv_bias=bias, o_bias=bias, qk_norm="projection",
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts")),
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=int(cfg.get("moe_intermediate_size")
                                         or cfg["intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # llama.cpp's olmoe graph does not renormalise the chosen weights (OLMoE's
        # norm_topk_prob is false).
        return gguf_expert_config(cfg, meta, renormalize=False,
                                  expert_size=cfg["intermediate_size"])
