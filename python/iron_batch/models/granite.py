"""Granite 3: Llama's layer with four multipliers: on the embeddings, the attention scores
(instead of 1/sqrt(head_dim)), each sublayer's output before the residual, and the logits
(divided)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata


class GraniteForCausalLM(DecoderModel):
    model_types = ("granite",)
    architectures = ("GraniteForCausalLM",)
    gguf_architecture = "granite"
    #: llama.cpp's converter handles Granite as Llama: q/k rows interleaved for its rope.
    gguf_permutes_qk = True

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

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # The converter renames the multipliers to *_scale keys (written where nonzero).
        # llama.cpp rotates Granite's q/k only while rope.scaling.finetuned holds (its
        # default): a file that turns it off has no rotary, which is not run here.
        if meta.get("rope.scaling.finetuned", True) is False:
            raise meta.refuse("rope.scaling.finetuned", False, "true")
        return {
            **cfg,
            "attention_multiplier": float(meta.get("attention.scale", 1.0)),
            "embedding_multiplier": float(meta.get("embedding_scale", 1.0)),
            "residual_multiplier": float(meta.get("residual_scale", 1.0)),
            "logits_scaling": float(meta.get("logit_scale", 1.0)),
        }
