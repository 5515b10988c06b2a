"""Architecture settings of a decoder checkpoint, read from HF config.json (or a GGUF file's
metadata turned into one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_theta: float = 10000.0
    #: The rope_scaling / rope_parameters dict minus theta; {"rope_type": "default"} if none.
    rope_scaling: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    #: Bias on q, k and v projections (Qwen2; Llama with attention_bias).
    qkv_bias: bool = False
    #: Bias on the output projection (Llama with attention_bias only).
    o_bias: bool = False
    mlp_bias: bool = False
    #: Per-head RMSNorm on q and k before rope (Qwen3).
    qk_norm: bool = False
    #: Keys further back than this are not attended (Mistral), None = full attention.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(
        cls,
        cfg: dict[str, Any],
        *,
        tie_default: bool,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool = False,
        sliding_window: int | None = None,
    ) -> ModelConfig:
        """The settings every decoder family reads the same way from an HF config; the
        family (``models/<family>.py``) says what its architecture adds. Features this
        implementation does not run are refused by name."""
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} (only silu)")
        if cfg.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError("unsupported partial_rotary_factor != 1")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        theta, scaling = _rope_settings(cfg)
        return cls(
            model_type=cfg.get("model_type", ""),
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or hidden // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            # transformers' config classes default tie_word_embeddings per family.
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", tie_default)),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=qk_norm,
            sliding_window=sliding_window,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_as_id_list(cfg.get("eos_token_id")),
        )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """Return (theta, scaling dict) from either transformers 4.x or 5.x config layouts.

    4.x: top-level ``rope_theta`` plus optional ``rope_scaling`` (``type`` or ``rope_type``).
    5.x: ``rope_parameters`` holding ``rope_theta`` and ``rope_type`` together.
    """
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    merged["rope_type"] = rope_type
    return theta, merged
