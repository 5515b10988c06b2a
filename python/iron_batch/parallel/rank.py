"""One rank of a tensor-parallel model: its shard plan joined to its process group, and the
set-up every rank runs the same way (group, shard, model, KV pool size agreed by all)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import torch

from iron_batch.loader import ModelSource, load_model
from iron_batch.models.config import ModelConfig
from iron_batch.models.decoder import DecoderModel
from iron_batch.models.partition import ShardPlan, plan_shards
from iron_batch.parallel.group import Rendezvous, TensorParallelGroup

logger = logging.getLogger(__name__)


class RankShard:
    """What a model needs to know of tensor parallelism (``models.decoder.Shard``)."""

    def __init__(self, plan: ShardPlan, group: TensorParallelGroup) -> None:
        self.plan = plan
        self.group = group

    def all_reduce(self, t: torch.Tensor) -> None:
        self.group.all_reduce(t)

    def gather_logits(self, t: torch.Tensor) -> torch.Tensor:
        return self.group.gather_logits(t)


def rank_device(device: torch.device, rendezvous: Rendezvous) -> torch.device:
    """CUDA ranks on one host take one GPU each (by local rank); CPU ranks share the CPU."""
    if device.type != "cuda":
        return device
    dev = torch.device("cuda", rendezvous.local_rank)
    torch.cuda.set_device(dev)
    return dev


def share_cores(local_world: int) -> int:
    """Give this rank its share of the host's cores (every rank of a host runs the same
    forward at the same time; more OpenMP threads than cores only spin). Returns the
    previous thread count."""
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(max(1, (cores or 1) // local_world))
    return before


@dataclass
class LoadedRank:
    model: DecoderModel
    group: TensorParallelGroup
    #: The KV pool in blocks, or one count per cache group (models with a state group).
    num_kv_blocks: int | list[int]


def load_rank(
    source: ModelSource,
    config: ModelConfig,
    rendezvous: Rendezvous,
    *,
    device: torch.device,
    dtype: torch.dtype,
    timeout_s: float,
    total_kv_blocks: int | None,
    kv_block_size: int,
    kv_cache_memory_gb: float | None,
    quantization: str | None = None,
    store: Any = None,
    kv_cache_dtype: str = "auto",
    recurrent_state_dtype: str = "float32",
) -> LoadedRank:
    """Join the group, load this rank's shard, and agree on the KV pool: each rank sizes it
    from its own memory and KV heads, the pool is the smallest of them (block ids are the
    scheduler's, the same on every rank). A model with a recurrent-state group sizes each
    group as the single-process backend does (its slots hold this rank's heads' state),
    each group's count the smallest over the ranks."""
    from iron_batch.backends.torch_backend import (
        group_blocks_for_memory,
        kv_blocks_for_memory,
        state_slots_for,
    )

    plan = plan_shards(config, rendezvous.world)[rendezvous.rank]
    group = TensorParallelGroup(rendezvous, device, timeout_s, store)
    try:
        model = load_model(source, device=device, dtype=dtype, quantization=quantization,
                           shard=RankShard(plan, group))
        model.set_kv_cache_dtype(kv_cache_dtype)
        model.set_state_dtype(recurrent_state_dtype)
        blocks: int | list[int]
        groups = model.cache_groups
        if any(kind == "state" for kind, _ in groups) or (
                len(groups) > 1 and total_kv_blocks is None):
            # Each group's blocks as a single process splits the budget (a sliding group
            # needs only its window's): the fewest any rank holds.
            sizes = ([state_slots_for(model, total_kv_blocks, kv_cache_memory_gb)
                      if kind == "state" else total_kv_blocks for kind, _ in groups]
                     if total_kv_blocks is not None
                     else group_blocks_for_memory(model, kv_block_size, kv_cache_memory_gb))
            blocks = [group.min_int(b) for b in sizes]
        else:
            blocks = total_kv_blocks or kv_blocks_for_memory(model, kv_block_size,
                                                             kv_cache_memory_gb)
            blocks = group.min_int(blocks)
    except BaseException:
        group.destroy()
        raise
    logger.info("tensor-parallel rank %d/%d: %d query heads, %d KV heads, %s KV blocks",
                rendezvous.rank, rendezvous.world, plan.num_heads, plan.num_kv_heads, blocks)
    return LoadedRank(model, group, blocks)
