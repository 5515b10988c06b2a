"""Gemma 4 (text, dense): Gemma 3's sandwich-normed layer with the changes below, the
``gemma4_text`` checkpoints that ``Gemma4ForCausalLM`` reads.

- Norms multiply by their weight ``w`` (not ``1 + w``); q and k are normed per head, and v
  too, by a norm without a weight. Attention scores are not scaled (scale 1).
- Sliding and global layers differ in shape: a global layer's heads may be wider
  (``global_head_dim``) and fewer on the K/V side; each layer's cache has its own head
  shape. The global layers' rope is "proportional": only the first part of each head's
  frequency pairs turns (see ``layers/rotary.py``).
- ``attention_k_eq_v``: a global layer has no v projection; its values are the k
  projection's output, normed by the weightless v norm (its keys by ``k_norm`` and rope).
- ``num_kv_shared_layers``: the last layers compute no K/V at all. Each reads the cache of
  the last earlier layer of its own kind (sliding or global) and stores nothing; the
  memory per token counts only the layers that store. Their MLP may be twice as wide
  (``use_double_wide_mlp``: the checkpoint's shapes say so).
- Per-layer embeddings (``hidden_size_per_layer_input``): a second token table gives
  every layer a small vector of its own, mixed with a projection of the scaled token
  embedding; after its MLP each layer adds ``norm(proj(act(gate(h)) * vector))``.
- Every layer's output is multiplied by its ``layer_scalar``; final logits soft-capped.
- ``enable_moe_block``: every layer runs a mixture of experts beside its dense MLP, both
  on the residual after attention. The router reads it normed without a weight, times a
  learned vector and ``1/sqrt(hidden)``; softmax, top ``k``, renormalised, each weight times
  its expert's learned scale (``layers/moe.py``'s ``Router``). The experts read it through
  a norm of their own; the dense MLP's output and the experts' are each normed, added, and
  the sum normed as a dense layer's MLP output is. The checkpoint stores each layer's
  experts as two 3-D tensors, ``gate_up_proj`` ``[E, 2I, H]`` (each expert's gate rows,
  then its up rows: the stacked layout as it is) and ``down_proj`` ``[E, H, I]``.

Decode steps with few rows run every layer in one Rust call (``layers/decoder_stack.py``,
which describes all of the above but the experts): the per-layer inputs are computed here
first and passed in. Its norms round as ``Gemma4Norm`` does (once), so the two paths
agree. A model with experts runs its decode steps layer by layer. The per-layer-embedding
projections stay dense under ``--quantization`` (the attention and MLP projections, the
experts and the head are quantized as usual). Refused by name at load: bidirectional
attention, and rope types other than "default" and "proportional".

Tensor parallelism splits the query heads as ``models/partition.py`` does (the same heads
in every layer, each layer's rows as wide as its heads); each layer's K/V heads are those
the rank's query heads attend to in that layer (a K/V head whose query group is cut is held
by every rank of it), so a layer that shares K/V finds the heads it needs in its source
layer's cache on the same rank. A world size where some layer's query heads would not
divide evenly among their K/V heads is refused naming the layer. Each layer's MLP rows are
cut at its own width; the token table, the per-layer-embedding table and the head by
vocabulary rows; the rest of the per-layer-embedding parts are whole on every rank. Each
expert's intermediate rows are cut as the dense MLP's are; the router is whole on every
rank, and the experts' partial outputs join before their norm.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from iron_batch.attention import kv_int8, paged
from iron_batch.layers import cpu_kernels
from iron_batch.layers.embedding import Embedding, LMHead, VocabParallel
from iron_batch.layers.linear import Linear, float_weight
from iron_batch.layers.mlp import GatedMLP
from iron_batch.layers.moe import MoE, Router, stacked
from iron_batch.layers.norm import RMSNorm
from iron_batch.layers.rotary import RotaryEmbedding, apply_rope
from iron_batch.layers.weights import LoadContext, Part, WeightSource
from iron_batch.models.config import GATED_ACTIVATION_NAMES, ModelConfig
from iron_batch.models.decoder import HF_NAMES, NORM_LAYOUTS, DecoderLayer, DecoderModel, Shard
from iron_batch.models.moe_decoder import MoEConfig
from iron_batch.models.partition import (
    ShardPlan,
    TensorParallelError,
    even_ranges,
    head_ranges,
    kv_heads_for,
)
from iron_batch.platform import heap, huge_pages

#: Layer kinds, in the order of the rope tables (``Gemma4Config.ropes``).
LAYER_KINDS = ("sliding_attention", "full_attention")

#: What transformers' config uses when a checkpoint gives no ``rope_parameters``.
_DEFAULT_ROPES = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                       "rope_theta": 1_000_000.0},
}

#: The gate's activation in a per-layer-embedding block, by the config's name.
_PLAIN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

_NAMES = {
    **HF_NAMES,
    "layer_scalar": "model.layers.{i}.layer_scalar",
    "ple_gate": "model.layers.{i}.per_layer_input_gate.weight",
    "ple_proj": "model.layers.{i}.per_layer_projection.weight",
    "ple_norm": "model.layers.{i}.post_per_layer_input_norm.weight",
    "ple_embed": "model.embed_tokens_per_layer.weight",
    "ple_model_proj": "model.per_layer_model_projection.weight",
    "ple_proj_norm": "model.per_layer_projection_norm.weight",
    # A layer's mixture of experts (``enable_moe_block``).
    "router": "model.layers.{i}.router.proj.weight",
    "router_scale": "model.layers.{i}.router.scale",
    "expert_scales": "model.layers.{i}.router.per_expert_scale",
    "experts_gate_up": "model.layers.{i}.experts.gate_up_proj",
    "experts_down": "model.layers.{i}.experts.down_proj",
    "pre_experts_norm": "model.layers.{i}.pre_feedforward_layernorm_2.weight",
    "post_mlp_norm_1": "model.layers.{i}.post_feedforward_layernorm_1.weight",
    "post_experts_norm": "model.layers.{i}.post_feedforward_layernorm_2.weight",
}

@dataclass
class Gemma4Config(MoEConfig):
    """``MoEConfig`` (its experts in every layer or in none) plus what Gemma 4 sets per
    layer. ``head_dim``/``num_kv_heads`` are the sliding layers' (the config's top-level
    values)."""

    #: Each layer's head width and K/V heads.
    layer_head_dims: list[int] = field(default_factory=list)
    layer_kv_heads: list[int] = field(default_factory=list)
    #: Each layer's kind index into ``LAYER_KINDS``.
    layer_kinds: list[int] = field(default_factory=list)
    #: For a layer that shares K/V: the layer whose cache it reads (None: its own).
    kv_sources: list[int | None] = field(default_factory=list)
    #: Global layers take their values from the k projection.
    k_eq_v: bool = False
    #: Rope (theta, scaling) of each kind in ``LAYER_KINDS``.
    ropes: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    #: Width of each layer's per-layer embedding (0: none), and that table's vocabulary.
    ple_dim: int = 0
    ple_vocab: int = 0

    def check_split(self, world: int) -> None:
        """Refuse (one line) a world size some layer's KV heads cannot follow."""
        for rank, q in enumerate(head_ranges(self, world)[0]):
            layer_kv_ranges(self, q, rank, world)


def layer_kv_ranges(c: Gemma4Config, q: range, rank: int, world: int) -> list[range]:
    """Each layer's KV heads on rank ``rank`` of ``world``, which holds the query heads
    ``q`` in every layer: those its query heads attend to (a KV head whose query group is
    cut between ranks is held by each of them). TensorParallelError where the rank's query
    heads would not pair with their KV heads in some layer (see ``kv_heads_for``)."""
    out: list[range] = []
    for i, kv in enumerate(c.layer_kv_heads):
        held = kv_heads_for(q, c.num_heads, kv)
        if held is None:
            raise TensorParallelError(
                f"cannot split {c.model_type} over {world} ranks: layer {i}'s "
                f"{c.num_heads} query heads share {kv} KV heads, and rank {rank}'s query "
                f"heads {q.start}-{q.stop - 1} would not divide evenly among the KV "
                "heads they attend to")
        out.append(held)
    return out


def _kinds(cfg: dict[str, Any], n: int) -> list[str]:
    types = cfg.get("layer_types")
    if types is None:  # transformers' default: five sliding layers to each global one
        types = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)]
    types = list(types)
    unknown = sorted(set(types) - set(LAYER_KINDS))
    if unknown or len(types) != n:
        raise ValueError(f"unsupported layer_types {unknown or types!r}")
    types[-1] = "full_attention"  # as transformers forces it
    return types


def _rope(kind: str, params: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    rope_type = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", _DEFAULT_ROPES[kind]["rope_theta"]))
    if rope_type == "default":  # transformers reads only theta for this type
        return theta, {"rope_type": "default"}
    if rope_type == "proportional":
        return theta, {"rope_type": "proportional",
                       "partial_rotary_factor": float(params.get("partial_rotary_factor", 1.0)),
                       "factor": float(params.get("factor", 1.0))}
    raise ValueError(f"unsupported rope_type {rope_type!r} for {kind} layers "
                     "(supported: default, proportional)")


def _shapes(cfg: dict[str, Any], kinds: list[str]) -> tuple[list[int], list[int]]:
    """Each layer's head width and K/V heads: the config's, with ``per_layer_config``'s
    overrides (or, without it, what transformers derives for the global layers)."""
    n = len(kinds)
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])
    per_layer = cfg.get("per_layer_config")
    if per_layer is None:
        over: dict[str, Any] = {"head_dim": cfg.get("global_head_dim", 512)}
        if cfg.get("attention_k_eq_v", True) and cfg.get("num_global_key_value_heads"):
            over["num_key_value_heads"] = cfg["num_global_key_value_heads"]
        per_layer = {i: over for i, k in enumerate(kinds) if k == "full_attention"}
    dims, heads = [head_dim] * n, [kv] * n
    for key, values in per_layer.items():
        i = int(key)
        extra = sorted(set(values) - {"head_dim", "num_key_value_heads"})
        if extra or not 0 <= i < n:
            raise ValueError(f"unsupported per_layer_config entry {key!r}: {values!r}")
        dims[i] = int(values.get("head_dim") or dims[i])
        heads[i] = int(values.get("num_key_value_heads") or heads[i])
    for kind in set(kinds):
        if len({dims[i] for i in range(n) if kinds[i] == kind}) > 1:
            raise ValueError(f"unsupported per_layer_config: {kind} layers of several head "
                             "widths (one rope table per layer kind)")
    return dims, heads


def _experts(cfg: dict[str, Any]) -> tuple[int, int, int]:
    """(experts, experts per token, an expert's intermediate rows) of a config with
    ``enable_moe_block``; zeros without it."""
    if not cfg.get("enable_moe_block"):
        return 0, 0, 0
    keys = ("num_experts", "top_k_experts", "moe_intermediate_size")
    missing = [k for k in keys if not cfg.get(k)]
    if missing:
        raise ValueError(f"enable_moe_block without {', '.join(missing)}")
    experts, top_k, inter = (int(cfg[k]) for k in keys)
    if top_k > experts:
        raise ValueError(f"top_k_experts {top_k} of {experts} experts")
    return experts, top_k, inter


def _kv_sources(cfg: dict[str, Any], kinds: list[str]) -> list[int | None]:
    """transformers' ``kv_sharing_modes``: the last ``num_kv_shared_layers`` layers read
    the K/V of the last earlier layer of their kind."""
    n = len(kinds)
    shared = int(cfg.get("num_kv_shared_layers") or 0)
    if not 0 <= shared < n:
        raise ValueError(f"unsupported num_kv_shared_layers {shared} of {n} layers (some "
                         "layer must compute the K/V the others share)")
    first = n - shared
    if shared and set(kinds[:first]) != set(kinds):
        raise ValueError(f"num_kv_shared_layers {shared}: every layer kind must have a "
                         "layer that computes its K/V before the sharing ones")
    out: list[int | None] = [None] * n
    for i in range(first, n):
        producers = [j for j in range(first) if kinds[j] == kinds[i]]
        if not producers:
            raise ValueError(f"num_kv_shared_layers {shared}: no earlier {kinds[i]} layer "
                             f"computes the K/V layer {i} would share")
        out[i] = producers[-1]
    return out


class Gemma4ForCausalLM(DecoderModel):
    model_types = ("gemma4_text",)
    architectures = ("Gemma4ForCausalLM",)
    hf_names = _NAMES

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> Gemma4Config:
        # "vision" changes only image tokens' attention; a text model has none.
        if cfg.get("use_bidirectional_attention") not in (None, "vision"):
            raise ValueError("unsupported use_bidirectional_attention "
                             f"{cfg['use_bidirectional_attention']!r} (an encoder, not a decoder)")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in GATED_ACTIVATION_NAMES:
            raise ValueError(f"unsupported hidden_activation {act!r} (supported: "
                             f"{', '.join(GATED_ACTIVATION_NAMES)})")
        n = int(cfg["num_hidden_layers"])
        kinds = _kinds(cfg, n)
        dims, kv_heads = _shapes(cfg, kinds)
        sources = _kv_sources(cfg, kinds)
        for i, src in enumerate(sources):
            if src is not None and (dims[i], kv_heads[i]) != (dims[src], kv_heads[src]):
                raise ValueError(f"layer {i} shares layer {src}'s K/V but differs in head "
                                 "shape")
        params = cfg.get("rope_parameters") or _DEFAULT_ROPES
        if not all(k in LAYER_KINDS for k in params):
            raise ValueError("unsupported rope_parameters: expected one entry per layer "
                             f"kind ({', '.join(LAYER_KINDS)}), got {sorted(params)}")
        ropes = [_rope(k, params.get(k) or _DEFAULT_ROPES[k]) for k in LAYER_KINDS]
        hidden = int(cfg["hidden_size"])
        bias = bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else [int(eos)] if isinstance(eos, int) else [
            int(e) for e in eos]
        ple = int(cfg.get("hidden_size_per_layer_input") or 0)
        experts = _experts(cfg)
        sliding_theta, sliding_scaling = ropes[0]
        return Gemma4Config(
            model_type=cfg.get("model_type", "gemma4_text"),
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=n,
            num_heads=int(cfg["num_attention_heads"]),
            num_kv_heads=int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"]),
            head_dim=int(cfg.get("head_dim") or hidden // cfg["num_attention_heads"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131_072)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            rope_theta=sliding_theta,
            rope_scaling=dict(sliding_scaling),
            qkv_bias=bias,
            o_bias=bias,
            qk_norm="head",
            sliding_window=cfg.get("sliding_window", 512),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act=act,
            sliding_layers=[k == "sliding_attention" for k in kinds],
            norm_layout="sandwich",
            attention_scale=1.0,
            final_softcap=cfg.get("final_logit_softcapping"),
            embedding_scale=hidden**0.5,
            embedding_scale_in_dtype=True,
            layer_head_dims=dims,
            layer_kv_heads=kv_heads,
            layer_kinds=[LAYER_KINDS.index(k) for k in kinds],
            kv_sources=sources,
            k_eq_v=bool(cfg.get("attention_k_eq_v", False)),
            ropes=ropes,
            ple_dim=ple,
            ple_vocab=int(cfg.get("vocab_size_per_layer_input") or cfg["vocab_size"]),
            num_experts=experts[0],
            top_k=experts[1] or 1,
            expert_intermediate_size=experts[2],
            norm_topk_prob=True,
            moe_layers=[experts[0] > 0] * n,
            routing_weights_in_float=True,
        )

    def __init__(
        self,
        config: ModelConfig,
        source: WeightSource,
        *,
        device: torch.device,
        dtype: torch.dtype,
        quantization: str | None = None,
        shard: Shard | None = None,
    ) -> None:
        if not isinstance(config, Gemma4Config):
            raise TypeError("Gemma4ForCausalLM needs the config its config_from_hf reads")
        super().__init__(config, source, device=device, dtype=dtype,
                         quantization=quantization, shard=shard)
        c: Gemma4Config = config
        # One rope table per layer kind, as wide as that kind's heads.
        width = {c.layer_kinds[i]: c.layer_head_dims[i] for i in range(c.num_layers)}
        self.rotaries = [
            RotaryEmbedding(width.get(k, c.head_dim), theta, scaling, device=device,
                            dtype=dtype)
            for k, (theta, scaling) in enumerate(c.ropes)
        ]
        self.kv_caches = []

    # ---------------------------------------------------------------- loading

    def _load(self, ctx: LoadContext, plan: ShardPlan | None) -> None:
        c = self.config
        assert isinstance(c, Gemma4Config)
        names = self.hf_names
        # Tensor parallelism: each layer's KV heads on this rank, from its query heads.
        kv_ranges = None
        if plan is not None:
            kv_ranges = layer_kv_ranges(c, plan.q_heads, plan.rank, plan.world)
        windows = [c.layer_window(i) for i in range(c.num_layers)]
        self.cache_groups: list[tuple[str, int | None]] = []
        if any(w is None for w in windows):
            self.cache_groups.append(("full", None))
        for w in sorted({w for w in windows if w is not None}):
            self.cache_groups.append(("sliding", w))

        fused = ctx.kernels.fused

        def norm(name: str) -> Gemma4Norm:
            return Gemma4Norm(ctx.need(Part(name)), c.rms_norm_eps, fused=fused)

        def dense(name: str) -> Linear:
            return Linear(ctx.need(Part(name)), kernels=ctx.kernels)

        def head_rows(run: range | None, width: int) -> slice | None:
            """Rows (or columns) of the heads ``run`` of ``width`` each (None: all)."""
            return None if run is None else slice(run.start * width, run.stop * width)

        def mlp_rows_of(name: str) -> slice | None:
            """This rank's share of an MLP's intermediate rows (None: all). The width can
            differ per layer: the checkpoint tensor's rows, read as its slice of no
            columns (which reads none of its values)."""
            if plan is None:
                return None
            t = ctx.source.tensor(Part(name, cols=slice(0, 0)))
            if t is None:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            run = even_ranges(t.shape[0], plan.world)[plan.rank]
            return slice(run.start, run.stop)

        def row_bias(name: str) -> torch.Tensor:
            bias = ctx.need(Part(name))
            if plan is not None and plan.rank != 0:
                # Added once to the sum of the partial outputs: by rank 0 alone.
                bias = torch.zeros_like(bias)
            return bias

        def experts(n: dict[str, str]) -> Gemma4Experts:
            """A layer's mixture of experts: its router whole, each expert's intermediate
            rows this rank's share of them."""
            num, inter = c.num_experts, c.expert_intermediate_size
            run = range(inter) if plan is None else even_ranges(inter, plan.world)[plan.rank]
            rows = slice(run.start, run.stop)
            gu = ctx.need_float(Part(n["experts_gate_up"]))  # [E, 2I, H]: gate rows, up rows
            gu = torch.cat([gu[:, rows], gu[:, inter:][:, rows]], dim=1).flatten(0, 1)
            dn = ctx.need_float(Part(n["experts_down"]))[:, :, rows].flatten(0, 1)
            kernels = ctx.kernels
            router = Router(ctx.need(Part(n["router"])), c.top_k,
                            renormalize=c.norm_topk_prob,
                            weights_in_float=c.routing_weights_in_float,
                            expert_scales=ctx.need(Part(n["expert_scales"])))
            moe = MoE(router,
                      stacked(Linear(float_weight(ctx, gu), kernels=kernels), num, kernels),
                      stacked(Linear(float_weight(ctx, dn), kernels=kernels), num, kernels),
                      c.hidden_act)
            hidden = c.hidden_size
            return Gemma4Experts(
                moe=moe,
                # The router's norm has no weight: a norm by ones.
                router_norm=Gemma4Norm(torch.ones(hidden, device=ctx.device, dtype=ctx.dtype),
                                       c.rms_norm_eps, fused=fused),
                router_scale=ctx.need(Part(n["router_scale"])),
                router_root=hidden**-0.5,
                pre_norm=norm(n["pre_experts_norm"]),
                dense_norm=norm(n["post_mlp_norm_1"]),
                out_norm=norm(n["post_experts_norm"]))

        def scalar(name: str) -> torch.Tensor | None:
            t = ctx.source.tensor(Part(name))
            if t is None or bool((t == 1).all()):
                return None  # a multiplication by one: skipped
            return t.reshape(()).to(device=ctx.device, dtype=ctx.dtype)

        layout = NORM_LAYOUTS[c.norm_layout]
        # The one-call decode stack has no experts: such a model decodes layer by layer.
        self.one_call_decode = c.num_experts == 0
        self.layers: list[DecoderLayer] = []
        for i in range(c.num_layers):
            n = {k: v.format(i=i) for k, v in names.items()}
            hd = c.layer_head_dims[i]
            kv_run = None if kv_ranges is None else kv_ranges[i]
            kvh = c.layer_kv_heads[i] if kv_run is None else len(kv_run)
            q_rows = head_rows(None if plan is None else plan.q_heads, hd)
            kv_rows = head_rows(kv_run, hd)
            src = c.kv_sources[i]
            global_layer = windows[i] is None
            v_from_k = c.k_eq_v and global_layer
            projections = ["q"] if src is not None else ["q", "k"] if v_from_k else [
                "q", "k", "v"]
            rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
            biases = [Part(n[p] + ".bias", rows=rows[p]) for p in projections
                      ] if c.qkv_bias else None
            qkv = Linear.load(ctx, [Part(n[p] + ".weight", rows=rows[p])
                                    for p in projections], biases=biases)
            o = Linear.load(ctx, [Part(n["o"] + ".weight", cols=q_rows)])
            if c.o_bias:
                o.bias = row_bias(n["o"] + ".bias")
            inter = mlp_rows_of(n["gate"] + ".weight")
            gate_up = Linear.load(ctx, [Part(n["gate"] + ".weight", rows=inter),
                                        Part(n["up"] + ".weight", rows=inter)])
            down = Linear.load(ctx, [Part(n["down"] + ".weight", cols=inter)])
            # As DecoderModel's: the most rows the MLP takes at once on CPU.
            mlp_rows = None
            if ctx.device.type == "cpu":
                width = gate_up.shape[0] * ctx.dtype.itemsize
                mlp_rows = max(64, heap.HEAP_BLOCK // width // 64 * 64)
            norms = {slot: norm(n[key]) for slot, key in layout.items()}
            ple = c.ple_dim > 0
            window = windows[i]
            group = self.cache_groups.index(
                ("full", None) if window is None else ("sliding", window))
            self.layers.append(Gemma4Layer(
                input_norm=norms["input_norm"],
                qkv=qkv,
                q_norm=norm(n["q_norm"]),
                k_norm=norm(n["k_norm"]) if src is None else None,
                o=o,
                post_norm=norms["post_norm"],
                mlp=GatedMLP(gate_up, down, c.hidden_act, max_rows=mlp_rows, fused=fused),
                sliding_window=window,
                attn_out_norm=norms["attn_out_norm"],
                mlp_out_norm=norms["mlp_out_norm"],
                rotary_dim=hd,
                rope_table=c.layer_kinds[i],
                scale=1.0,
                softcap=None,
                cache_group=group,
                head_dim=hd,
                kv_heads=kvh,
                v_from_k=v_from_k,
                # The v norm has no weight: a norm by ones.
                v_norm=Gemma4Norm(torch.ones(hd, device=ctx.device, dtype=ctx.dtype),
                                  c.rms_norm_eps, fused=fused) if src is None else None,
                kv_source=src,
                ple_gate=dense(n["ple_gate"]) if ple else None,
                ple_proj=dense(n["ple_proj"]) if ple else None,
                ple_norm=norm(n["ple_norm"]) if ple else None,
                layer_scalar=scalar(n["layer_scalar"]),
                experts=experts(n) if c.is_sparse(i) else None,
            ))
        self.norm = norm(names["norm"])
        # The token table and the head by vocabulary rows, as the dense families split them.
        vocab = parallel = None
        if plan is not None and self.shard is not None:
            vocab = slice(plan.vocab_start, plan.vocab_start + plan.vocab_rows)
            parallel = VocabParallel(plan.vocab_start, plan.vocab_rows,
                                     self.shard.all_reduce, self.shard.gather_logits)
        head_name = names["embed"] if c.tie_word_embeddings else names["lm_head"]
        head = Linear.load(ctx, [Part(head_name, rows=vocab)], head=True)
        self.lm_head = LMHead(head, c.vocab_size, parallel)
        if c.tie_word_embeddings and ctx.quantization is None:
            table = head.weight
        else:
            table = ctx.need(Part(names["embed"], rows=vocab))
        self.embed = Embedding(table, parallel)
        #: The per-layer embeddings' table, the projection of the token embedding into
        #: every layer's vector, and that projection's norm (None without them). The
        #: table (vocabulary x layers x width: the largest tensor of the small Gemma 4
        #: checkpoints) is split by vocabulary rows like the token table; the projection
        #: and its norm are whole on every rank, which computes the same vectors.
        self.ple_embed: Embedding | None = None
        self.ple_model_proj: Linear | None = None
        self.ple_proj_norm: Gemma4Norm | None = None
        if c.ple_dim:
            ple_rows = ple_parallel = None
            if plan is not None and self.shard is not None:
                per_rank = -(-c.ple_vocab // plan.world)
                start = plan.rank * per_rank
                ple_rows = slice(start, start + per_rank)
                ple_parallel = VocabParallel(start, per_rank, self.shard.all_reduce,
                                             self.shard.gather_logits)
            self.ple_embed = Embedding(ctx.need(Part(names["ple_embed"], rows=ple_rows)),
                                       ple_parallel)
            self.ple_model_proj = dense(names["ple_model_proj"])
            self.ple_proj_norm = norm(names["ple_proj_norm"])
        self.activation = _PLAIN_ACTIVATIONS[c.hidden_act]

    def _linears(self, head: bool = False) -> list[Linear]:
        out: list[Linear] = []
        for layer in self.layers:
            out += [layer.qkv, layer.o, *layer.mlp.linears()]
            if not isinstance(layer, Gemma4Layer):
                continue
            if layer.experts is not None:
                out += layer.experts.moe.linears()
            if layer.ple_gate is not None:
                assert layer.ple_proj is not None
                out += [layer.ple_gate, layer.ple_proj]
        if self.ple_model_proj is not None:
            out.append(self.ple_model_proj)
        return out + [self.lm_head.linear] if head else out

    # ---------------------------------------------------------------- the cache

    def _storing(self) -> list[Gemma4Layer]:
        return [layer for layer in self._gemma_layers() if layer.kv_source is None]

    def _gemma_layers(self) -> list[Gemma4Layer]:
        return [layer for layer in self.layers if isinstance(layer, Gemma4Layer)]

    def allocate_kv_cache(self, num_blocks: int | list[int], block_size: int) -> None:
        """The K/V of each layer that computes its own, in its head shape; a layer that
        shares K/V holds its source layer's tensor (no memory of its own)."""
        per_group = num_blocks if isinstance(num_blocks, list) else [num_blocks] * len(
            self.cache_groups)
        if len(per_group) != len(self.cache_groups):
            raise ValueError(f"{len(per_group)} block counts for {len(self.cache_groups)} "
                             "cache groups")
        caches: list[torch.Tensor] = []
        for layer in self._gemma_layers():
            if layer.kv_source is not None:
                caches.append(caches[layer.kv_source])
                continue
            row, kv_dtype = layer.head_dim, self.dtype
            if self.kv_cache_dtype == "int8":  # values and a float32 scale a row
                row, kv_dtype = kv_int8.row_bytes(layer.head_dim), torch.int8
            shape = (2, per_group[layer.cache_group], block_size, layer.kv_heads, row)
            caches.append(huge_pages.zeros(shape, kv_dtype) if self.kernels.huge_pages
                          else torch.zeros(shape, dtype=kv_dtype, device=self.device))
        self.kv_caches = caches
        self.block_size = block_size
        self.num_blocks_per_group = per_group
        if self.decoder is not None:
            self.decoder.set_caches(caches, block_size)

    def kv_bytes_per_token(self) -> list[int]:
        """K/V bytes one token takes in each cache group: the layers that store theirs."""
        int8 = self.kv_cache_dtype == "int8"
        size = 1 if int8 else self.dtype.itemsize

        def row(layer: Gemma4Layer) -> int:
            return kv_int8.row_bytes(layer.head_dim) if int8 else layer.head_dim

        return [sum(2 * layer.kv_heads * row(layer) * size for layer in self._storing()
                    if layer.cache_group == g) for g in range(len(self.cache_groups))]

    # ---------------------------------------------------------------- the forward

    def _hidden_states(
        self,
        *,
        input_ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        num_computed_before: np.ndarray,
        block_tables: np.ndarray,
        group_slot_mapping: np.ndarray | None = None,
        group_block_tables: np.ndarray | None = None,
    ) -> torch.Tensor:
        c = self.config
        assert isinstance(c, Gemma4Config)
        ids, ropes = self._ids_and_ropes(input_ids, positions)
        groups = self._group_tables(slot_mapping, block_tables, group_slot_mapping,
                                    group_block_tables, len(seq_lens))
        decoder = self.decoder
        if decoder is not None and 0 < ids.shape[0] <= decoder.max_rows:
            lens, per_row = self._stack_rows(query_start_loc, seq_lens)
            h = self._embed(ids).contiguous()
            per_layer = self._per_layer_inputs(ids, h).contiguous() if c.ple_dim else None
            decoder.decode(h, None, None, None, None, None, scale=self.scale, ropes=ropes,
                           groups=[(slots, per_row(tables), lens) for slots, tables in groups],
                           per_layer=per_layer)
            return h
        layers = self._gemma_layers()
        heads = self.num_heads
        attn = self.attention
        shard = self.shard
        # One plan per cache group and query heads per K/V head (the masks of prompt rows
        # repeat by the latter).
        plans = {}
        for layer in layers:
            key = (layer.cache_group, heads // layer.kv_heads)
            if key not in plans:
                slots, tables = groups[layer.cache_group]
                plans[key] = attn.plan(
                    query_start_loc=query_start_loc, seq_lens=seq_lens,
                    num_computed_before=num_computed_before, block_tables=tables,
                    slot_mapping=slots, block_size=self.block_size, group=key[1],
                    sliding_window=self.cache_groups[layer.cache_group][1])
        h = self._embed(ids)
        n = h.shape[0]
        per_layer = self._per_layer_inputs(ids, h) if c.ple_dim else None
        x = layers[0].input_norm(h) if layers[0].input_norm is not None else h
        # This step's K/V of each storing layer, for the layers that share them.
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, (layer, cache) in enumerate(zip(layers, self.kv_caches, strict=True)):
            plan = plans[(layer.cache_group, heads // layer.kv_heads)]
            hd, kvh = layer.head_dim, layer.kv_heads
            cos, sin = ropes[layer.rope_table]
            proj = layer.qkv(x)
            q_size = heads * hd
            assert layer.q_norm is not None
            q = apply_rope(layer.q_norm(proj[:, :q_size].view(n, heads, hd)), cos, sin)
            if layer.kv_source is None:
                assert layer.k_norm is not None and layer.v_norm is not None
                k_raw = proj[:, q_size : q_size + kvh * hd].view(n, kvh, hd)
                v_raw = k_raw if layer.v_from_k else proj[:, q_size + kvh * hd :].view(
                    n, kvh, hd)
                k = apply_rope(layer.k_norm(k_raw), cos, sin)
                v = layer.v_norm(v_raw)
                k, v = paged.write_kv(cache, plan, k, v)
                kv[i] = (k, v)
            else:
                k, v = kv[layer.kv_source]
            o = layer.o(attn.forward(q, k, v, cache, plan, layer.scale, layer.softcap))
            if shard is not None:
                shard.all_reduce(o)  # row-parallel: the ranks' partial sums
            h, x = self._join(h, o, layer.attn_out_norm, 1.0, layer.post_norm)
            mlp = layer.mlp(x)
            if shard is not None:
                shard.all_reduce(mlp)
            if layer.experts is not None:
                routed = layer.experts(h)
                if shard is not None:
                    shard.all_reduce(routed)
                mlp = layer.experts.join(mlp, routed)
            h, _ = self._join(h, mlp, layer.mlp_out_norm, 1.0, None)
            if per_layer is not None:
                assert layer.ple_gate and layer.ple_proj and layer.ple_norm
                gated = self.activation(layer.ple_gate(h)) * per_layer[:, i]
                h = h + layer.ple_norm(layer.ple_proj(gated))
            if layer.layer_scalar is not None:
                h = h * layer.layer_scalar
            if i + 1 < len(layers):
                after = layers[i + 1].input_norm
                x = after(h) if after is not None else h
        return h

    def _per_layer_inputs(self, ids: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        """[T, layers, ple_dim]: each token's row of the per-layer table (scaled by
        sqrt(ple_dim)) and the normed projection of its scaled embedding, averaged in
        the 1/sqrt(2) sense."""
        c = self.config
        assert isinstance(c, Gemma4Config)
        assert self.ple_embed and self.ple_model_proj and self.ple_proj_norm
        n = ids.shape[0]
        token = self.ple_embed(ids) * torch.tensor(c.ple_dim**0.5, dtype=embedded.dtype)
        projected = self.ple_model_proj(embedded) * c.hidden_size**-0.5
        projected = self.ple_proj_norm(projected.view(n, c.num_layers, c.ple_dim))
        return (projected + token.view(n, c.num_layers, c.ple_dim)) * 2**-0.5


class Gemma4Norm(RMSNorm):
    """Gemma 4's RMSNorm over the last dimension of any shape: the statistics and the
    product with the weight both in float32, rounded to the compute dtype once (the
    shared norm rounds before multiplying by its weight; in bf16 the two differ).
    ``fused``: on CPU, by the Rust kernel that rounds the same way (the one the decode
    stack runs); ``weight`` stays float32 for the torch route."""

    #: The decode stack reads this: its norms of such a layer round once too.
    rounds_once = True

    def __init__(self, weight: torch.Tensor, eps: float, *, fused: bool = False) -> None:
        super().__init__(weight.float(), eps)
        self.dtype = weight.dtype
        #: The weight in the compute dtype, for the fused kernel.
        self._native = weight if fused else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        native = self._native
        if native is not None and x.dtype == native.dtype and x.device.type == "cpu":
            flat = x.reshape(-1, x.shape[-1]).contiguous()
            out = cpu_kernels.add_rms_norm_(flat, None, native, self.eps, round_once=True)
            return out.view(x.shape)
        xf = x.float()
        xf = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (xf * self.weight).to(x.dtype)

    def add(
        self, residual: torch.Tensor, delta: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + delta
        return residual, self(residual)


@dataclass
class Gemma4Experts:
    """A layer's mixture of experts beside its dense MLP (``enable_moe_block``), both on
    the residual after attention."""

    moe: MoE
    #: The router's input: the residual normed without a weight, times ``router_scale``,
    #: times ``router_root`` (``1/sqrt(hidden)``), in this order (each product rounded).
    router_norm: Gemma4Norm
    router_scale: torch.Tensor
    router_root: float
    #: The experts' input norm; the dense MLP's output norm and the experts'.
    pre_norm: Gemma4Norm
    dense_norm: Gemma4Norm
    out_norm: Gemma4Norm

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """The experts' output for the residual ``h`` (before :meth:`join`'s norm)."""
        weights, ids = self.moe.router(self.router_norm(h) * self.router_scale
                                       * self.router_root)
        return self.moe.experts(self.pre_norm(h), weights, ids)

    def join(self, dense: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """The dense MLP's output and the experts', each normed, added."""
        return self.dense_norm(dense) + self.out_norm(routed)


@dataclass
class Gemma4Layer(DecoderLayer):
    """A decoder layer with Gemma 4's per-layer head shape, its weightless v norm, K/V
    shared from an earlier layer, its per-layer-embedding block and its output scalar."""

    head_dim: int = 0
    kv_heads: int = 0
    #: The values are the k projection's output (``attention_k_eq_v``, global layers).
    v_from_k: bool = False
    v_norm: Gemma4Norm | None = None
    #: The earlier layer whose K/V this one reads (None: it computes and stores its own).
    kv_source: int | None = None
    ple_gate: Linear | None = None
    ple_proj: Linear | None = None
    ple_norm: Gemma4Norm | None = None
    #: The layer's output is multiplied by this (None: by one).
    layer_scalar: torch.Tensor | None = None
    #: The mixture of experts beside the MLP (None: the MLP alone).
    experts: Gemma4Experts | None = None
