"""Gemma 2: GeGLU MLP, RMSNorms before and after both sublayers with ``(1 + w)`` weights,
embeddings scaled by sqrt(hidden), ``query_pre_attn_scalar``, soft-capped attention scores
and logits, sliding and global layers alternating."""

from __future__ import annotations

from typing import Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import GGUF_NAMES, DecoderModel


def sliding_layers(cfg: dict[str, Any], every: int) -> list[bool]:
    """Which layers slide: ``layer_types`` where the config lists them, else all but every
    ``every``-th (transformers' default pattern for the family)."""
    types = cfg.get("layer_types")
    n = cfg["num_hidden_layers"]
    if types is None:
        return [bool((i + 1) % every) for i in range(n)]
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != n:
        raise ValueError(f"unsupported layer_types {unknown or types!r}")
    return [t == "sliding_attention" for t in types]


def gemma_settings(cfg: dict[str, Any], every: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share, as ``ModelConfig`` fields."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("unsupported use_bidirectional_attention (an encoder, not a decoder)")
    bias = bool(cfg.get("attention_bias", False))
    return dict(
        tie_default=True,
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=cfg.get("sliding_window"),
        hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh",
        sliding_layers=sliding_layers(cfg, every),
        norm_layout="sandwich",
        norm_weight_offset=1.0,
        attention_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=cfg.get("attn_logit_softcapping"),
        final_softcap=cfg.get("final_logit_softcapping"),
        embedding_scale=float(cfg["hidden_size"]) ** 0.5,
        embedding_scale_in_dtype=True,
    )


#: llama.cpp's names for the norms Gemma adds (its converter stores ``1 + w`` already).
GEMMA_GGUF_NAMES = {
    **GGUF_NAMES,
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}


class Gemma2ForCausalLM(DecoderModel):
    model_types = ("gemma2",)
    architectures = ("Gemma2ForCausalLM",)
    gguf_architecture = "gemma2"
    gguf_names = GEMMA_GGUF_NAMES
    gguf_norm_offset_applied = True

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        return ModelConfig.from_hf(cfg, **gemma_settings(cfg, every=2))
