"""OLMoE: Llama's pre-norm layer with q/k RMSNorms over the whole q and k projections (as
OLMo 2's) and a softmax router over ``num_experts`` experts in every layer, renormalised
when ``norm_topk_prob``. ``clip_qkv`` is refused."""

from __future__ import annotations

from typing import Any

from iron_batch.models.moe_decoder import MoEConfig, MoEDecoderModel


class OlmoeForCausalLM(MoEDecoderModel):
    model_types = ("olmoe",)
    architectures = ("OlmoeForCausalLM",)

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> MoEConfig:
        if cfg.get("clip_qkv") is not None:
            raise ValueError(f"unsupported clip_qkv {cfg['clip_qkv']} (supported: none)")
        bias = bool(cfg.get("attention_bias", False))
        return MoEConfig.from_hf(
            cfg, tie_default=False, qkv_bias=bias, o_bias=bias, qk_norm="projection",
            num_experts=int(cfg.get("num_experts") or cfg.get("num_local_experts")),
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)))
