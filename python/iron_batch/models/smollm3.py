"""SmolLM3: Llama's layer, with every fourth layer (as ``no_rope_layers`` says) attending
without rotary positions (NoPE), and optional sliding-window layers."""

from __future__ import annotations

from typing import Any

from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel
from iron_batch.models.gemma2 import sliding_layers


class SmolLM3ForCausalLM(DecoderModel):
    model_types = ("smollm3",)
    architectures = ("SmolLM3ForCausalLM",)
    gguf_architecture = "smollm3"

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
