"""Which part of a model each tensor-parallel rank holds: data, read by the layers as they
load (``models/decoder.py``) and by the launcher (``iron_batch.parallel``).

Megatron-style: q/k/v and gate/up are split by output rows (column-parallel), o and down by
input columns (row-parallel, their partial outputs summed by one all-reduce each), the
embedding and the LM head by vocabulary rows (vocab-parallel: ids outside a rank's range
embed as zeros before the all-reduce; the head's logit shards are gathered on rank 0).

Heads are split whole and by KV group, so a rank's query heads always attend to the KV heads
it holds. With at least as many KV heads as ranks, the KV heads are cut into contiguous,
near-equal runs (SmolLM2's 9 query / 3 KV heads on 2 ranks: 6+3 query heads, 2+1 KV heads;
ranks may then differ in KV cache size, hence the allocator's minimum over ranks). With fewer
KV heads than ranks, each KV head is replicated on ``world / kv_heads`` ranks that split its
query group. The MLP's intermediate rows are cut near-equally; the vocabulary is padded to a
multiple of the world size (padded rows are zeros and their logits are dropped on rank 0).
A family whose layers differ in KV heads derives each layer's KV heads from the rank's
query heads (:func:`kv_heads_for`) and refuses, through its config's ``check_split``, a
world size where some layer's cannot be paired.
"""

from __future__ import annotations

from dataclasses import dataclass

from iron_batch.models.config import ModelConfig


class TensorParallelError(ValueError):
    """A world size this model cannot be split by, or options TP does not support."""


@dataclass(frozen=True)
class ShardPlan:
    rank: int
    world: int
    q_heads: range  # global query head indices held by this rank
    kv_heads: range  # global KV head indices held by this rank
    intermediate: range  # MLP intermediate rows
    vocab_start: int
    vocab_rows: int  # rows of the (padded) vocabulary shard, the same on every rank

    @property
    def num_heads(self) -> int:
        return len(self.q_heads)

    @property
    def num_kv_heads(self) -> int:
        return len(self.kv_heads)


def even_ranges(total: int, world: int) -> list[range]:
    base, extra = divmod(total, world)
    out, start = [], 0
    for r in range(world):
        size = base + (1 if r < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def plan_shards(config: ModelConfig, world: int) -> list[ShardPlan]:
    """Every rank's plan; raises TensorParallelError (one line) when the model cannot be
    split ``world`` ways."""
    c = config
    if world < 1:
        raise TensorParallelError(f"tensor parallel size must be >= 1, got {world}")
    own_check = getattr(c, "check_split", None)
    if world > 1 and own_check is not None:
        own_check(world)  # a family's own layers (Qwen3.5's linear-attention heads)
    q_ranges, kv_ranges = head_ranges(c, world)
    if c.intermediate_size < world:
        raise TensorParallelError(
            f"cannot split an MLP of {c.intermediate_size} rows over {world} ranks")
    inter = even_ranges(c.intermediate_size, world)
    rows = -(-c.vocab_size // world)
    return [
        ShardPlan(r, world, q_ranges[r], kv_ranges[r], inter[r], r * rows, rows)
        for r in range(world)
    ]


def head_ranges(c: ModelConfig, world: int) -> tuple[list[range], list[range]]:
    """Per rank: the query heads it holds and the KV heads they attend to (one line of
    TensorParallelError where the heads cannot be split ``world`` ways)."""
    heads, kv = c.num_heads, c.num_kv_heads
    group = heads // kv
    name = f"{c.model_type} ({heads} query heads, {kv} KV heads)"
    if world > heads:
        raise TensorParallelError(
            f"cannot split {name} over {world} ranks: more ranks than query heads")
    q_ranges: list[range] = []
    kv_ranges: list[range] = []
    if kv >= world:
        for run in even_ranges(kv, world):
            kv_ranges.append(run)
            q_ranges.append(range(run.start * group, run.stop * group))
    else:
        per_kv = world // kv
        if world % kv or group % per_kv:
            raise TensorParallelError(
                f"cannot split {name} over {world} ranks: with fewer KV heads than ranks, "
                f"the ranks must divide evenly among the KV heads and their query groups")
        q_per_rank = group // per_kv
        for r in range(world):
            kv_ranges.append(range(r // per_kv, r // per_kv + 1))
            q_ranges.append(range(r * q_per_rank, (r + 1) * q_per_rank))
    return q_ranges, kv_ranges


def kv_heads_for(q_heads: range, heads: int, kv_heads: int) -> range | None:
    """The KV heads that the query heads ``q_heads`` attend to, where ``heads`` query
    heads share ``kv_heads`` KV heads in equal consecutive groups; None where a rank
    holding just these could not pair them the way its attention does: its j-th query
    head with its (j // (query heads / KV heads))-th KV head (Gemma 4's layers, whose KV
    heads differ in number, each take their own)."""
    if kv_heads < 1 or heads % kv_heads or not q_heads:
        return None
    group = heads // kv_heads
    kv = range(q_heads.start // group, (q_heads.stop - 1) // group + 1)
    if len(q_heads) % len(kv):
        return None
    local = len(q_heads) // len(kv)
    if any(q // group - kv.start != j // local for j, q in enumerate(q_heads)):
        return None
    return kv

