"""Phi-3, Phi-3.5 and Phi-4-mini: Llama's layer with q/k/v in one checkpoint tensor and
gate/up in another, partial rotary (``partial_rotary_factor``) and LongRoPE scaling."""

from __future__ import annotations

from typing import Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import GGUF_NAMES, HF_NAMES, DecoderModel

_NAMES = {
    **HF_NAMES,
    "qkv": "model.layers.{i}.self_attn.qkv_proj",
    "gate_up": "model.layers.{i}.mlp.gate_up_proj",
}

#: llama.cpp writes the fused tensors as they are (``attn_qkv``; ``ffn_up`` holds gate and up).
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

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        return ModelConfig.from_hf(cfg, tie_default=False, sliding_window=cfg.get("sliding_window"))
