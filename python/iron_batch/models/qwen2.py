"""Qwen2 and Qwen2.5: bias on q, k and v (always: the config has no flag for it)."""

from __future__ import annotations

from typing import Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel


class Qwen2ForCausalLM(DecoderModel):
    model_types = ("qwen2",)
    architectures = ("Qwen2ForCausalLM",)
    gguf_architecture = "qwen2"

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        if cfg.get("use_sliding_window"):
            raise ValueError("unsupported: qwen2 with use_sliding_window=true")
        return ModelConfig.from_hf(cfg, tie_default=True, qkv_bias=True)
