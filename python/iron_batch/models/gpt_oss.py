"""gpt-oss: sliding-window and full attention layers alternating (the sliding ones on a
cache group of their own), q/k/v/o biases, YaRN rope, and per head an attention sink: a
learned logit in the softmax's denominator, in every layer. Every MLP is a mixture of
experts: a router with a bias whose top ``k`` logits are softmaxed, and experts with
biases and a clamped SwiGLU (``layers/moe.py``'s :func:`clamped_swiglu`).

The checkpoint stores each layer's experts as 3-D tensors (``gate_up_proj`` ``[E, H,
2I]``, its gate and up columns interleaved; ``down_proj`` ``[E, I, H]``), read here into
the stacked rows the MoE layer takes: each expert's gate rows, then its up rows. The
released checkpoints store them in MXFP4 instead (``gate_up_proj_blocks`` ``[E, 2I, H /
32, 16]`` uint8 codes and ``gate_up_proj_scales`` ``[E, 2I, H / 32]`` exponents, the same
for ``down_proj``): those bytes are kept as they are, their rows reordered the same way
(``layers/mxfp4.py``), whatever the compute dtype.

Decode steps run layer by layer (the one-call decode stack has no sinks); the attention
sinks run in the torch route and in the Rust paged kernels, whose int8 KV cache takes
none (``--kv-cache-dtype int8`` is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from iron_batch.layers import mxfp4
from iron_batch.layers.linear import Linear, Weight
from iron_batch.layers.moe import MoE, Router, stacked
from iron_batch.layers.weights import LoadContext, Part
from iron_batch.models.moe_decoder import MoEConfig, MoEDecoderModel
from iron_batch.models.partition import ShardPlan, TensorParallelError

#: A sparse layer's tensors (``{i}``: the layer).
_EXPERTS = "model.layers.{i}.mlp.experts."
_ROUTER = "model.layers.{i}.mlp.router."
_SINKS = "model.layers.{i}.self_attn.sinks"


@dataclass
class GptOssConfig(MoEConfig):
    #: The experts' clamped SwiGLU: the sigmoid's gain and the clamp.
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0


class GptOssForCausalLM(MoEDecoderModel):
    model_types = ("gpt_oss",)
    architectures = ("GptOssForCausalLM",)
    # The one-call decode stack has no attention sinks: decode steps run layer by layer.
    one_call_decode = False

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> GptOssConfig:
        n = cfg["num_hidden_layers"]
        kinds = cfg.get("layer_types") or [
            "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
        unknown = sorted(set(kinds) - {"full_attention", "sliding_attention"})
        if unknown:
            raise ValueError(f"unsupported layer_types {unknown} (supported: full_attention, "
                             "sliding_attention)")
        sliding = [k == "sliding_attention" for k in kinds]
        window = cfg.get("sliding_window") if any(sliding) else None
        bias = bool(cfg.get("attention_bias", True))
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts"))
        method = (cfg.get("quantization_config") or {}).get("quant_method", "mxfp4")
        if method != "mxfp4":
            raise ValueError(f"unsupported quantization_config quant_method {method!r} "
                             "(supported: mxfp4, the experts' blocks kept as they are)")
        return GptOssConfig.from_hf(
            cfg, tie_default=False, qkv_bias=bias, o_bias=bias, sliding_window=window,
            sliding_layers=sliding if window else None, num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            expert_intermediate_size=int(cfg["intermediate_size"]),
            swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
            swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))

    def _load(self, ctx: LoadContext, plan: ShardPlan | None) -> None:
        super()._load(ctx, plan)
        heads = None if plan is None else slice(plan.q_heads.start, plan.q_heads.stop)
        for i, layer in enumerate(self.layers):
            sinks = ctx.need_float(Part(_SINKS.format(i=i)))
            layer.sinks = (sinks if heads is None else sinks[heads]).contiguous().to(
                ctx.device)

    def set_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        if kv_cache_dtype == "int8":
            raise ValueError("--kv-cache-dtype int8 does not run gpt-oss: the int8 "
                             "attention kernel has no attention sinks")
        super().set_kv_cache_dtype(kv_cache_dtype)

    def _sparse_mlp(self, ctx: LoadContext, i: int, plan: ShardPlan | None) -> MoE | None:
        c = self.config
        assert isinstance(c, GptOssConfig)
        n = _EXPERTS.format(i=i)
        inter = c.expert_intermediate_size
        rows = self._rows(inter, plan) or slice(0, inter)
        gate_up_b = ctx.need(Part(n + "gate_up_proj_bias"))  # [E, 2I]
        gu_bias = torch.cat([gate_up_b[:, 0::2][:, rows], gate_up_b[:, 1::2][:, rows]],
                            dim=1).reshape(-1)
        down_b = ctx.need(Part(n + "down_proj_bias"))  # [E, H]
        if plan is not None and plan.rank != 0:
            down_b = torch.zeros_like(down_b)  # added once, to the sum of the ranks' parts
        if ctx.source.tensor(Part(n + "gate_up_proj_scales")) is not None:
            gu, dn = self._mxfp4_experts(ctx, n, rows)
        else:
            gu, dn = self._dense_experts(ctx, n, rows)
        kernels = ctx.kernels
        gate_up = stacked(Linear(gu, gu_bias.contiguous(), kernels=kernels),
                          c.num_experts, kernels, biased=True)
        down = stacked(Linear(dn, down_b.reshape(-1).contiguous(), kernels=kernels),
                       c.num_experts, kernels, biased=True)
        r = _ROUTER.format(i=i)
        router = Router(ctx.need(Part(r + "weight")), c.top_k, renormalize=False,
                        bias=ctx.need(Part(r + "bias")), softmax_after_topk=True)
        return MoE(router, gate_up, down, c.hidden_act,
                   swiglu_limits=(c.swiglu_alpha, c.swiglu_limit))

    def _dense_experts(self, ctx: LoadContext, n: str, rows: slice) -> tuple[Weight, Weight]:
        """The float experts as stacked ``[E * 2I', H]`` and ``[E * H, I']`` matrices."""
        gate_up = ctx.need(Part(n + "gate_up_proj"))  # [E, H, 2I], gate/up interleaved
        gate, up = gate_up[..., 0::2][..., rows], gate_up[..., 1::2][..., rows]
        gu = torch.cat([gate, up], dim=2).transpose(1, 2).reshape(-1, gate_up.shape[1])
        down = ctx.need(Part(n + "down_proj"))[:, rows]  # [E, I', H]
        dn = down.transpose(1, 2).reshape(-1, rows.stop - rows.start)
        return gu.contiguous(), dn.contiguous()

    def _mxfp4_experts(self, ctx: LoadContext, n: str, rows: slice) -> tuple[Weight, Weight]:
        """The MXFP4 experts' bytes, their rows in the same stacked order."""
        def read(name: str) -> torch.Tensor:
            t = ctx.source.tensor(Part(n + name))
            if t is None:
                raise ValueError(f"checkpoint is missing tensor {n + name!r}")
            return t

        codes, exps = read("gate_up_proj_blocks"), read("gate_up_proj_scales")
        experts, width, groups = exps.shape  # [E, 2I, H / 32]
        codes = codes.reshape(experts, width, groups * mxfp4.BLOCK // 2)
        gu_codes = torch.cat([codes[:, 0::2][:, rows], codes[:, 1::2][:, rows]], dim=1)
        gu_exps = torch.cat([exps[:, 0::2][:, rows], exps[:, 1::2][:, rows]], dim=1)
        gu = mxfp4.weight(gu_codes.reshape(-1, groups * mxfp4.BLOCK // 2),
                          gu_exps.reshape(-1, groups))
        codes, exps = read("down_proj_blocks"), read("down_proj_scales")  # [E, H, I/32, 16]
        if rows.start % mxfp4.BLOCK or rows.stop % mxfp4.BLOCK and rows.stop != width // 2:
            raise TensorParallelError(f"cannot split MXFP4 experts at rows {rows.start}.."
                                      f"{rows.stop}: not on {mxfp4.BLOCK}-weight blocks")
        part = slice(rows.start // mxfp4.BLOCK, -(-rows.stop // mxfp4.BLOCK))
        dn_exps = exps[:, :, part]
        dn_codes = codes.reshape(*exps.shape, -1)[:, :, part]
        dn = mxfp4.weight(dn_codes.reshape(-1, dn_exps.shape[2] * mxfp4.BLOCK // 2),
                          dn_exps.reshape(-1, dn_exps.shape[2]))
        return gu, dn
