"""Qwen3.5-MoE: Qwen3.5's hybrid layers (``models/qwen3_5.py``) with a mixture of experts as
every layer's MLP: a softmax router over ``num_experts`` experts taking
``num_experts_per_tok``, their weights always renormalised over the chosen ones, and a
shared expert every token runs, scaled by ``sigmoid(shared_expert_gate(x))``
(``models/moe_decoder.py``).

The released checkpoints store each layer's experts as transformers' fused tensors
(``experts.gate_up_proj``, ``experts.down_proj``); ``save_pretrained`` writes one tensor per
expert and projection. Both load, and so do llama.cpp's ``qwen35moe`` GGUF files (the
experts stacked per layer and projection, ``models/qwen3_5_gguf.py`` for the rest). Decode
steps of few rows run in the one-call hybrid stack, sparse MLPs included
(``layers/hybrid_stack.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from iron_batch.models import qwen3_5_gguf
from iron_batch.models.config import ModelConfig
from iron_batch.models.moe_decoder import (
    MOE_NAMES,
    MoEConfig,
    MoEDecoderModel,
    gguf_expert_config,
    gguf_moe_names,
)
from iron_batch.models.qwen3_5 import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5TextOfMultimodal,
    language_model_names,
)
from iron_batch.models.qwen3_moe import moe_settings

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata


@dataclass
class Qwen3_5MoeConfig(Qwen3_5Config, MoEConfig):
    pass


class Qwen3_5MoeForCausalLM(Qwen3_5ForCausalLM, MoEDecoderModel):
    model_types = ("qwen3_5_moe_text",)
    architectures = ("Qwen3_5MoeForCausalLM",)
    gguf_architecture = "qwen35moe"
    gguf_names = {**{k: v for k, v in qwen3_5_gguf.GGUF_NAMES.items()
                     if k not in qwen3_5_gguf.DENSE_MLP},
                  **gguf_moe_names(MOE_NAMES)}

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # llama.cpp's qwen35moe graph renormalises the chosen experts' weights, as every
        # Qwen3.5-MoE checkpoint does; the converter writes the expert sizes.
        experts = gguf_expert_config(cfg, meta, renormalize=True,
                                     expert_size=int(cfg["intermediate_size"]))
        return qwen3_5_gguf.hf_config(experts, meta)

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        # No dense MLP: its rows (what a tensor-parallel plan splits) are an expert's.
        moe = {**moe_settings(cfg), "norm_topk_prob": True, "moe_layers": None}
        dense = Qwen3_5ForCausalLM.config_from_hf(
            {**cfg, "intermediate_size": moe["expert_intermediate_size"]})
        shared = int(cfg.get("shared_expert_intermediate_size") or 0)
        if not shared:
            raise ValueError("unsupported shared_expert_intermediate_size 0 in Qwen3.5-MoE "
                             "(every checkpoint has a shared expert)")
        return Qwen3_5MoeConfig(**dense.__dict__, **moe, shared_intermediate_size=shared)


class Qwen3_5MoeTextOfMultimodal(Qwen3_5TextOfMultimodal, Qwen3_5MoeForCausalLM):
    """The text part of a ``qwen3_5_moe`` (image, video and text) checkpoint."""

    model_types = ("qwen3_5_moe",)
    architectures = ("Qwen3_5MoeForConditionalGeneration",)
    hf_names = Qwen3_5TextOfMultimodal.hf_names
    moe_names = language_model_names(MOE_NAMES)
    text_family = Qwen3_5MoeForCausalLM
