"""Qwen3.5 from llama.cpp's GGUF (``qwen35``, and ``qwen35moe`` with experts): the tensor
names its converter writes, the metadata keys it adds, and what it changes in the
linear-attention tensors, undone here.

The converter (``_LinearAttentionVReorderBase`` and ``Qwen3NextModel`` in llama.cpp's
``conversion/qwen.py``) stores ``-exp(A_log)`` (``ssm_a``), adds 1 to every RMSNorm weight
but the linear layers' gated norm, and, where a key head serves several value heads,
reorders the value heads from grouped by key head ``[k0v0, k0v1, .., k1v0, ..]`` to tiled
``[k0v0, k1v0, .., k0v1, ..]``: the V rows of ``in_proj_qkv`` and the V channels of the
convolution, the rows of ``in_proj_z``, ``in_proj_b`` and ``in_proj_a``, ``A_log``,
``dt_bias`` and the columns of ``out_proj``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from iron_batch.layers.weights import Part, WeightSource

if TYPE_CHECKING:
    from iron_batch.layers.quant import QuantWeight
    from iron_batch.loader.gguf import GGUFMetadata

GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_qkv.weight": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "blk.{i}.attn_gate.weight": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "blk.{i}.ssm_beta.weight": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "blk.{i}.ssm_alpha.weight": "model.layers.{i}.linear_attn.in_proj_a.weight",
    "blk.{i}.ssm_conv1d.weight": "model.layers.{i}.linear_attn.conv1d.weight",
    # -exp(A_log), under the HF name of A_log: the model reads it as the decay rate.
    "blk.{i}.ssm_a": "model.layers.{i}.linear_attn.A_log",
    "blk.{i}.ssm_dt.bias": "model.layers.{i}.linear_attn.dt_bias",
    "blk.{i}.ssm_norm.weight": "model.layers.{i}.linear_attn.norm.weight",
    "blk.{i}.ssm_out.weight": "model.layers.{i}.linear_attn.out_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


#: The dense MLP's tensors, which a ``qwen35moe`` file has as experts instead.
DENSE_MLP = ("blk.{i}.ffn_gate.weight", "blk.{i}.ffn_up.weight", "blk.{i}.ffn_down.weight")


def hf_config(cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
    """The Qwen3.5 keys of a ``qwen35`` or ``qwen35moe`` file, as HF config keys. The
    converter counts its multi-token-prediction layers (``nextn_predict_layers``, written
    after the model's own) in ``block_count``; they are not the model's and are not read."""
    layers = int(cfg["num_hidden_layers"]) - int(meta.get("nextn_predict_layers", 0) or 0)
    if layers < 1:
        raise meta.refuse("nextn_predict_layers", meta.get("nextn_predict_layers"),
                          "fewer than block_count")
    heads = int(meta.require("ssm.time_step_rank"))
    inner = int(meta.require("ssm.inner_size"))
    if inner % heads:
        raise meta.refuse("ssm.inner_size", inner, f"a multiple of {heads} value heads")
    head_dim = int(cfg["head_dim"])
    rope_dims = int(meta.get("rope.dimension_count", head_dim // 4))
    return {
        **cfg,
        "num_hidden_layers": layers,
        "linear_conv_kernel_dim": int(meta.require("ssm.conv_kernel")),
        "linear_key_head_dim": int(meta.require("ssm.state_size")),
        "linear_num_key_heads": int(meta.require("ssm.group_count")),
        "linear_num_value_heads": heads,
        "linear_value_head_dim": inner // heads,
        "full_attention_interval": int(meta.get("full_attention_interval", 4)),
        "partial_rotary_factor": rope_dims / head_dim,
    }


def _untile(t: torch.Tensor, dim: int, key_heads: int, per_key: int, width: int) -> torch.Tensor:
    """Value heads along ``dim`` from tiled back to grouped order."""
    shape = list(t.shape)
    t = t.reshape(*shape[:dim], per_key, key_heads, width, *shape[dim + 1:])
    return t.transpose(dim, dim + 1).reshape(shape)


class TiledValueHeads:
    """A GGUF source whose linear-attention tensors come back in HF's order (the other
    tensors pass through). Those tensors are read as floats: their quantized blocks are
    not kept (``--quantization gguf`` dequantizes them)."""

    is_gguf = True

    def __init__(self, source: WeightSource, *, key_heads: int, value_heads: int,
                 key_dim: int, value_dim: int) -> None:
        self.source = source
        self.key_heads, self.per_key = key_heads, value_heads // key_heads
        self.key_dim, self.value_dim = key_dim, value_dim

    def _reordered(self, name: str) -> bool:
        return self.per_key > 1 and ".linear_attn." in name and not name.endswith(
            "norm.weight")

    def tensor(self, part: Part) -> torch.Tensor | None:
        if not self._reordered(part.name):
            return self.source.tensor(part)
        # Reordered whole, then cut (a tensor-parallel rank's slice is in HF's order).
        t = self.source.tensor(Part(part.name))
        if t is None:
            return None
        t = self._grouped(part.name, t)
        if part.rows is not None:
            t = t[part.rows]
        if part.cols is not None:
            t = t[:, part.cols]
        return t.contiguous()

    def _grouped(self, name: str, t: torch.Tensor) -> torch.Tensor:
        nk, r, dv = self.key_heads, self.per_key, self.value_dim
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):
            qk = 2 * nk * self.key_dim
            return torch.cat([t[:qk], _untile(t[qk:], 0, nk, r, dv)])
        if name.endswith("in_proj_z.weight"):
            return _untile(t, 0, nk, r, dv)
        if name.endswith(("in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
            return _untile(t, 0, nk, r, 1)
        if name.endswith("out_proj.weight"):
            return _untile(t, 1, nk, r, dv)
        return t

    def quantized(self, part: Part) -> QuantWeight | None:
        if self._reordered(part.name):
            return None
        return self.source.quantized(part)
