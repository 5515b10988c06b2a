"""OLMo 2: RMSNorms after attention and after the MLP (none before), and q/k norms over
the whole q and k projections."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import GGUF_NAMES, DecoderModel

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata

#: llama.cpp's OLMo 2 names: the norms after attention and the MLP, q/k norms over the whole
#: projections (``attn_q_norm``, ``attn_k_norm``: in ``GGUF_NAMES``).
_GGUF_NAMES = {
    **{k: v for k, v in GGUF_NAMES.items() if "attn_norm" not in k and "ffn_norm" not in k},
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}


class Olmo2ForCausalLM(DecoderModel):
    model_types = ("olmo2",)
    architectures = ("Olmo2ForCausalLM",)
    gguf_architecture = "olmo2"
    gguf_names = _GGUF_NAMES

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig.from_hf(cfg, tie_default=False, qkv_bias=bias, o_bias=bias,
                                   qk_norm="projection", norm_layout="post")

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # The converter writes the generic keys only (no q/k permutation: llama.cpp runs
        # OLMo 2 with half-split rope). A sliding window is OLMo 3's, not run here.
        window = meta.get("attention.sliding_window")
        if window:
            raise meta.refuse("attention.sliding_window", window, "none (OLMo 2)")
        return cfg
