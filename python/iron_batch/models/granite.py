"""Granite 3: Llama's layer with four multipliers: on the embeddings, the attention scores
(instead of 1/sqrt(head_dim)), each sublayer's output before the residual, and the logits
(divided)."""

from __future__ import annotations

from typing import Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel


class GraniteForCausalLM(DecoderModel):
    model_types = ("granite",)
    architectures = ("GraniteForCausalLM",)
    gguf_architecture = "granite"

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig.from_hf(
            cfg, tie_default=False, qkv_bias=bias, o_bias=bias,
            attention_scale=float(cfg.get("attention_multiplier", 1.0)),
            embedding_scale=float(cfg.get("embedding_multiplier", 1.0)),
            residual_scale=float(cfg.get("residual_multiplier", 1.0)),
            logits_divisor=float(cfg.get("logits_scaling", 1.0)),
        )
