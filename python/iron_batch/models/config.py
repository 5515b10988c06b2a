"""Architecture settings of a decoder checkpoint, read from HF config.json (or a GGUF file's
metadata turned into one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: Gated MLP activations the layers implement (``layers/activation.py`` holds the
#: functions; named here so that reading a config needs no torch).
GATED_ACTIVATION_NAMES = ("silu", "gelu_pytorch_tanh", "gelu_tanh")


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
    #: RMSNorm of q and k before rope: None, "head" (each head by one weight: Qwen3,
    #: Gemma 3) or "projection" (the whole q and k projections: OLMo 2).
    qk_norm: str | None = None
    #: Keys further back than this are not attended (Mistral; Gemma's sliding layers),
    #: None = full attention.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    #: The MLP's gated activation, by the checkpoint's name (``hidden_act``).
    hidden_act: str = "silu"
    #: Per layer, whether it attends over ``sliding_window`` only (None: every layer does
    #: when ``sliding_window`` is set, as in Mistral).
    sliding_layers: list[bool] | None = None
    #: Rotated leading dimensions of each head (partial rotary; None: all of them).
    rotary_dim: int | None = None
    #: Rope base and scaling of the sliding layers when they differ from the global
    #: layers' (Gemma 3's local base frequency).
    local_rope: tuple[float, dict[str, Any]] | None = None
    #: Per layer, whether it rotates q and k at all (SmolLM3's NoPE layers; None: all do).
    rope_layers: list[bool] | None = None
    #: Where each layer's RMSNorms sit: "pre" (before attention and before the MLP:
    #: Llama), "sandwich" (before and after both: Gemma) or "post" (after both: OLMo 2).
    norm_layout: str = "pre"
    #: Checkpoint norm weights are stored as ``w - 1`` (Gemma multiplies by ``1 + w``).
    norm_weight_offset: float = 0.0
    #: The attention's score scale (None: ``head_dim ** -0.5``).
    attention_scale: float | None = None
    #: Tanh soft-capping of attention scores and of the final logits (Gemma 2).
    attn_softcap: float | None = None
    final_softcap: float | None = None
    #: The token embeddings are multiplied by this (Gemma: sqrt(hidden), rounded to the
    #: compute dtype; Granite: embedding_multiplier).
    embedding_scale: float = 1.0
    #: Gemma rounds the embedding scale to the compute dtype before multiplying.
    embedding_scale_in_dtype: bool = False
    #: Attention and MLP outputs are multiplied by this before joining the residual
    #: (Granite's residual_multiplier).
    residual_scale: float = 1.0
    #: Logits are divided by this (Granite's logits_scaling).
    logits_divisor: float = 1.0

    def layer_window(self, i: int) -> int | None:
        """How far back layer ``i`` attends (None: every position)."""
        if self.sliding_window is None:
            return None
        if self.sliding_layers is None or self.sliding_layers[i]:
            return self.sliding_window
        return None

    def layer_rotary_dim(self, i: int) -> int:
        """Rotated dimensions of each head in layer ``i`` (0: no rotary)."""
        if self.rope_layers is not None and not self.rope_layers[i]:
            return 0
        return self.rotary_dim or self.head_dim

    @classmethod
    def from_hf(
        cls,
        cfg: dict[str, Any],
        *,
        tie_default: bool,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: str | None = None,
        sliding_window: int | None = None,
        **architecture: Any,
    ) -> ModelConfig:
        """The settings every decoder family reads the same way from an HF config; the
        family (``models/<family>.py``) says what its architecture adds (``architecture``:
        further fields of this class). Features this implementation does not run are
        refused by name."""
        act = cfg.get("hidden_act", "silu")
        if "hidden_act" in architecture:
            act = architecture.pop("hidden_act")
        if act not in GATED_ACTIVATION_NAMES:
            raise ValueError(f"unsupported hidden_act {act!r} (supported: "
                             f"{', '.join(GATED_ACTIVATION_NAMES)})")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        theta, scaling = rope_settings(cfg)
        partial = float(scaling.pop("partial_rotary_factor",
                                    cfg.get("partial_rotary_factor", 1.0)) or 1.0)
        rotary_dim = None
        if partial != 1.0:
            rotary_dim = int(head_dim * partial)
            if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
                raise ValueError(f"unsupported partial_rotary_factor {partial} "
                                 f"(rotates {rotary_dim} of {head_dim} dimensions)")
        if scaling.get("rope_type") == "longrope":
            scaling.setdefault("original_max_position_embeddings",
                               cfg.get("original_max_position_embeddings"))
            scaling.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
        return cls(
            model_type=cfg.get("model_type", ""),
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
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
            hidden_act=act,
            rotary_dim=rotary_dim,
            **architecture,
        )


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def rope_settings(cfg: dict[str, Any]) -> tuple[float, dict[str, Any]]:
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
