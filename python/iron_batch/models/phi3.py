"""Phi-3, Phi-3.5 and Phi-4-mini: Llama's layer with q/k/v in one checkpoint tensor and
gate/up in another, partial rotary (``partial_rotary_factor``) and LongRoPE scaling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import GGUF_NAMES, HF_NAMES, DecoderModel

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata

_NAMES = {
    **HF_NAMES,
    "qkv": "model.layers.{i}.self_attn.qkv_proj",
    "gate_up": "model.layers.{i}.mlp.gate_up_proj",
}

#: llama.cpp writes the fused tensors as they are (``attn_qkv``; ``ffn_up`` holds gate and up),
#: without permuting q/k rows (it runs Phi-3 with half-split rope, as HF does).
_GGUF_NAMES = {
    **GGUF_NAMES,
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.self_attn.qkv_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.gate_up_proj.weight",
}


class Phi3ForCausalLM(DecoderModel):
    model_types = ("phi3",)
    architectures = ("Phi3ForCausalLM",)
    gguf_architecture = "phi3"
    hf_names = _NAMES
    gguf_names = _GGUF_NAMES

    #: The converter writes no scaling type (the factor tensors say LongRoPE); a file that
    #: names it says "longrope".
    gguf_rope_scaling_types = ("longrope",)

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        return ModelConfig.from_hf(cfg, tie_default=False, sliding_window=cfg.get("sliding_window"))

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        out = dict(cfg)
        head_dim = cfg["head_dim"]
        # Partial rotary: the rotated dimensions of each head.
        rope_dims = int(meta.get("rope.dimension_count", head_dim))
        if rope_dims != head_dim:
            partial = rope_dims / head_dim
            if not 0 < rope_dims < head_dim or int(head_dim * partial) != rope_dims:
                raise meta.refuse("rope.dimension_count", rope_dims,
                                  f"an even part of the head size, {head_dim}")
            out["partial_rotary_factor"] = partial
        # 0: no sliding window (Phi-4-mini); transformers slides every layer otherwise.
        window = int(meta.get("attention.sliding_window", 0) or 0)
        out["sliding_window"] = window or None
        long = meta.floats("rope_factors_long.weight")
        short = meta.floats("rope_factors_short.weight")
        if (long is None) != (short is None):
            missing = "rope_factors_short" if short is None else "rope_factors_long"
            raise ValueError(f"GGUF file has LongRoPE factors without {missing}.weight")
        if long is not None:
            original = int(meta.require("rope.scaling.original_context_length"))
            scaling: dict[str, Any] = {"rope_type": "longrope", "long_factor": long,
                                       "short_factor": short,
                                       "original_max_position_embeddings": original}
            attn_factor = meta.get("rope.scaling.attn_factor")
            if attn_factor is not None:
                scaling["attention_factor"] = float(attn_factor)
            out["rope_scaling"] = scaling
            out["original_max_position_embeddings"] = original
        elif meta.get("rope.scaling.type") == "longrope":
            raise ValueError(f"GGUF file says {meta.key('rope.scaling.type')} = 'longrope' but "
                             "has no rope_factors_long.weight / rope_factors_short.weight")
        return out
