"""Mistral: Llama's layer with a sliding attention window where the config sets one."""

from __future__ import annotations

from typing import Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel


class MistralForCausalLM(DecoderModel):
    model_types = ("mistral",)
    architectures = ("MistralForCausalLM",)

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        return ModelConfig.from_hf(cfg, tie_default=False, sliding_window=cfg.get("sliding_window"))
