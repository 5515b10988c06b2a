"""Qwen3: per-head RMSNorms on q and k before the rotation; biases as attention_bias says."""

from __future__ import annotations

from typing import Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel


class Qwen3ForCausalLM(DecoderModel):
    model_types = ("qwen3",)
    architectures = ("Qwen3ForCausalLM",)
    gguf_architecture = "qwen3"

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig.from_hf(cfg, tie_default=True, qkv_bias=bias, o_bias=bias,
                                   qk_norm="head")
