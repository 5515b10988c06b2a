"""Gemma 2: GeGLU MLP, RMSNorms before and after both sublayers with ``(1 + w)`` weights,
embeddings scaled by sqrt(hidden), ``query_pre_attn_scalar``, soft-capped attention scores
and logits, sliding and global layers alternating."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import GGUF_NAMES, DecoderModel

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata


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


def gguf_gemma_settings(cfg: dict[str, Any], meta: GGUFMetadata, *, pattern: int,
                        layers_27b: int, window: int | None) -> dict[str, Any]:
    """What Gemma 2 and 3 GGUF files say, as HF config keys, the way llama.cpp reads them.

    llama.cpp stores no query scale: it uses the head size, except in the 27B models (known
    by their layer count, ``layers_27b``) where it is hidden / heads, as their
    ``query_pre_attn_scalar``. Which layers slide is a fixed pattern (all but every
    ``pattern``-th; ``attention.sliding_window_pattern`` where a file writes one), over
    ``attention.sliding_window`` (``window`` when the file has none)."""
    n = cfg["num_hidden_layers"]
    if n == layers_27b:
        scalar = cfg["hidden_size"] // cfg["num_attention_heads"]
    else:
        scalar = cfg["head_dim"]
    given = meta.get("attention.sliding_window_pattern")
    if isinstance(given, list):
        if len(given) != n:
            raise meta.refuse("attention.sliding_window_pattern", given, f"{n} entries")
        sliding = [bool(x) for x in given]
    else:
        every = int(given) if given is not None else pattern
        sliding = [every == 0 or i % every < every - 1 for i in range(n)]
    window = meta.get("attention.sliding_window", window)
    if not window:
        sliding = [False] * n
    return {
        "query_pre_attn_scalar": scalar,
        "sliding_window": int(window) if window else None,
        "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
    }


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

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # llama.cpp: every other layer slides (4096 positions unless the file says), and
        # the soft caps default to 50 and 30 where the file has no key.
        return {
            **cfg,
            **gguf_gemma_settings(cfg, meta, pattern=2, layers_27b=46, window=4096),
            "attn_logit_softcapping": float(meta.get("attn_logit_softcapping", 50.0)),
            "final_logit_softcapping": float(meta.get("final_logit_softcapping", 30.0)),
        }
