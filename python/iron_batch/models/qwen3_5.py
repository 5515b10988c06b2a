"""Qwen3.5 (dense): a hybrid of Gated DeltaNet linear-attention layers
(``layers/gated_delta.py``) and gated full-attention layers, by default three of the
former to each of the latter.

The full-attention layers: the q projection is twice as wide, each head's q followed by a
gate that multiplies the attention output by its sigmoid; per-head RMSNorms on q and k;
rotary over the leading quarter of each head. Every RMSNorm outside the linear-attention
mixer is zero-centred (the weight is stored as ``w - 1``) and multiplies in float32.

Cache groups: the full-attention layers' K/V in paged blocks (group "full"), the linear
layers' convolution windows and delta-rule matrices in one state slot per sequence (group
"state"). Each step's batch says, per sequence, whether its state starts fresh, is restored
from a checkpoint slot before the step, or is saved into one after it (the core decides
where; see ``rust/core/src/scheduler.rs``).

Tensor parallelism: the full-attention layers split as the other families' (each rank's
query heads with their gates, its KV heads or a replica of one); the linear-attention
layers by key head, each key head with the value heads it serves (fewer key heads than
ranks: each key head on ``world / key_heads`` ranks that split its value heads). A rank
holds its heads' rows of the input projections and convolution channels, their decay and
beta parameters, its columns of the output projection (one all-reduce after it), and in
its state slots only its heads' windows and matrices.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from iron_batch.attention import paged
from iron_batch.layers import hybrid_stack
from iron_batch.layers.decoder_stack import stacks_moe
from iron_batch.layers.embedding import Embedding, LMHead, VocabParallel
from iron_batch.layers.gated_delta import GatedDeltaNet, StepRows
from iron_batch.layers.linear import Linear
from iron_batch.layers.mlp import GatedMLP
from iron_batch.layers.moe import MoE
from iron_batch.layers.rotary import apply_rope
from iron_batch.layers.weights import LoadContext, Part, WeightSource
from iron_batch.models import qwen3_5_gguf
from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel, Shard, check_state_dtype
from iron_batch.models.partition import ShardPlan, TensorParallelError, even_ranges
from iron_batch.platform import heap

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata

_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj",
    "k": "model.layers.{i}.self_attn.k_proj",
    "v": "model.layers.{i}.self_attn.v_proj",
    "o": "model.layers.{i}.self_attn.o_proj",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "lin_qkv": "model.layers.{i}.linear_attn.in_proj_qkv.weight",
    "lin_z": "model.layers.{i}.linear_attn.in_proj_z.weight",
    "lin_b": "model.layers.{i}.linear_attn.in_proj_b.weight",
    "lin_a": "model.layers.{i}.linear_attn.in_proj_a.weight",
    "lin_conv": "model.layers.{i}.linear_attn.conv1d.weight",
    "lin_a_log": "model.layers.{i}.linear_attn.A_log",
    "lin_dt_bias": "model.layers.{i}.linear_attn.dt_bias",
    "lin_norm": "model.layers.{i}.linear_attn.norm.weight",
    "lin_out": "model.layers.{i}.linear_attn.out_proj.weight",
    "gate": "model.layers.{i}.mlp.gate_proj.weight",
    "up": "model.layers.{i}.mlp.up_proj.weight",
    "down": "model.layers.{i}.mlp.down_proj.weight",
}


@dataclass
class Qwen3_5Config(ModelConfig):
    #: Per layer: a linear-attention (Gated DeltaNet) layer, else full attention.
    linear_layers: list[bool] = field(default_factory=list)
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 4

    def check_split(self, world: int) -> None:
        """Refuse (one line) a world size the linear-attention heads cannot be split by."""
        linear_head_split(self, world)


def linear_head_split(c: Qwen3_5Config, world: int) -> list[tuple[range, range]]:
    """Per rank: the linear-attention key heads it holds and the value heads they serve
    on it. Each key head serves ``value / key`` consecutive value heads; with at least as
    many key heads as ranks they are cut in contiguous near-equal runs, else each key head
    is replicated on ``world / key`` ranks that split its value heads."""
    hk, hv = c.linear_key_heads, c.linear_value_heads
    per = hv // hk
    if hk >= world:
        return [(run, range(run.start * per, run.stop * per))
                for run in even_ranges(hk, world)]
    ranks_per_key = world // hk
    if world % hk or per % ranks_per_key:
        raise TensorParallelError(
            f"cannot split {c.model_type} over {world} ranks: its linear-attention layers' "
            f"{hk} key heads and {hv} value heads do not divide evenly among the ranks")
    share = per // ranks_per_key
    return [(range(r // ranks_per_key, r // ranks_per_key + 1),
             range(r * share, (r + 1) * share)) for r in range(world)]


class CenteredNorm:
    """RMSNorm by ``1 + w`` (w stored zero-centred), the product taken in float32 and
    rounded once, over the last dimension of any shape."""

    def __init__(self, stored: torch.Tensor, eps: float) -> None:
        self.weight = stored.float() + 1.0
        self.eps = float(eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight).to(x.dtype)


@dataclass
class AttentionLayer:
    """A gated full-attention layer: ``qkv`` holds the doubled q projection (per head: q,
    then its gate), then k, then v."""

    input_norm: CenteredNorm
    qkv: Linear
    q_norm: CenteredNorm
    k_norm: CenteredNorm
    o: Linear
    post_norm: CenteredNorm
    #: The dense gated MLP, or (Qwen3.5-MoE) a mixture of experts.
    mlp: GatedMLP | MoE
    scale: float
    #: Index of the layer's K/V among the full-attention layers.
    cache: int


@dataclass
class LinearLayer:
    """A Gated DeltaNet layer and its MLP."""

    input_norm: CenteredNorm
    mixer: GatedDeltaNet
    post_norm: CenteredNorm
    #: The dense gated MLP, or (Qwen3.5-MoE) a mixture of experts.
    mlp: GatedMLP | MoE
    scale: float
    #: Index of the layer's state among the linear-attention layers.
    state: int


def _layer_types(cfg: dict[str, Any], n: int) -> list[bool]:
    types = cfg.get("layer_types")
    if types is None:
        every = int(cfg.get("full_attention_interval", 4))
        return [(i + 1) % every != 0 for i in range(n)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    bad = sorted({t for t in types if t not in ("linear_attention", "full_attention")})
    if bad:
        raise ValueError(f"unsupported layer_types {bad} (linear_attention, full_attention)")
    return [t == "linear_attention" for t in types]


def _copy_slots(conv: torch.Tensor, delta: torch.Tensor, *, src: np.ndarray,
                dst: np.ndarray) -> None:
    """Every layer's state of slot ``src[i]`` into slot ``dst[i]`` (the slots distinct), one
    slot at a time: an indexed copy of all of them at once would first gather them into a
    temporary, 18 MB a slot for Qwen3.5-0.8B in float32, faulted in fresh every step."""
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        conv[:, d].copy_(conv[:, s])
        delta[:, d].copy_(delta[:, s])


class Qwen3_5ForCausalLM(DecoderModel):
    model_types = ("qwen3_5_text",)
    architectures = ("Qwen3_5ForCausalLM",)
    hf_names = _NAMES
    gguf_architecture = "qwen35"
    gguf_names = qwen3_5_gguf.GGUF_NAMES
    one_call_decode = False

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        return qwen3_5_gguf.hf_config(cfg, meta)

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        if cfg.get("attention_bias"):
            raise ValueError("unsupported attention_bias in Qwen3.5 (no checkpoint has it)")
        params = dict(cfg.get("rope_parameters") or {})
        # Text tokens have one position on all three M-RoPE axes: the sections do not
        # change their rotation.
        for key in ("mrope_section", "mrope_interleaved"):
            params.pop(key, None)
        params.setdefault("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        n = int(cfg["num_hidden_layers"])
        base = ModelConfig.from_hf({**cfg, "rope_parameters": params}, tie_default=False,
                                   qk_norm="head", norm_weight_offset=1.0)
        return Qwen3_5Config(
            **base.__dict__,
            linear_layers=_layer_types(cfg, n),
            linear_key_heads=int(cfg.get("linear_num_key_heads", 16)),
            linear_value_heads=int(cfg.get("linear_num_value_heads", 32)),
            linear_key_dim=int(cfg.get("linear_key_head_dim", 128)),
            linear_value_dim=int(cfg.get("linear_value_head_dim", 128)),
            linear_conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
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
        if not isinstance(config, Qwen3_5Config):
            raise TypeError("Qwen3_5ForCausalLM needs the config its config_from_hf reads")
        self.conv_states: torch.Tensor | None = None
        self.delta_states: torch.Tensor | None = None
        #: How the delta matrices are kept (:meth:`set_state_dtype`).
        self.state_dtype = "float32"
        super().__init__(config, source, device=device, dtype=dtype,
                         quantization=quantization, shard=shard)
        # Decode steps with few rows: every layer in one Rust call (see hybrid_stack), with
        # dense MLPs or the sparse ones its router runs.
        self.hybrid: hybrid_stack.HybridStack | None = None
        kernels = self.kernels
        if (shard is None and kernels.decoder and dtype == torch.bfloat16
                and hybrid_stack.available()
                and all(isinstance(layer.mlp, GatedMLP)
                        or (isinstance(layer.mlp, MoE) and stacks_moe(layer.mlp))
                        for layer in self.layers)):
            self.hybrid = hybrid_stack.HybridStack(
                self.layers, hidden=config.hidden_size, heads=self.num_heads,
                kv_heads=self.num_kv_heads, head_dim=config.head_dim,
                rotary_dim=config.rotary_dim or config.head_dim, eps=config.rms_norm_eps,
                quant_gemv_rows=kernels.quant_gemv_rows)

    # ---------------------------------------------------------------- loading

    def _load(self, ctx: LoadContext, plan: ShardPlan | None) -> None:
        c = self.config
        assert isinstance(c, Qwen3_5Config)
        names = self.hf_names
        self.cache_groups: list[tuple[str, int | None]] = [("full", None), ("state", None)]
        if all(c.linear_layers):
            raise ValueError("a Qwen3.5 checkpoint needs at least one full-attention layer")
        # llama.cpp's converter stored the norms with their 1 added, -exp(A_log) for A_log,
        # and the value heads of the linear layers tiled (undone by the wrapper).
        gguf = bool(getattr(ctx.source, "is_gguf", False))
        if gguf:
            ctx = replace(ctx, source=qwen3_5_gguf.TiledValueHeads(
                ctx.source, key_heads=c.linear_key_heads, value_heads=c.linear_value_heads,
                key_dim=c.linear_key_dim, value_dim=c.linear_value_dim))

        def norm(name: str) -> CenteredNorm:
            stored = ctx.need_float(Part(name)).to(ctx.device)
            return CenteredNorm(stored - 1.0 if gguf else stored, c.rms_norm_eps)

        def decay_rate(name: str, rows: slice) -> torch.Tensor:
            # -exp(A_log) of the parameter in the compute dtype, as the reference takes it.
            stored = ctx.need(Part(name, rows=rows)).float()
            return stored if gguf else -stored.exp()

        def lin(*parts: str | Part) -> Linear:
            return Linear.load(ctx, [p if isinstance(p, Part) else Part(p) for p in parts])

        # This rank's rows (column-parallel) and columns (row-parallel); None: whole.
        hd, dk, dv = c.head_dim, c.linear_key_dim, c.linear_value_dim
        hk, hv = c.linear_key_heads, c.linear_value_heads
        q_rows = kv_rows = o_cols = inter = vocab = None
        keys, values = range(hk), range(hv)
        if plan is not None:
            q_rows = slice(plan.q_heads.start * 2 * hd, plan.q_heads.stop * 2 * hd)
            o_cols = slice(plan.q_heads.start * hd, plan.q_heads.stop * hd)
            kv_rows = slice(plan.kv_heads.start * hd, plan.kv_heads.stop * hd)
            inter = slice(plan.intermediate.start, plan.intermediate.stop)
            vocab = slice(plan.vocab_start, plan.vocab_start + plan.vocab_rows)
            keys, values = linear_head_split(c, plan.world)[plan.rank]

        def heads_of(first: int, run: range, width: int) -> slice:
            return slice(first + run.start * width, first + run.stop * width)

        # The convolution channels (the rows of in_proj_qkv) of this rank's heads: its
        # key heads' q, their k, its value heads' v.
        channels = [heads_of(0, keys, dk), heads_of(hk * dk, keys, dk),
                    heads_of(2 * hk * dk, values, dv)]
        z_rows, head_rows = heads_of(0, values, dv), heads_of(0, values, 1)

        mlp_rows = None
        if ctx.device.type == "cpu":
            width = 2 * (c.intermediate_size if inter is None else inter.stop - inter.start)
            mlp_rows = max(64, heap.HEAP_BLOCK // (width * ctx.dtype.itemsize) // 64 * 64)
        scale = c.head_dim**-0.5
        self.layers: list[Any] = []
        attention = linear = 0
        for i in range(c.num_layers):
            n = {k: v.format(i=i) for k, v in names.items()}
            mlp: GatedMLP | MoE | None = self._sparse_mlp(ctx, i, plan)
            if mlp is None:
                mlp = GatedMLP(lin(Part(n["gate"], rows=inter), Part(n["up"], rows=inter)),
                               lin(Part(n["down"], cols=inter)), c.hidden_act,
                               max_rows=mlp_rows)
            if c.linear_layers[i]:
                conv = torch.cat([ctx.need(Part(n["lin_conv"], rows=r)) for r in channels])
                mixer = GatedDeltaNet(
                    in_proj=lin(*(Part(n["lin_qkv"], rows=r) for r in channels),
                                Part(n["lin_z"], rows=z_rows), Part(n["lin_b"], rows=head_rows),
                                Part(n["lin_a"], rows=head_rows)),
                    conv_weight=conv.reshape(conv.shape[0], -1).contiguous(),
                    neg_a=decay_rate(n["lin_a_log"], head_rows),
                    dt_bias=ctx.need(Part(n["lin_dt_bias"], rows=head_rows)),
                    norm_weight=ctx.need(Part(n["lin_norm"])),
                    out_proj=lin(Part(n["lin_out"], cols=z_rows)),
                    key_heads=len(keys), value_heads=len(values),
                    key_dim=c.linear_key_dim, value_dim=c.linear_value_dim,
                    eps=c.rms_norm_eps,
                    kernels=ctx.device.type == "cpu" and ctx.kernels.attention,
                )
                if mixer.kernel != c.linear_conv_kernel:
                    raise ValueError(f"layer {i}: conv1d kernel {mixer.kernel}, config says "
                                     f"{c.linear_conv_kernel}")
                self.layers.append(LinearLayer(norm(n["input_norm"]), mixer,
                                               norm(n["post_norm"]), mlp, scale, linear))
                linear += 1
            else:
                self.layers.append(AttentionLayer(
                    input_norm=norm(n["input_norm"]),
                    qkv=lin(Part(n["q"] + ".weight", rows=q_rows),
                            Part(n["k"] + ".weight", rows=kv_rows),
                            Part(n["v"] + ".weight", rows=kv_rows)),
                    q_norm=norm(n["q_norm"]),
                    k_norm=norm(n["k_norm"]),
                    o=lin(Part(n["o"] + ".weight", cols=o_cols)),
                    post_norm=norm(n["post_norm"]),
                    mlp=mlp, scale=scale, cache=attention,
                ))
                attention += 1
        self.norm = norm(names["norm"])  # type: ignore[assignment]
        parallel = None
        if plan is not None and self.shard is not None:
            parallel = VocabParallel(plan.vocab_start, plan.vocab_rows,
                                     self.shard.all_reduce, self.shard.gather_logits)
        tied = c.tie_word_embeddings
        head = Linear.load(ctx, [Part(names["embed"] if tied else names["lm_head"],
                                      rows=vocab)], head=True)
        self.lm_head = LMHead(head, c.vocab_size, parallel)
        if tied and ctx.quantization in (None, "gguf"):
            table = head.weight
        elif ctx.quantization == "gguf":
            table = Linear.load(ctx, [Part(names["embed"], rows=vocab)]).weight
        else:
            table = ctx.need(Part(names["embed"], rows=vocab))
        self.embed = Embedding(table, parallel)

    def _linears(self, head: bool = False) -> list[Linear]:
        out: list[Linear] = []
        for layer in self.layers:
            if isinstance(layer, LinearLayer):
                out += layer.mixer.linears()
            else:
                out += [layer.qkv, layer.o]
            out += layer.mlp.linears()
        return out + [self.lm_head.linear] if head else out

    def _mixers(self) -> list[GatedDeltaNet]:
        return [layer.mixer for layer in self.layers if isinstance(layer, LinearLayer)]

    # ---------------------------------------------------------------- the caches

    def allocate_kv_cache(self, num_blocks: int | list[int], block_size: int) -> None:
        """Paged K/V of the full-attention layers (``num_blocks[0]`` blocks) and the
        linear layers' states (``num_blocks[1]`` slots), zeroed."""
        c = self.config
        assert isinstance(c, Qwen3_5Config)
        per_group = num_blocks if isinstance(num_blocks, list) else [num_blocks] * 2
        if len(per_group) != 2:
            raise ValueError(f"{len(per_group)} sizes for Qwen3.5's 2 cache groups")
        blocks, slots = per_group
        attention = [layer for layer in self.layers if isinstance(layer, AttentionLayer)]
        self.kv_caches = [
            torch.zeros((2, blocks, block_size, self.num_kv_heads, c.head_dim),
                        dtype=self.dtype, device=self.device) for _ in attention]
        mixers = self._mixers()
        m = mixers[0] if mixers else None
        channels = m.conv_channels if m else 0
        self.conv_states = torch.zeros(
            (len(mixers), slots, channels, c.linear_conv_kernel - 1), dtype=torch.float32,
            device=self.device)
        value_heads = m.value_heads if m else 0
        self.delta_states = torch.zeros(
            (len(mixers), slots, value_heads, c.linear_key_dim, c.linear_value_dim),
            dtype=self._delta_dtype(), device=self.device)
        self.block_size = block_size
        self.num_blocks_per_group = per_group
        if self.hybrid is not None:
            self.hybrid.set_caches(self.kv_caches, self.conv_states, self.delta_states,
                                   block_size)

    def kv_bytes_per_token(self) -> list[int]:
        """K/V bytes a token takes in the full group; none in the state group."""
        attention = sum(1 for layer in self.layers if isinstance(layer, AttentionLayer))
        per_layer = 2 * self.num_kv_heads * self.config.head_dim * self.dtype.itemsize
        return [attention * per_layer, 0]

    def set_state_dtype(self, state_dtype: str) -> None:
        """The delta-rule matrices in ``state_dtype`` ("float32", the default, or
        "bfloat16": half the bytes per slot, rounded once per decode token and once per
        block of a prompt chunk); the convolution windows stay float32."""
        self.state_dtype = check_state_dtype(state_dtype)

    def _delta_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.state_dtype == "bfloat16" else torch.float32

    def state_slot_bytes(self) -> int:
        """Bytes of one sequence's state over every linear layer (float32 windows, the
        delta matrices in :meth:`set_state_dtype`'s dtype): of this rank's heads under
        tensor parallelism."""
        c = self.config
        assert isinstance(c, Qwen3_5Config)
        mixers = self._mixers()
        if not mixers:
            return 0
        m = mixers[0]
        conv = 4 * m.conv_channels * (c.linear_conv_kernel - 1)
        delta = (self._delta_dtype().itemsize * m.value_heads * c.linear_key_dim
                 * c.linear_value_dim)
        return (conv + delta) * len(mixers)

    def _state_ops(self, state_slots: np.ndarray | None, state_fresh: np.ndarray | None,
                   state_restore: np.ndarray | None) -> None:
        """Zero the slots that start fresh, then copy the restored checkpoints in."""
        conv, delta = self.conv_states, self.delta_states
        assert conv is not None and delta is not None
        if state_slots is None or state_fresh is None or state_restore is None:
            raise ValueError("Qwen3.5 needs the batch's state slots (a scheduler with its "
                             "state cache group)")
        slots = np.asarray(state_slots, dtype=np.int64)
        if slots.size and int(slots.max()) >= conv.shape[1]:
            raise ValueError(f"batch uses a state slot beyond the {conv.shape[1]} slots")
        fresh = slots[np.asarray(state_fresh) != 0]
        if fresh.size:
            at = torch.from_numpy(fresh).to(self.device)
            conv[:, at] = 0.0
            delta[:, at] = 0.0
        restore = np.asarray(state_restore, dtype=np.int64)
        has = restore >= 0
        if has.any():
            _copy_slots(conv, delta, src=restore[has], dst=slots[has])

    def _state_saves(self, state_slots: np.ndarray, state_save: np.ndarray | None) -> None:
        conv, delta = self.conv_states, self.delta_states
        assert conv is not None and delta is not None
        if state_save is None:
            return
        save = np.asarray(state_save, dtype=np.int64)
        has = save >= 0
        if has.any():
            _copy_slots(conv, delta, src=np.asarray(state_slots, dtype=np.int64)[has],
                        dst=save[has])

    # ---------------------------------------------------------------- the forward

    def _hidden_states(  # type: ignore[override]
        self,
        *,
        input_ids: np.ndarray | torch.Tensor,
        positions: np.ndarray,
        slot_mapping: np.ndarray,
        query_start_loc: np.ndarray,
        seq_lens: np.ndarray,
        num_computed_before: np.ndarray,
        block_tables: np.ndarray,
        state_slots: np.ndarray | None = None,
        state_fresh: np.ndarray | None = None,
        state_restore: np.ndarray | None = None,
        state_save: np.ndarray | None = None,
        group_slot_mapping: np.ndarray | None = None,
        group_block_tables: np.ndarray | None = None,
    ) -> torch.Tensor:
        c = self.config
        conv, delta = self.conv_states, self.delta_states
        assert conv is not None and delta is not None
        self._state_ops(state_slots, state_fresh, state_restore)
        assert state_slots is not None
        ids, ropes = self._ids_and_ropes(input_ids, positions)
        cos, sin = ropes[0]
        hybrid = self.hybrid
        if hybrid is not None and 0 < len(ids) <= hybrid.max_rows and np.all(
                np.diff(np.asarray(query_start_loc)) == 1):
            # Every row one sequence's next token: the whole stack in one call.
            h = self._embed(ids).contiguous()
            hybrid.decode(h, cos, sin, slot_mapping, block_tables, seq_lens, state_slots)
            self._state_saves(state_slots, state_save)
            return h
        heads, kv_heads, hd = self.num_heads, self.num_kv_heads, c.head_dim
        attn = self.attention
        plan = attn.plan(
            query_start_loc=query_start_loc, seq_lens=seq_lens,
            num_computed_before=num_computed_before, block_tables=block_tables,
            slot_mapping=slot_mapping, block_size=self.block_size,
            group=heads // kv_heads, sliding_window=None)
        rows = StepRows.of(query_start_loc, state_slots, self.device)
        h = self._embed(ids)
        n = h.shape[0]
        q_size, kv_size = heads * 2 * hd, kv_heads * hd
        shard = self.shard
        for layer in self.layers:
            x = layer.input_norm(h)
            if isinstance(layer, LinearLayer):
                out = layer.mixer(x, conv[layer.state], delta[layer.state], rows)
            else:
                cache = self.kv_caches[layer.cache]
                proj = layer.qkv(x)
                qg = proj[:, :q_size].view(n, heads, 2 * hd)
                gate = qg[:, :, hd:].reshape(n, heads * hd)
                q = apply_rope(layer.q_norm(qg[:, :, :hd]), cos, sin)
                k = apply_rope(layer.k_norm(proj[:, q_size : q_size + kv_size].view(
                    n, kv_heads, hd)), cos, sin)
                v = proj[:, q_size + kv_size :].reshape(n, kv_heads, hd)
                paged.write_kv(cache, plan, k, v)
                o = attn.forward(q, k, v, cache, plan, layer.scale)
                out = layer.o(o * torch.sigmoid(gate))
            if shard is not None:
                shard.all_reduce(out)  # row-parallel: the ranks' partial sums
            h = h + out
            mlp = layer.mlp(layer.post_norm(h))
            if shard is not None:
                shard.all_reduce(mlp)
            h = h + mlp
        self._state_saves(state_slots, state_save)
        return h


def language_model_names(names: dict[str, str]) -> dict[str, str]:
    """``names`` (a text checkpoint's) as a multimodal checkpoint holds them, under
    ``model.language_model.``."""
    return {k: v.replace("model.", "model.language_model.", 1) for k, v in names.items()}


class Qwen3_5TextOfMultimodal(Qwen3_5ForCausalLM):
    """The text part of a ``qwen3_5`` (image, video and text) checkpoint: its
    ``text_config`` and its ``model.language_model.*`` tensors; the vision tower and the
    multi-token-prediction head are not loaded."""

    model_types = ("qwen3_5",)
    architectures = ("Qwen3_5ForConditionalGeneration",)
    hf_names = language_model_names(_NAMES)
    gguf_architecture = None
    #: The family that reads the ``text_config``.
    text_family: ClassVar[type[Qwen3_5ForCausalLM]] = Qwen3_5ForCausalLM

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        text = dict(cfg.get("text_config") or {})
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
        for key in ("bos_token_id", "eos_token_id"):
            if key in cfg:
                text.setdefault(key, cfg[key])
        family = cls.text_family
        config = family.config_from_hf({**text, "model_type": family.model_types[0]})
        config.model_type = cls.model_types[0]
        return config
