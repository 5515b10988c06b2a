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

llama.cpp's ``gpt-oss`` GGUF files load too (:data:`GGUF_NAMES`, :meth:`hf_config_from_gguf`).
Its converter (``GptOssModel``) splits each layer's experts into separate gate, up and down
tensors (``ffn_{gate,up,down}_exps``, gate and up de-interleaved, their biases likewise),
keeps MXFP4 experts in ggml's MXFP4 type (each 32 weights' exponent, then its codes with the
nibbles reordered: ``layers/mxfp4.py``'s :func:`~iron_batch.layers.mxfp4.from_gguf` puts them
back) and leaves q/k unpermuted (llama.cpp rotates gpt-oss as HF does, halves not pairs).
Float experts (a file converted from a bf16 checkpoint) are read as floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from iron_batch.layers import mxfp4
from iron_batch.layers.linear import Linear, Weight
from iron_batch.layers.moe import MoE, Router, stacked
from iron_batch.layers.weights import LoadContext, Part
from iron_batch.models.moe_decoder import MoEConfig, MoEDecoderModel
from iron_batch.models.partition import ShardPlan, TensorParallelError

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata

#: A sparse layer's tensors (``{i}``: the layer).
_EXPERTS = "model.layers.{i}.mlp.experts."
_ROUTER = "model.layers.{i}.mlp.router."
_SINKS = "model.layers.{i}.self_attn.sinks"

#: llama.cpp's names of a ``gpt-oss`` file's tensors -> the names the model reads. The
#: experts' take the names llama.cpp's converter gives them on the way (its tensor map's
#: ``mlp.experts.gate_proj`` ...): no HF checkpoint has them. Every one is required (as
#: llama.cpp's loader requires them).
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    **{f"blk.{{i}}.attn_{g}.{kind}": f"model.layers.{{i}}.self_attn.{h}_proj.{kind}"
       for g, h in (("q", "q"), ("k", "k"), ("v", "v"), ("output", "o"))
       for kind in ("weight", "bias")},
    "blk.{i}.attn_sinks.weight": _SINKS,
    "blk.{i}.ffn_gate_inp.weight": _ROUTER + "weight",
    "blk.{i}.ffn_gate_inp.bias": _ROUTER + "bias",
    **{f"blk.{{i}}.ffn_{proj}_exps.{kind}": f"{_EXPERTS}{proj}_proj.{kind}"
       for proj in ("gate", "up", "down") for kind in ("weight", "bias")},
}

#: llama.cpp's SwiGLU of the gpt-oss experts: constants in its graph
#: (``LLM_FFN_SWIGLU_OAI_MOE`` in ``llama-graph.cpp``), no key in the file.
_GGUF_SWIGLU_ALPHA, _GGUF_SWIGLU_LIMIT = 1.702, 7.0


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
    gguf_architecture = "gpt-oss"
    gguf_names = GGUF_NAMES
    gguf_rope_scaling_types = ("yarn",)

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

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        """What llama.cpp reads of a ``gpt-oss`` file (``models/openai-moe.cpp``): the
        experts' keys, the window of the sliding layers (every other one from the first
        unless ``attention.sliding_window_pattern`` gives another period), YaRN; the
        SwiGLU's constants are llama.cpp's own. YaRN keeps gpt-oss's ``truncate: false``
        (the released checkpoints'): llama.cpp rounds the ramp's ends outward instead,
        which would move the rotary frequencies off the safetensors model's."""
        n = int(cfg["num_hidden_layers"])
        for name in GGUF_NAMES:
            for i in range(n) if "{i}" in name else [None]:
                full = name.format(i=i)
                if full not in meta.tensors:
                    raise ValueError(f"GGUF file has no tensor {full} (gpt-oss needs "
                                     "it, as llama.cpp does)")
        if meta.get("expert_weights_norm"):
            raise meta.refuse("expert_weights_norm", meta.get("expert_weights_norm"),
                              "false: gpt-oss's weights are a softmax over the chosen k")
        scale = meta.get("expert_weights_scale")
        if scale not in (None, 0.0, 1.0):
            raise meta.refuse("expert_weights_scale", scale, "1.0")
        period = meta.get("attention.sliding_window_pattern", 2)
        if isinstance(period, bool) or not isinstance(period, int) or period < 0:
            raise meta.refuse("attention.sliding_window_pattern", period,
                              "a period: every period-th layer full, the others sliding")
        window = int(meta.require("attention.sliding_window"))
        if window < 1:
            raise meta.refuse("attention.sliding_window", window, "a window of 1 or more")
        swa_base = meta.get("rope.freq_base_swa")
        if swa_base is not None and float(swa_base) != cfg["rope_theta"]:
            raise meta.refuse("rope.freq_base_swa", swa_base,
                              f"the full layers' base, {cfg['rope_theta']}")
        out = {
            **cfg,
            "num_local_experts": int(meta.require("expert_count")),
            "num_experts_per_tok": int(meta.require("expert_used_count")),
            "intermediate_size": int(meta.require("expert_feed_forward_length")),
            "sliding_window": window,
            "layer_types": ["sliding_attention" if period == 0 or i % period < period - 1
                            else "full_attention" for i in range(n)],
            "attention_bias": True,
            "swiglu_alpha": _GGUF_SWIGLU_ALPHA,
            "swiglu_limit": _GGUF_SWIGLU_LIMIT,
        }
        if meta.get("rope.scaling.type") == "yarn":
            out["rope_scaling"] = _gguf_yarn(meta, int(cfg["max_position_embeddings"]))
        return out

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
        if getattr(ctx.source, "is_gguf", False):
            # llama.cpp's tensors: gate and up apart, each [E, I, H], their biases [E, I].
            gate_b, up_b = (ctx.need(Part(f"{n}{p}_proj.bias")) for p in ("gate", "up"))
            gu_bias = torch.cat([gate_b[:, rows], up_b[:, rows]], dim=1).reshape(-1)
            down_b = ctx.need(Part(n + "down_proj.bias"))  # [E, H]
            gu, dn = self._gguf_experts(ctx, n, rows)
        else:
            gate_up_b = ctx.need(Part(n + "gate_up_proj_bias"))  # [E, 2I]
            gu_bias = torch.cat([gate_up_b[:, 0::2][:, rows], gate_up_b[:, 1::2][:, rows]],
                                dim=1).reshape(-1)
            down_b = ctx.need(Part(n + "down_proj_bias"))  # [E, H]
            if ctx.source.tensor(Part(n + "gate_up_proj_scales")) is not None:
                gu, dn = self._mxfp4_experts(ctx, n, rows)
            else:
                gu, dn = self._dense_experts(ctx, n, rows)
        if plan is not None and plan.rank != 0:
            down_b = torch.zeros_like(down_b)  # added once, to the sum of the ranks' parts
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
        part = _block_part(rows, width // 2)
        dn_exps = exps[:, :, part]
        dn_codes = codes.reshape(*exps.shape, -1)[:, :, part]
        dn = mxfp4.weight(dn_codes.reshape(-1, dn_exps.shape[2] * mxfp4.BLOCK // 2),
                          dn_exps.reshape(-1, dn_exps.shape[2]))
        return gu, dn

    def _gguf_experts(self, ctx: LoadContext, n: str, rows: slice) -> tuple[Weight, Weight]:
        """A GGUF file's experts as the stacked ``[E * 2I', H]`` and ``[E * H, I']``
        matrices: MXFP4 ones in their blocks (their codes reordered, nothing rounded),
        others read as floats."""
        found = {p: ctx.source.blocks(f"{n}{p}_proj.weight")  # type: ignore[attr-defined]
                 for p in ("gate", "up", "down")}
        types = {p: f[0] for p, f in found.items() if f is not None}
        if set(types.values()) == {"MXFP4"} and len(types) == 3:
            gate, up, down = (found[p][1] for p in ("gate", "up", "down"))  # type: ignore[index]
            experts = gate.shape[0]
            gu = np.concatenate([gate[:, rows], up[:, rows]], axis=1)  # [E, 2I', H/32*17]
            inter = gate.shape[1]
            part = _block_part(rows, inter)
            width = mxfp4.GGUF_BLOCK_BYTES
            dn = down.reshape(*down.shape[:2], -1, width)[:, :, part]  # [E, H, I'/32, 17]
            return (mxfp4.from_gguf(gu.reshape(experts * gu.shape[1], -1)),
                    mxfp4.from_gguf(dn.reshape(experts * dn.shape[1], -1)))
        if ctx.quantization == "gguf":
            # No kernel here takes these experts' blocks as they are: they run as floats.
            ctx.dequantized.extend(f"{n}{p}_proj.weight" for p, t in types.items()
                                   if t not in ("F32", "F16", "BF16"))
        gate, up = (ctx.need(Part(f"{n}{p}_proj.weight")) for p in ("gate", "up"))
        hidden = gate.shape[2]
        gu = torch.cat([gate[:, rows], up[:, rows]], dim=1).reshape(-1, hidden)
        down = ctx.need(Part(n + "down_proj.weight"))[:, :, rows]  # [E, H, I']
        return gu.contiguous(), down.reshape(-1, down.shape[2]).contiguous()


def _block_part(rows: slice, inter: int) -> slice:
    """The MXFP4 blocks holding an expert's intermediate ``rows`` (of ``inter``) along its
    down projection's input: whole blocks only, the last one where the rows end there."""
    if rows.start % mxfp4.BLOCK or rows.stop % mxfp4.BLOCK and rows.stop != inter:
        raise TensorParallelError(f"cannot split MXFP4 experts at rows {rows.start}.."
                                  f"{rows.stop}: not on {mxfp4.BLOCK}-weight blocks")
    return slice(rows.start // mxfp4.BLOCK, -(-rows.stop // mxfp4.BLOCK))


def _gguf_yarn(meta: GGUFMetadata, context: int) -> dict[str, Any]:
    """A ``gpt-oss`` file's YaRN keys as transformers' ``rope_scaling``, with llama.cpp's
    defaults (``llama-hparams.h``) for those it may lack; the ones that would change the
    attention factor or the ramp beyond that are refused by name."""
    for key, default in (("rope.scaling.yarn_attn_factor", 1.0),
                         ("rope.scaling.attn_factor", 1.0),
                         ("rope.scaling.yarn_log_mul", 0.0)):
        value = meta.get(key)
        if value is not None and float(value) != default:
            raise meta.refuse(key, value, str(default))
    ext = meta.get("rope.scaling.yarn_ext_factor")
    if ext is not None and float(ext) >= 0 and float(ext) != 1.0:
        raise meta.refuse("rope.scaling.yarn_ext_factor", ext, "1.0 (or negative: 1.0)")
    return {
        "rope_type": "yarn",
        "factor": float(meta.require("rope.scaling.factor")),
        "original_max_position_embeddings": int(
            meta.get("rope.scaling.original_context_length") or context),
        "beta_fast": float(meta.get("rope.scaling.yarn_beta_fast", 32.0)),
        "beta_slow": float(meta.get("rope.scaling.yarn_beta_slow", 1.0)),
        "truncate": False,
    }
