"""Gemma 3 (text): Gemma 2's layer with per-head q/k norms instead of soft-capping, five
sliding layers to each global one, and a rope base (and scaling) of their own for the
sliding layers. Also the text model inside a multimodal ``gemma3`` checkpoint."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iron_batch.models.config import ModelConfig, rope_settings
from iron_batch.models.decoder import HF_NAMES, DecoderModel
from iron_batch.models.gemma2 import GEMMA_GGUF_NAMES, gemma_settings, gguf_gemma_settings

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata


def _ropes(cfg: dict[str, Any]) -> tuple[dict[str, Any], tuple[float, dict[str, Any]]]:
    """The global layers' rope fields (as a config to read them from) and the sliding
    layers' (theta, scaling), from transformers 5's per-layer-type ``rope_parameters`` or
    4.x's ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq``."""
    params = cfg.get("rope_parameters") or {}
    if "full_attention" in params or "sliding_attention" in params:
        full = params.get("full_attention") or {"rope_type": "default"}
        local = params.get("sliding_attention") or {"rope_type": "default"}
        full = {"rope_theta": 1_000_000.0, **full}
        local = {"rope_theta": 10_000.0, **local}
        return ({"rope_parameters": full},
                rope_settings({"rope_parameters": local}))
    global_cfg = {"rope_theta": cfg.get("rope_theta", 1_000_000.0),
                  "rope_scaling": cfg.get("rope_scaling"), "rope_parameters": params or None}
    local_theta = float(cfg.get("rope_local_base_freq", 10_000.0))
    return global_cfg, (local_theta, {"rope_type": "default"})


class Gemma3ForCausalLM(DecoderModel):
    model_types = ("gemma3_text",)
    architectures = ("Gemma3ForCausalLM",)
    gguf_architecture = "gemma3"
    gguf_names = GEMMA_GGUF_NAMES
    gguf_norm_offset_applied = True

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        every = int(cfg.get("sliding_window_pattern") or 6)
        global_rope, local_rope = _ropes(cfg)
        plain = {k: v for k, v in cfg.items()
                 if k not in ("rope_parameters", "rope_scaling", "rope_theta")}
        return ModelConfig.from_hf({**plain, **global_rope}, qk_norm="head",
                                   local_rope=local_rope, **gemma_settings(cfg, every))

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # llama.cpp: five sliding layers to each global one; the file's rope base and
        # (linear) scaling are the global layers', the sliding ones rotate by base 10000
        # unscaled (``rope.freq_base_swa`` where a file writes one). No attention soft cap.
        if meta.get("attn_logit_softcapping") is not None:
            raise meta.refuse("attn_logit_softcapping", meta.get("attn_logit_softcapping"),
                              "none in Gemma 3")
        out = {
            **cfg,
            **gguf_gemma_settings(cfg, meta, pattern=6, layers_27b=62, window=None),
            "rope_local_base_freq": float(meta.get("rope.freq_base_swa", 10_000.0)),
        }
        final = meta.get("final_logit_softcapping")
        if final:
            out["final_logit_softcapping"] = float(final)
        return out


#: A multimodal Gemma 3 checkpoint's text model, by its tensor names (transformers 5).
_MULTIMODAL_NAMES = {k: v.replace("model.", "model.language_model.", 1)
                     for k, v in HF_NAMES.items()}


class Gemma3TextOfMultimodal(Gemma3ForCausalLM):
    """The text part of a ``gemma3`` (image and text) checkpoint: its ``text_config`` and
    its ``model.language_model.*`` tensors; the vision tower is not loaded."""

    model_types = ("gemma3",)
    architectures = ("Gemma3ForConditionalGeneration",)
    gguf_architecture = None
    hf_names = _MULTIMODAL_NAMES

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        text = dict(cfg.get("text_config") or {})
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
        for key in ("bos_token_id", "eos_token_id"):
            if key in cfg:
                text.setdefault(key, cfg[key])
        config = Gemma3ForCausalLM.config_from_hf({**text, "model_type": "gemma3_text"})
        config.model_type = "gemma3"
        return config
