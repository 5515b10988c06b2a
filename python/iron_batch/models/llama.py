"""Llama (and checkpoints in its layout: SmolLM2, Llama 3.x, TinyLlama, ...)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata


class LlamaForCausalLM(DecoderModel):
    model_types = ("llama",)
    architectures = ("LlamaForCausalLM",)
    gguf_architecture = "llama"
    gguf_permutes_qk = True

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig.from_hf(cfg, tie_default=False, qkv_bias=bias, o_bias=bias)

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # Llama 3.1's rope scaling reaches a GGUF file as one divisor per rotary frequency
        # (the converter's rope_freqs tensor), not as keys.
        factors = meta.floats("rope_freqs.weight")
        if factors is None:
            return cfg
        return {**cfg, "rope_scaling": {"rope_type": "freq_factors", "factors": factors}}
