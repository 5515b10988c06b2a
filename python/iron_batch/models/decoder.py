"""The dense decoder every family file builds on: embedding, a stack of pre-norm layers
(attention with fused q/k/v, a gated MLP), the final norm and the LM head, over one
flattened, paged batch of mixed prompt chunks and decodes.

A family (``models/llama.py``, ``qwen2.py``, ...) is a subclass that says how its HF config
reads (:meth:`DecoderModel.config_from_hf`) and how its checkpoint names its tensors (HF
and GGUF); the layers come from ``iron_batch.layers``, the attention from an
``iron_batch.attention`` backend chosen for the device. Only the rows that will be sampled
reach the final norm and the LM head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import numpy as np
import torch

from iron_batch.attention import backend as attention_backends
from iron_batch.attention import kv_int8
from iron_batch.layers import STATE_DTYPES, cpu_kernels, decoder_stack, quant
from iron_batch.layers.embedding import Embedding, LMHead, VocabParallel
from iron_batch.layers.linear import Linear, f32_copies_fit
from iron_batch.layers.mlp import GatedMLP
from iron_batch.layers.moe import MoE
from iron_batch.layers.norm import HeadNorm, ProjectionNorm, RMSNorm
from iron_batch.layers.rotary import RotaryEmbedding
from iron_batch.layers.weights import LoadContext, Part, WeightSource
from iron_batch.models.config import ModelConfig
from iron_batch.models.partition import ShardPlan
from iron_batch.platform import cpu, heap, huge_pages
from iron_batch.platform import switches as tuning

if TYPE_CHECKING:
    from iron_batch.loader.gguf import GGUFMetadata


class Shard(Protocol):
    """This process's part of a tensor-parallel model (``iron_batch.parallel``): its plan
    (which heads, MLP rows and vocabulary rows it holds) and the collectives that join
    the parts."""

    @property
    def plan(self) -> ShardPlan: ...

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over the ranks, in place."""
        ...

    def gather_logits(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0: the vocabulary shards joined along the last dimension; others: ``t``."""
        ...


#: Where a layout puts each of a layer's norms: the layer's slot -> the ``hf_names`` key of
#: the checkpoint tensor (see ``ModelConfig.norm_layout``).
NORM_LAYOUTS: dict[str, dict[str, str]] = {
    "pre": {"input_norm": "input_norm", "post_norm": "post_norm"},
    "sandwich": {"input_norm": "input_norm", "attn_out_norm": "post_norm",
                 "post_norm": "pre_mlp_norm", "mlp_out_norm": "post_mlp_norm"},
    "post": {"attn_out_norm": "post_norm", "mlp_out_norm": "post_mlp_norm"},
}

#: A q/k norm: per head, or over the whole projection.
QKNorm = HeadNorm | ProjectionNorm


@dataclass
class DecoderLayer:
    """One decoder layer: attention with fused q/k/v, a gated MLP, and RMSNorms where the
    family puts them: ``input_norm`` before attention, ``attn_out_norm`` on its output,
    ``post_norm`` before the MLP, ``mlp_out_norm`` on its output (None where absent)."""

    input_norm: RMSNorm | None
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim, hidden]
    q_norm: QKNorm | None
    k_norm: QKNorm | None
    o: Linear
    post_norm: RMSNorm | None
    #: The dense gated MLP, or a mixture of experts (``layers/moe.py``).
    mlp: GatedMLP | MoE
    #: Keys further back than this are not attended by the layer (None: every position).
    sliding_window: int | None = None
    attn_out_norm: RMSNorm | None = None
    mlp_out_norm: RMSNorm | None = None
    #: Rotated leading dimensions of each head (0: the layer has no rotary).
    rotary_dim: int = 0
    #: Which of the model's rotary tables the layer rotates by.
    rope_table: int = 0
    #: Attention score scale, and tanh soft-capping of the scores (None: none).
    scale: float = 1.0
    softcap: float | None = None
    #: Attention and MLP outputs are multiplied by this before joining the residual.
    residual_scale: float = 1.0
    #: The cache group whose blocks hold the layer's K/V (see ``DecoderModel.cache_groups``).
    cache_group: int = 0
    #: Per query head, a learned logit in the softmax's denominator (gpt-oss; float32
    #: [heads], None: none).
    sinks: torch.Tensor | None = None


#: The Hugging Face tensor names of a Llama-style checkpoint (``{i}``: the layer index).
HF_NAMES = {
    "embed": "model.embed_tokens.weight",
    "norm": "model.norm.weight",
    "lm_head": "lm_head.weight",
    "input_norm": "model.layers.{i}.input_layernorm.weight",
    "q": "model.layers.{i}.self_attn.q_proj",
    "k": "model.layers.{i}.self_attn.k_proj",
    "v": "model.layers.{i}.self_attn.v_proj",
    "o": "model.layers.{i}.self_attn.o_proj",
    "q_norm": "model.layers.{i}.self_attn.q_norm.weight",
    "k_norm": "model.layers.{i}.self_attn.k_norm.weight",
    "post_norm": "model.layers.{i}.post_attention_layernorm.weight",
    # Gemma's norm before the MLP, and Gemma's and OLMo 2's norm on the MLP's output.
    "pre_mlp_norm": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "post_mlp_norm": "model.layers.{i}.post_feedforward_layernorm.weight",
    "gate": "model.layers.{i}.mlp.gate_proj",
    "up": "model.layers.{i}.mlp.up_proj",
    "down": "model.layers.{i}.mlp.down_proj",
}

#: llama.cpp's GGUF names of the same tensors, as its converter writes them for the
#: Llama-style architectures (``blk.N.`` for layer N).
GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def check_state_dtype(state_dtype: str) -> str:
    """``state_dtype`` if it is one of :data:`STATE_DTYPES`; ValueError otherwise."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"recurrent state dtype {state_dtype!r} is not one of "
                         f"{', '.join(STATE_DTYPES)}")
    return state_dtype


class DecoderModel:
    #: HF ``model_type`` values the family serves, and its ``architectures`` names.
    model_types: ClassVar[tuple[str, ...]] = ()
    architectures: ClassVar[tuple[str, ...]] = ()
    #: llama.cpp's ``general.architecture`` for this family's GGUF files (None: none).
    gguf_architecture: ClassVar[str | None] = None
    #: Whether llama.cpp's converter permutes this family's q/k rows (interleaved rope
    #: pairs; the loader undoes it so the model has one rope layout).
    gguf_permutes_qk: ClassVar[bool] = False
    #: llama.cpp's converter stored this family's norm weights with the config's offset
    #: already added (Gemma's ``1 + w``).
    gguf_norm_offset_applied: ClassVar[bool] = False
    #: ``rope.scaling.type`` values of this family's GGUF files its ``hf_config_from_gguf``
    #: reads, besides "none" and "linear" (which every family reads the same way).
    gguf_rope_scaling_types: ClassVar[tuple[str, ...]] = ()
    hf_names: ClassVar[dict[str, str]] = HF_NAMES
    gguf_names: ClassVar[dict[str, str]] = GGUF_NAMES
    #: Whether ``layers/decoder_stack.py`` can describe the family's layers (False: its
    #: decode steps take the layer-by-layer Python path whatever the switches say). A
    #: family may set it per model in ``_load``, where some checkpoints have layers the
    #: stack does not describe.
    one_call_decode: bool = True

    @classmethod
    def config_from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        """The architecture settings of an HF ``config.json`` of this family."""
        raise NotImplementedError

    @classmethod
    def hf_config_from_gguf(cls, cfg: dict[str, Any], meta: GGUFMetadata) -> dict[str, Any]:
        """``cfg`` (the HF-style config of the keys every llama.cpp architecture writes the
        same way: ``loader/gguf.py``) with what this family's GGUF metadata adds, as the
        HF config keys ``config_from_hf`` reads. Refuse, by name, a key it does not run."""
        return cfg

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
        """``shard``: this rank's part of a tensor-parallel model (each layer then reads
        only its slices of ``source``); None for the whole model."""
        quant.check_mode(quantization, device, dtype)
        c = self.config = config
        self.device = device
        self.dtype = dtype
        self.quantization = quantization
        self.shard = shard
        #: The tuning switches in force, read once here (see ``platform/switches.py``).
        self.switches = tuning.read()
        kernels = self.kernels = cpu.select(device, dtype, self.switches)
        plan = shard.plan if shard is not None else None
        #: Query and KV heads this process holds (all of them without tensor parallelism).
        self.num_heads = c.num_heads if plan is None else plan.num_heads
        self.num_kv_heads = c.num_kv_heads if plan is None else plan.num_kv_heads
        ctx = LoadContext(source, device, dtype, quantization, kernels)
        self.attention = attention_backends.select(device, dtype, kernels)
        if device.type == "cpu" and kernels.keep_freed_memory:
            heap.keep_freed_memory()
        if device.type == "cpu" and kernels.one_malloc_arena:
            heap.one_arena()
        self._load(ctx, plan)
        #: Checkpoint tensors that --quantization gguf had to dequantize (unsupported types).
        self.dequantized = ctx.dequantized
        if kernels.huge_pages:
            self._weights_to_huge_pages()
        if kernels.prepack and quantization is None:
            f32_copy = f32_copies_fit(self._linears(head=True),
                                      plan.world if plan is not None else 1)
            for linear in self._linears():
                linear.prepack(f32_copy)
            self.lm_head.prepack(f32_copy)
        # Decode steps with few rows: every layer in one Rust call (see decoder_stack).
        self.decoder: decoder_stack.DecoderStack | None = None
        if shard is None and kernels.decoder and self.one_call_decode:
            self.decoder = decoder_stack.DecoderStack(
                self.layers, hidden=c.hidden_size, heads=self.num_heads,
                kv_heads=self.num_kv_heads, head_dim=c.head_dim, eps=c.rms_norm_eps,
                quant_gemv_rows=kernels.quant_gemv_rows,
            )
        #: Rotary tables: the global layers', then the sliding layers' where their base
        #: differs (``DecoderLayer.rope_table`` picks one).
        rotary_dim = c.rotary_dim or c.head_dim
        self.rotaries = [RotaryEmbedding(rotary_dim, c.rope_theta, c.rope_scaling,
                                         device=device, dtype=dtype)]
        if c.local_rope is not None:
            self.rotaries.append(RotaryEmbedding(rotary_dim, *c.local_rope, device=device,
                                                 dtype=dtype))
        self.scale = self.layers[0].scale
        self.kv_caches: list[torch.Tensor] = []
        self.block_size = 0
        #: How K/V are stored (``attention/kv_int8.py``): "auto" (the model's dtype) or
        #: "int8"; set by :meth:`set_kv_cache_dtype` before the cache is allocated.
        self.kv_cache_dtype = "auto"

    # ---------------------------------------------------------------- loading

    def _sparse_mlp(self, ctx: LoadContext, i: int, plan: ShardPlan | None) -> MoE | None:
        """Layer ``i``'s mixture of experts, or None where it has the dense gated MLP (every
        layer of a dense family; the MoE families override this: ``models/moe_decoder.py``)."""
        return None

    def _load(self, ctx: LoadContext, plan: ShardPlan | None) -> None:
        c = self.config
        names = self.hf_names
        d = c.head_dim
        # Column-parallel rows and row-parallel columns of this rank (None: whole).
        q_rows = kv_rows = inter = vocab = None
        if plan is not None:
            q_rows = slice(plan.q_heads.start * d, plan.q_heads.stop * d)
            kv_rows = slice(plan.kv_heads.start * d, plan.kv_heads.stop * d)
            inter = slice(plan.intermediate.start, plan.intermediate.stop)
            vocab = slice(plan.vocab_start, plan.vocab_start + plan.vocab_rows)
        fused = ctx.kernels.fused

        def col(name: str, rows: slice | None) -> Part:
            return Part(name, rows=rows)

        def row(name: str, cols: slice | None) -> Part:
            return Part(name, cols=cols)

        def row_bias(name: str) -> torch.Tensor:
            bias = ctx.need(Part(name))
            if plan is not None and plan.rank != 0:
                # Added once to the sum of the partial outputs: by rank 0 alone.
                bias = torch.zeros_like(bias)
            return bias

        # The most rows the MLP takes at once on CPU, so that its widest activation stays
        # a heap block (see GatedMLP); this process's gate/up rows (a tensor-parallel rank
        # holds a slice of them).
        mlp_rows = None
        if ctx.device.type == "cpu":
            width = 2 * (c.intermediate_size if inter is None else inter.stop - inter.start)
            mlp_rows = max(64, heap.HEAP_BLOCK // (width * ctx.dtype.itemsize) // 64 * 64)

        #: Cache groups, in the scheduler's order: ("full", None) and/or ("sliding", W).
        windows = [c.layer_window(i) for i in range(c.num_layers)]
        self.cache_groups: list[tuple[str, int | None]] = []
        if any(w is None for w in windows):
            self.cache_groups.append(("full", None))
        for w in sorted({w for w in windows if w is not None}):
            self.cache_groups.append(("sliding", w))
        scale = c.attention_scale if c.attention_scale is not None else c.head_dim**-0.5
        qk_reduce = None
        if self.shard is not None and c.qk_norm == "projection":
            qk_reduce = self.shard.all_reduce
        layout = NORM_LAYOUTS[c.norm_layout]
        # A GGUF converter that adds the offset to the norm weights stored them as used.
        offset = c.norm_weight_offset
        if self.gguf_norm_offset_applied and getattr(ctx.source, "is_gguf", False):
            offset = 0.0

        def norm(name: str) -> RMSNorm:
            weight = ctx.need(Part(name))
            if offset:
                weight = (ctx.need_float(Part(name)) + offset).to(weight)
            return RMSNorm(weight, c.rms_norm_eps, fused=fused)

        def qk_norm(name: str, heads: int, total_heads: int) -> QKNorm:
            weight = ctx.need(Part(name))
            if offset:
                weight = (ctx.need_float(Part(name)) + offset).to(weight)
            if c.qk_norm == "head":
                return HeadNorm(weight, c.rms_norm_eps, fused=fused)
            rows = None
            if plan is not None:  # this rank's heads of the whole-projection weight
                first = (plan.q_heads if heads == self.num_heads else plan.kv_heads).start
                rows = slice(first * d, (first + heads) * d)
            if rows is not None:
                weight = weight[rows].contiguous()
            return ProjectionNorm(weight, c.rms_norm_eps, width=total_heads * d,
                                  all_reduce=qk_reduce, fused=fused)

        q_total, kv_total = c.num_heads * d, c.num_kv_heads * d

        def fused_rows(rows: slice | None, offset: int, total: int) -> slice:
            """Rows of one of the tensors stacked in a fused checkpoint tensor."""
            r = rows if rows is not None else slice(0, total)
            return slice(offset + r.start, offset + r.stop)

        def dense_mlp(n: dict[str, str]) -> GatedMLP:
            gate_up_bias = None
            if c.mlp_bias:
                gate_up_bias = [col(n["gate"] + ".bias", inter), col(n["up"] + ".bias", inter)]
            down = Linear.load(ctx, [row(n["down"] + ".weight", inter)])
            if c.mlp_bias:
                down.bias = row_bias(n["down"] + ".bias")
            if "gate_up" in n:  # one checkpoint tensor, gate rows then up rows (Phi-3)
                w = n["gate_up"] + ".weight"
                size = c.intermediate_size
                gate_up_parts = [col(w, fused_rows(inter, 0, size)),
                                 col(w, fused_rows(inter, size, size))]
            else:
                gate_up_parts = [col(n["gate"] + ".weight", inter),
                                 col(n["up"] + ".weight", inter)]
            gate_up = Linear.load(ctx, gate_up_parts, biases=gate_up_bias)
            return GatedMLP(gate_up, down, c.hidden_act, max_rows=mlp_rows, fused=fused)

        self.layers: list[DecoderLayer] = []
        for i in range(c.num_layers):
            n = {k: v.format(i=i) for k, v in names.items()}
            qkv_bias = None
            if c.qkv_bias:
                qkv_bias = [col(n["q"] + ".bias", q_rows), col(n["k"] + ".bias", kv_rows),
                            col(n["v"] + ".bias", kv_rows)]
            o = Linear.load(ctx, [row(n["o"] + ".weight", q_rows)])
            if c.o_bias:
                o.bias = row_bias(n["o"] + ".bias")
            mlp = self._sparse_mlp(ctx, i, plan)
            if mlp is None:
                mlp = dense_mlp(n)
            if "qkv" in n:  # one checkpoint tensor, q rows then k then v (Phi-3)
                w = n["qkv"] + ".weight"
                qkv_parts = [col(w, fused_rows(q_rows, 0, q_total)),
                             col(w, fused_rows(kv_rows, q_total, kv_total)),
                             col(w, fused_rows(kv_rows, q_total + kv_total, kv_total))]
            else:
                qkv_parts = [col(n["q"] + ".weight", q_rows), col(n["k"] + ".weight", kv_rows),
                             col(n["v"] + ".weight", kv_rows)]
            norms = {slot: norm(n[key]) for slot, key in layout.items()}
            window = windows[i]
            self.layers.append(DecoderLayer(
                input_norm=norms.get("input_norm"),
                qkv=Linear.load(ctx, qkv_parts, biases=qkv_bias),
                q_norm=qk_norm(n["q_norm"], self.num_heads, c.num_heads) if c.qk_norm else None,
                k_norm=qk_norm(n["k_norm"], self.num_kv_heads, c.num_kv_heads)
                if c.qk_norm else None,
                o=o,
                post_norm=norms.get("post_norm"),
                mlp=mlp,
                sliding_window=window,
                attn_out_norm=norms.get("attn_out_norm"),
                mlp_out_norm=norms.get("mlp_out_norm"),
                rotary_dim=c.layer_rotary_dim(i),
                rope_table=1 if window is not None and c.local_rope is not None else 0,
                scale=scale,
                softcap=c.attn_softcap,
                residual_scale=c.residual_scale,
                cache_group=self.cache_groups.index(
                    ("full", None) if window is None else ("sliding", window)),
            ))
        # The final norm runs on the few sampled rows, by torch ops.
        self.norm = RMSNorm(norm(names["norm"]).weight, c.rms_norm_eps)
        parallel = None
        if plan is not None and self.shard is not None:
            parallel = VocabParallel(plan.vocab_start, plan.vocab_rows,
                                     self.shard.all_reduce, self.shard.gather_logits)
        tied = c.tie_word_embeddings
        head_name = names["embed"] if tied else names["lm_head"]
        head = Linear.load(ctx, [Part(head_name, rows=vocab)], head=True)
        self.lm_head = LMHead(head, c.vocab_size, parallel)
        # The embedding lookup reads the GGUF blocks when the tied head kept them; else a
        # dense table (--quantization int8/int4 quantize only the projections and the head).
        if tied and ctx.quantization in (None, "gguf"):
            table = head.weight
        elif ctx.quantization == "gguf":
            table = Linear.load(ctx, [Part(names["embed"], rows=vocab)]).weight
        else:
            table = ctx.need(Part(names["embed"], rows=vocab))
        self.embed = Embedding(table, parallel)

    def _linears(self, head: bool = False) -> list[Linear]:
        """Every projection (and the LM head): what a decode step streams from memory."""
        out = [lin for layer in self.layers
               for lin in (layer.qkv, layer.o, *layer.mlp.linears())]
        return out + [self.lm_head.linear] if head else out

    def _weights_to_huge_pages(self) -> None:
        """The projections and the LM head moved into one allocation on 2 MiB pages (see
        ``platform/huge_pages.py``): the same values. Each weight is replaced as soon as it
        is copied, so nothing here keeps its original."""
        linears = self._linears(head=True)
        arena = huge_pages.Arena(sum(
            huge_pages.Arena.size_of(t) for lin in linears for t in lin.tensors()))
        head = self.lm_head.linear
        tied = self.embed.table is head.weight
        for lin in linears:
            lin.replace_tensors([arena.place(t.contiguous()) for t in lin.tensors()])
        if tied:
            self.embed.table = head.weight

    def set_kv_cache_dtype(self, kv_cache_dtype: str) -> None:
        """Store K/V as ``kv_cache_dtype`` ("auto": the model's dtype; "int8": int8 rows
        with a float32 scale per token and head) in caches allocated from now on."""
        self.kv_cache_dtype = kv_int8.check(kv_cache_dtype)

    def _kv_row(self) -> tuple[int, torch.dtype]:
        """The last dimension of a cache and its dtype."""
        if self.kv_cache_dtype == "int8":
            return kv_int8.row_bytes(self.config.head_dim), torch.int8
        return self.config.head_dim, self.dtype

    def allocate_kv_cache(self, num_blocks: int | list[int], block_size: int) -> None:
        """Each layer's paged K/V: ``num_blocks`` blocks, or as many as its cache group's
        entry of the list (one per :attr:`cache_groups`)."""
        per_group = num_blocks if isinstance(num_blocks, list) else [num_blocks] * len(
            self.cache_groups)
        if len(per_group) != len(self.cache_groups):
            raise ValueError(f"{len(per_group)} block counts for {len(self.cache_groups)} "
                             "cache groups")
        self.kv_caches = []
        row, kv_dtype = self._kv_row()
        for layer in self.layers:
            shape = (2, per_group[layer.cache_group], block_size, self.num_kv_heads, row)
            self.kv_caches.append(
                huge_pages.zeros(shape, kv_dtype) if self.kernels.huge_pages
                else torch.zeros(shape, dtype=kv_dtype, device=self.device))
        self.block_size = block_size
        self.num_blocks_per_group = per_group
        if self.decoder is not None:
            self.decoder.set_caches(self.kv_caches, block_size)

    def kv_bytes_per_token(self) -> list[int]:
        """K/V bytes one token takes in each cache group (all its layers): int8 rows
        count their scales."""
        row, kv_dtype = self._kv_row()
        per_layer = 2 * self.num_kv_heads * row * kv_dtype.itemsize
        return [per_layer * sum(1 for layer in self.layers if layer.cache_group == g)
                for g in range(len(self.cache_groups))]

    def state_slot_bytes(self) -> int:
        """Bytes of one sequence's recurrent state (models with a "state" cache group)."""
        return 0

    def set_state_dtype(self, state_dtype: str) -> None:
        """Keep recurrent states as ``state_dtype`` (one of :data:`STATE_DTYPES`) in pools
        allocated from now on. Only models with a "state" cache group have a choice; for
        the others "float32" (the default) is accepted and anything else refused."""
        check_state_dtype(state_dtype)
        if state_dtype != "float32":
            raise ValueError(f"--recurrent-state-dtype {state_dtype}: "
                             f"{type(self).__name__} keeps no recurrent state")

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes of one block in every layer (every group's block of that index)."""
        return sum(self.kv_bytes_per_token()) * block_size

    # ---------------------------------------------------------------- the forward

    @torch.inference_mode()
    def forward(self, **batch: np.ndarray | torch.Tensor) -> torch.Tensor:
        """Float32 logits [len(sample_indices), vocab] for one flattened batch."""
        sample_indices = batch.pop("sample_indices")
        rows = len(batch["input_ids"])
        with cpu.few_rows(self.device, self.dtype, rows, cpu_kernels.BF16_GEMV_MAX_ROWS):
            h = self._hidden_states(**batch)  # type: ignore[arg-type]
            return self._logits(h, sample_indices)  # type: ignore[arg-type]

    @torch.inference_mode()
    def forward_with_hidden(
        self, hidden_rows: np.ndarray, **batch: np.ndarray | torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward``'s logits, and the final-normed hidden states (float32,
        ``[len(hidden_rows), hidden]``) of the token rows ``hidden_rows`` (embeddings)."""
        sample_indices = batch.pop("sample_indices")
        rows = len(batch["input_ids"])
        with cpu.few_rows(self.device, self.dtype, rows, cpu_kernels.BF16_GEMV_MAX_ROWS):
            h = self._hidden_states(**batch)  # type: ignore[arg-type]
            at = torch.from_numpy(np.ascontiguousarray(hidden_rows, dtype=np.int64))
            hidden = self.norm(h[at.to(self.device)]).float()
            return self._logits(h, sample_indices), hidden  # type: ignore[arg-type]

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
        """The residual stream after the last layer (before the final norm), every row.
        With more than one cache group, ``group_slot_mapping`` [G - 1, T] and
        ``group_block_tables`` [(G - 1) * S, B'] (absolute: column j is logical block j)
        hold the other groups' slots and tables."""
        c = self.config
        shard = self.shard
        heads, kv_heads = self.num_heads, self.num_kv_heads
        ids, ropes = self._ids_and_ropes(input_ids, positions)
        n = ids.shape[0]
        groups = self._group_tables(slot_mapping, block_tables, group_slot_mapping,
                                    group_block_tables, len(seq_lens))
        decoder = self.decoder
        if decoder is not None and 0 < n <= decoder.max_rows:
            lens, per_row = self._stack_rows(query_start_loc, seq_lens)
            h = self._embed(ids).contiguous()
            cos, sin = ropes[0]
            if len(groups) == 1 and len(ropes) == 1:
                decoder.decode(h, cos, sin, slot_mapping, per_row(block_tables), lens,
                               scale=self.scale)
            else:
                decoder.decode(h, cos, sin, slot_mapping, per_row(block_tables), lens,
                               scale=self.scale, ropes=ropes,
                               groups=[(slots, per_row(tables), lens) for slots, tables in groups])
            return h
        attn = self.attention
        plans = [
            attn.plan(
                query_start_loc=query_start_loc, seq_lens=seq_lens,
                num_computed_before=num_computed_before, block_tables=tables,
                slot_mapping=slots, block_size=self.block_size,
                group=heads // kv_heads, sliding_window=window,
            )
            for (slots, tables), (_kind, window) in zip(groups, self.cache_groups, strict=True)
        ]
        h = self._embed(ids)
        layers = self.layers
        first = layers[0].input_norm
        x = first(h) if first is not None else h
        for i, (layer, cache) in enumerate(zip(layers, self.kv_caches, strict=True)):
            plan = plans[layer.cache_group]
            cos, sin = ropes[layer.rope_table] if layer.rotary_dim else (None, None)
            q, k, v = attn.rotate_and_store(
                layer.qkv(x), heads=heads, kv_heads=kv_heads, head_dim=c.head_dim,
                cos=cos, sin=sin, q_norm=layer.q_norm, k_norm=layer.k_norm,
                cache=cache, plan=plan,
            )
            o = layer.o(attn.forward(q, k, v, cache, plan, layer.scale, layer.softcap,
                                       layer.sinks))
            if shard is not None:
                shard.all_reduce(o)  # row-parallel: the ranks' partial sums
            h, x = self._join(h, o, layer.attn_out_norm, layer.residual_scale, layer.post_norm)
            mlp = layer.mlp(x)
            if shard is not None:
                shard.all_reduce(mlp)
            after = layers[i + 1].input_norm if i + 1 < len(layers) else None
            h, x = self._join(h, mlp, layer.mlp_out_norm, layer.residual_scale, after)
        return h

    def _stack_rows(
        self, query_start_loc: np.ndarray, seq_lens: np.ndarray
    ) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
        """A step's rows as the decode stack takes them: each row's length, and a function
        from a group's block tables to each row's.

        Every row is a decode row of its own: row j of a sequence's q rows sees the
        sequence's first seq_len - q + j + 1 tokens (its earlier rows' K/V are stored
        before any row attends). A decode step, a sequence's last token with its proposed
        ones, or a short chunk of a prompt: each row's values are those a one-row decode
        step gives for that position."""
        q = np.diff(np.asarray(query_start_loc, dtype=np.int64))
        lens = (np.repeat(np.asarray(seq_lens, dtype=np.int64) - q, q)
                + _ranks(q) + 1).astype(np.int32)
        width = -(-int(lens.max()) // self.block_size)
        one_each = bool(np.all(q == 1))

        def per_row(tables: np.ndarray) -> np.ndarray:
            tables = np.asarray(tables)[:, :width]
            return tables if one_each else np.repeat(tables, q, axis=0)

        return lens, per_row

    def _ids_and_ropes(
        self, input_ids: np.ndarray | torch.Tensor, positions: np.ndarray
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """The step's token ids on the device, and each rotary table's rows at its
        positions."""
        dev = self.device
        if isinstance(input_ids, torch.Tensor):  # placeholders filled in on the device
            ids = input_ids.to(dev)
        else:
            ids = torch.from_numpy(np.ascontiguousarray(input_ids, dtype=np.int64)).to(dev)
        pos = torch.from_numpy(np.ascontiguousarray(positions, dtype=np.int64)).to(dev)
        largest = int(positions.max()) if len(positions) else 0
        return ids, [r.cos_sin(pos, largest) for r in self.rotaries]

    def _group_tables(
        self,
        slot_mapping: np.ndarray,
        block_tables: np.ndarray,
        group_slot_mapping: np.ndarray | None,
        group_block_tables: np.ndarray | None,
        num_seqs: int,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """(slots, block tables) of each cache group, in :attr:`cache_groups` order."""
        groups = [(slot_mapping, block_tables)]
        for g in range(1, len(self.cache_groups)):
            if group_slot_mapping is None or group_block_tables is None:
                raise ValueError(f"the model has {len(self.cache_groups)} cache groups: the "
                                 "batch needs the other groups' slots and block tables")
            groups.append((group_slot_mapping[g - 1],
                           group_block_tables[(g - 1) * num_seqs : g * num_seqs]))
        return groups

    @staticmethod
    def _join(
        h: torch.Tensor,
        delta: torch.Tensor,
        out_norm: RMSNorm | None,
        scale: float,
        next_norm: RMSNorm | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A sublayer's output ``delta`` joins the residual ``h`` (normed by ``out_norm``,
        scaled by ``scale`` first); returns the residual and the next sublayer's input
        (normed by ``next_norm``, or the residual itself)."""
        if out_norm is not None:
            delta = out_norm(delta)
        if scale != 1.0:
            delta = delta * scale
        if next_norm is not None:
            return next_norm.add(h, delta)
        h = h + delta
        return h, h

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        c = self.config
        if c.embedding_scale != 1.0:
            if c.embedding_scale_in_dtype:
                h = h * torch.tensor(c.embedding_scale, dtype=h.dtype)
            else:
                h = h * c.embedding_scale
        return h

    def _logits(self, h: torch.Tensor, sample_indices: np.ndarray) -> torch.Tensor:
        """Final norm and LM head over the rows of ``h`` to sample (and to score)."""
        rows = torch.from_numpy(np.ascontiguousarray(sample_indices, dtype=np.int64))
        logits = self.lm_head(self.norm(h[rows.to(self.device)]))
        c = self.config
        if c.logits_divisor != 1.0:
            logits = logits / c.logits_divisor
        if c.final_softcap is not None:
            logits = torch.tanh(logits / c.final_softcap) * c.final_softcap
        return logits


def _ranks(lengths: np.ndarray) -> np.ndarray:
    """0, 1, .., n - 1 for each n of ``lengths``, concatenated."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(int(lengths.sum())) - starts
