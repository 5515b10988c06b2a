"""The shared decoder with mixture-of-experts MLPs (``layers/moe.py``) where the family puts
them: what Qwen3-MoE, Qwen2-MoE, Mixtral and OLMoE add to a dense family.

A family says, in its config reader, how many experts there are, how many each token takes
and whether their weights are renormalised, which layers are sparse (the Qwen MoEs can keep
some dense), and whether a gated shared expert runs beside them; and, in its
``moe_names``, what its checkpoint calls the router and the experts' projections (one
tensor per expert and projection, as transformers' ``save_pretrained`` writes them; a
checkpoint of transformers' fused ``[experts, ...]`` tensors is read through
:class:`FusedExperts`).

Tensor parallelism splits each expert's intermediate rows (and the shared expert's) across
the ranks as the dense MLP's are split; the router is replicated, so every rank picks the
same experts, and the layer's partial outputs join in the all-reduce a dense MLP has.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from iron_batch.layers.decoder_stack import stacks_moe
from iron_batch.layers.linear import Linear
from iron_batch.layers.mlp import GatedMLP
from iron_batch.layers.moe import MoE, Router, stacked
from iron_batch.layers.weights import LoadContext, Part, WeightSource
from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel
from iron_batch.models.partition import ShardPlan, TensorParallelError

if TYPE_CHECKING:
    from iron_batch.layers.quant import QuantWeight
    from iron_batch.loader.gguf import GGUFMetadata

#: What a Qwen-style checkpoint calls a sparse layer's tensors (``{i}``: layer, ``{e}``:
#: expert).
MOE_NAMES = {
    "router": "model.layers.{i}.mlp.gate.weight",
    "expert_gate": "model.layers.{i}.mlp.experts.{e}.gate_proj.weight",
    "expert_up": "model.layers.{i}.mlp.experts.{e}.up_proj.weight",
    "expert_down": "model.layers.{i}.mlp.experts.{e}.down_proj.weight",
    "shared_gate_proj": "model.layers.{i}.mlp.shared_expert.gate_proj.weight",
    "shared_up": "model.layers.{i}.mlp.shared_expert.up_proj.weight",
    "shared_down": "model.layers.{i}.mlp.shared_expert.down_proj.weight",
    "shared_expert_gate": "model.layers.{i}.mlp.shared_expert_gate.weight",
}


#: One expert's projection, by its per-expert name: (the experts' prefix, expert, projection).
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class FusedExperts:
    """A source whose per-expert names (``...experts.{e}.gate_proj.weight``) also read
    transformers' fused tensors, where the checkpoint holds those instead (the released
    Qwen3.5-MoE checkpoints): ``...experts.gate_up_proj`` ``[experts, 2I, H]`` (each
    expert's gate rows, then its up rows) and ``...experts.down_proj`` ``[experts, H, I]``.
    Only the asked expert's slice is read. Other names pass through."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source

    def tensor(self, part: Part) -> torch.Tensor | None:
        t = self.source.tensor(part)
        m = _PER_EXPERT.match(part.name)
        if t is not None or m is None:
            return t
        prefix, e, proj = m.group(1), int(m.group(2)), m.group(3)
        fused = "down_proj" if proj == "down_proj" else "gate_up_proj"
        whole = self.source.tensor(Part(f"{prefix}.{fused}", rows=slice(e, e + 1)))
        if whole is None:
            return None
        w = whole[0]
        if proj != "down_proj":
            half = w.shape[0] // 2
            w = w[:half] if proj == "gate_proj" else w[half:]
        if part.rows is not None:
            w = w[part.rows]
        if part.cols is not None:
            w = w[:, part.cols]
        return w.contiguous()

    def quantized(self, part: Part) -> QuantWeight | None:
        return self.source.quantized(part)


def gguf_moe_names(names: dict[str, str]) -> dict[str, str]:
    """llama.cpp's names of a sparse layer's tensors -> the HF names of ``names`` (a
    family's ``moe_names``). The experts are stacked, one ``[experts, rows, cols]`` tensor
    per projection; each maps to the per-expert name with ``{e}`` left in it, and the GGUF
    source reads expert ``e``'s slice of it (``loader/gguf.py``)."""
    return {
        "blk.{i}.ffn_gate_inp.weight": names["router"],
        "blk.{i}.ffn_gate_exps.weight": names["expert_gate"],
        "blk.{i}.ffn_up_exps.weight": names["expert_up"],
        "blk.{i}.ffn_down_exps.weight": names["expert_down"],
        "blk.{i}.ffn_gate_shexp.weight": names["shared_gate_proj"],
        "blk.{i}.ffn_up_shexp.weight": names["shared_up"],
        "blk.{i}.ffn_down_shexp.weight": names["shared_down"],
        "blk.{i}.ffn_gate_inp_shexp.weight": names["shared_expert_gate"],
    }


def gguf_expert_config(cfg: dict[str, Any], meta: GGUFMetadata, *, renormalize: bool,
                       expert_size: int) -> dict[str, Any]:
    """``cfg`` with the expert keys llama.cpp's converter writes (``expert_count``,
    ``expert_used_count``, ``expert_feed_forward_length``, ``expert_shared_...``), as the
    Qwen-style HF keys. ``renormalize``: whether llama.cpp's graph for the architecture
    renormalises the chosen weights (its ``expert_weights_norm`` key, where written, says
    so instead); ``expert_size``: an expert's rows where ``expert_feed_forward_length`` is
    not written (llama.cpp's default for the architecture). Gating other than softmax and
    a weight scale are refused by name."""
    experts = int(meta.require("expert_count"))
    used = int(meta.require("expert_used_count"))
    gating = meta.get("expert_gating_func")
    if gating not in (None, 1):  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise meta.refuse("expert_gating_func", gating, "1 (softmax)")
    scale = meta.get("expert_weights_scale")
    if scale not in (None, 0.0, 1.0):
        raise meta.refuse("expert_weights_scale", scale, "1.0")
    inter = meta.get("expert_feed_forward_length") or expert_size
    out = {**cfg, "num_experts": experts, "num_experts_per_tok": used,
           "moe_intermediate_size": int(inter),
           "norm_topk_prob": bool(meta.get("expert_weights_norm", renormalize))}
    shared = meta.get("expert_shared_feed_forward_length")
    if shared:
        out["shared_expert_intermediate_size"] = int(shared)
    return out


@dataclass
class MoEConfig(ModelConfig):
    num_experts: int = 0
    #: Experts each token takes.
    top_k: int = 1
    #: Rows of each expert's gate and up projections.
    expert_intermediate_size: int = 0
    #: The chosen experts' weights are divided by their sum.
    norm_topk_prob: bool = False
    #: Per layer, whether its MLP is sparse (None: every layer's is).
    moe_layers: list[bool] | None = None
    #: Rows of the shared expert (None: no shared expert), and whether a sigmoid gate
    #: scales its output.
    shared_intermediate_size: int | None = None
    shared_expert_gated: bool = True
    #: The routing weights stay float32 (Mixtral) instead of the compute dtype.
    routing_weights_in_float: bool = False

    def is_sparse(self, i: int) -> bool:
        return self.moe_layers is None or self.moe_layers[i]


def sparse_layers(cfg: dict[str, Any], num_experts: int) -> list[bool]:
    """The Qwen MoEs' sparse layers: those not in ``mlp_only_layers`` whose index + 1 is a
    multiple of ``decoder_sparse_step`` (transformers' rule)."""
    dense = set(cfg.get("mlp_only_layers") or [])
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    return [i not in dense and num_experts > 0 and (i + 1) % step == 0
            for i in range(cfg["num_hidden_layers"])]


def _even_range(total: int, rank: int, world: int) -> range:
    base, extra = divmod(total, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


class MoEDecoderModel(DecoderModel):
    moe_names: ClassVar[dict[str, str]] = MOE_NAMES
    #: The family's GGUF files carry another family's ``general.architecture`` and are
    #: told apart by their ``expert_count`` (``models/registry.py``).
    gguf_shares_architecture: ClassVar[bool] = False

    def _sparse_mlp(self, ctx: LoadContext, i: int, plan: ShardPlan | None) -> MoE | None:
        c = self.config
        assert isinstance(c, MoEConfig)
        if not c.is_sparse(i):
            return None
        ctx = replace(ctx, source=FusedExperts(ctx.source))
        n = {k: v.replace("{i}", str(i)) for k, v in self.moe_names.items()}
        inter = c.expert_intermediate_size
        rows = self._rows(inter, plan)
        gate_up_parts, down_parts = [], []
        for e in range(c.num_experts):
            gate_up_parts += [Part(n["expert_gate"].format(e=e), rows=rows),
                              Part(n["expert_up"].format(e=e), rows=rows)]
            down_parts.append(Part(n["expert_down"].format(e=e), cols=rows))
        gate_up = stacked(Linear.load(ctx, gate_up_parts), c.num_experts, ctx.kernels)
        down = stacked(Linear.load(ctx, down_parts), c.num_experts, ctx.kernels)
        router = Router(ctx.need(Part(n["router"])), c.top_k, renormalize=c.norm_topk_prob,
                        weights_in_float=c.routing_weights_in_float, kernels=ctx.kernels)
        shared = shared_gate = None
        if c.shared_intermediate_size:
            srows = self._rows(c.shared_intermediate_size, plan)
            shared = GatedMLP(
                Linear.load(ctx, [Part(n["shared_gate_proj"], rows=srows),
                                  Part(n["shared_up"], rows=srows)]),
                Linear.load(ctx, [Part(n["shared_down"], cols=srows)]),
                c.hidden_act)
            if c.shared_expert_gated:
                # [1, hidden] (GGUF files hold it as a vector).
                shared_gate = ctx.need(Part(n["shared_expert_gate"])).reshape(1, -1).contiguous()
        moe = MoE(router, gate_up, down, c.hidden_act, shared=shared,
                  shared_gate=shared_gate, kernels=ctx.kernels)
        if not stacks_moe(moe):
            # Decode steps take the layer path (the one-call stack cannot describe it).
            self.one_call_decode = False
        return moe

    @staticmethod
    def _rows(total: int, plan: ShardPlan | None) -> slice | None:
        """This rank's rows of an expert's ``total`` intermediate rows (None: all)."""
        if plan is None:
            return None
        if total < plan.world:
            raise TensorParallelError(f"cannot split experts of {total} rows over "
                                      f"{plan.world} ranks")
        r = _even_range(total, plan.rank, plan.world)
        return slice(r.start, r.stop)
