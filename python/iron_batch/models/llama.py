"""Llama (and checkpoints in its layout: SmolLM2, Llama 3.x, TinyLlama, ...)."""

from __future__ import annotations

from typing import Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel


class LlamaForCausalLM(DecoderModel):
    model_types = ("llama",)
    architectures = ("LlamaForCausalLM",)
    gguf_architecture = "llama"
    gguf_permutes_qk = True

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig.from_hf(cfg, tie_default=False, qkv_bias=bias, o_bias=bias)
