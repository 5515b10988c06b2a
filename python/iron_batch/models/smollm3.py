"""SmolLM3: Llama's layer, with every fourth layer (as ``no_rope_layers`` says) attending
without rotary positions (NoPE), and optional sliding-window layers."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel
from iron_batch.models.gemma2 import sliding_layers

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata

#: llama.cpp's ``n_no_rope_layer_step`` for SmolLM3 (a constant of its loader, not a key).
_GGUF_NO_ROPE_EVERY = 4


class SmolLM3ForCausalLM(DecoderModel):
    model_types = ("smollm3",)
    architectures = ("SmolLM3ForCausalLM",)
    gguf_architecture = "smollm3"
    #: llama.cpp's converter handles SmolLM3 as Llama: q/k rows interleaved for its rope.
    gguf_permutes_qk = True

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        n = cfg["num_hidden_layers"]
        rope = cfg.get("no_rope_layers")
        if rope is None:  # 1 = the layer rotates (the config's own odd naming)
            every = int(cfg.get("no_rope_layer_interval", 4))
            rope = [int((i + 1) % every != 0) for i in range(n)]
        if len(rope) != n:
            raise ValueError(f"no_rope_layers has {len(rope)} entries for {n} layers")
        window, sliding = None, None
        if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
            window = cfg["sliding_window"]
            types = cfg.get("layer_types")
            sliding = (sliding_layers(cfg, 1) if types is not None
                       else [not r for r in rope])
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig.from_hf(cfg, tie_default=True, qkv_bias=bias, o_bias=bias,
                                   sliding_window=window, sliding_layers=sliding,
                                   rope_layers=[bool(r) for r in rope])

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        # No key says which layers skip the rotary: llama.cpp fixes it at every fourth
        # (layer i rotates unless (i + 1) % 4 == 0), as transformers' default interval. Nor
        # does it read a sliding window for SmolLM3.
        window = meta.get("attention.sliding_window")
        if window:
            raise meta.refuse("attention.sliding_window", window, "none (SmolLM3)")
        return {**cfg, "no_rope_layer_interval": _GGUF_NO_ROPE_EVERY}
