"""Mixtral: Mistral's layer (a sliding window where the config sets one) with a softmax
router picking ``num_experts_per_tok`` of ``num_local_experts`` experts, their weights always
renormalised and kept in float32; the experts' projections are ``w1`` (gate), ``w3`` (up)
and ``w2`` (down) under ``block_sparse_moe``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iron_batch.models.decoder import GGUF_NAMES
from iron_batch.models.moe_decoder import (
    MOE_NAMES,
    MoEConfig,
    MoEDecoderModel,
    gguf_expert_config,
    gguf_moe_names,
)

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata

_MOE_NAMES = {
    **MOE_NAMES,
    "router": "model.layers.{i}.block_sparse_moe.gate.weight",
    "expert_gate": "model.layers.{i}.block_sparse_moe.experts.{e}.w1.weight",
    "expert_up": "model.layers.{i}.block_sparse_moe.experts.{e}.w3.weight",
    "expert_down": "model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight",
}


class MixtralForCausalLM(MoEDecoderModel):
    model_types = ("mixtral",)
    architectures = ("MixtralForCausalLM",)
    moe_names = _MOE_NAMES
    # llama.cpp writes Mixtral as a ``llama`` file with experts (q/k rows permuted).
    gguf_architecture = "llama"
    gguf_shares_architecture = True
    gguf_permutes_qk = True
    gguf_names = {**GGUF_NAMES, **gguf_moe_names(_MOE_NAMES)}

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> MoEConfig:
        return MoEConfig.from_hf(
            cfg, tie_default=False, sliding_window=cfg.get("sliding_window"),
            num_experts=int(cfg.get("num_local_experts") or cfg.get("num_experts")),
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=int(cfg["intermediate_size"]),
            norm_topk_prob=True, routing_weights_in_float=True)

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # llama.cpp's llama graph with experts: softmax, the chosen weights renormalised;
        # its experts have feed_forward_length rows. No key carries a sliding window.
        if "rope_freqs.weight" in meta.tensors:
            raise ValueError("unsupported GGUF tensor rope_freqs.weight (per-frequency rope "
                             "factors) in a llama file with experts")
        out = gguf_expert_config(cfg, meta, renormalize=True,
                                 expert_size=cfg["intermediate_size"])
        return {**out, "num_local_experts": out["num_experts"]}
