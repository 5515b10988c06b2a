"""The process group of a tensor-parallel model: set-up, the collectives the forward pass
uses, and how long they took.

CPU ranks use gloo for everything. CUDA ranks use NCCL for the forward's collectives and a
gloo group beside it for the step broadcast, whose arrays live in host memory. Every
collective is bounded by the group's timeout, so a rank that hangs fails its peers' calls
instead of stalling them forever (a rank that dies fails them at once: its sockets close).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

#: Seconds one collective may wait for the other ranks (``--tp-timeout``).
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Rendezvous:
    """Where the ranks meet: a store rank 0 serves (locally spawned ranks, see
    :func:`serve_store`), or ``env://`` (torchrun sets MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE)."""

    rank: int
    world: int
    #: Ranks on this host (they share its cores) and this rank's index among them.
    local_world: int
    local_rank: int
    init_method: str = "env://"

    @classmethod
    def from_torchrun_env(cls) -> Rendezvous | None:
        """The torchrun rendezvous in the environment, or None outside torchrun."""
        if "WORLD_SIZE" not in os.environ or "RANK" not in os.environ:
            return None
        world = int(os.environ["WORLD_SIZE"])
        return cls(
            rank=int(os.environ["RANK"]),
            world=world,
            local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)),
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
            init_method="env://",
        )


_JOINED = "iron_batch/joined/"


def serve_store(world: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (``.port``), for spawned ranks."""
    return dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def join_store(address: str, rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    """A spawned rank's connection to rank 0's store, announcing that it has joined."""
    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), world, False, timedelta(seconds=timeout_s))
    store.set(f"{_JOINED}{rank}", "1")
    return store


def joined(store: dist.TCPStore, world: int) -> bool:
    """Whether every spawned rank has reached the store (rank 0 polls this, watching the
    processes meanwhile, instead of blocking in the group's set-up for the whole timeout
    when a rank died on its way)."""
    return bool(store.check([f"{_JOINED}{r}" for r in range(1, world)]))


class TensorParallelGroup:
    def __init__(self, rendezvous: Rendezvous, device: torch.device, timeout_s: float,
                 store: dist.Store | None = None) -> None:
        self.rank = rendezvous.rank
        self.world = rendezvous.world
        self.device = device
        self.timeout_s = timeout_s
        timeout = timedelta(seconds=timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if store is not None:
            dist.init_process_group(backend, store=store, rank=self.rank,
                                    world_size=self.world, timeout=timeout)
        else:
            dist.init_process_group(backend, init_method=rendezvous.init_method,
                                    rank=self.rank, world_size=self.world, timeout=timeout)
        #: Host-side group for the step broadcast (the default one on CPU).
        self.host_group = (
            dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else None
        )
        #: Seconds spent in the forward's collectives (all-reduce, logit gather) so far.
        self.comm_seconds = 0.0
        self.comm_calls = 0
        #: Seconds spent broadcasting steps (header + payload) so far.
        self.broadcast_seconds = 0.0

    def all_reduce(self, t: torch.Tensor) -> None:
        start = time.perf_counter()
        dist.all_reduce(t)
        self.comm_seconds += time.perf_counter() - start
        self.comm_calls += 1

    def gather_logits(self, t: torch.Tensor) -> torch.Tensor:
        start = time.perf_counter()
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(t, parts, dst=0)
        self.comm_seconds += time.perf_counter() - start
        self.comm_calls += 1
        return torch.cat(parts, dim=-1) if parts is not None else t

    def min_int(self, value: int) -> int:
        """The smallest of every rank's ``value``."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())

    def broadcast_host(self, t: torch.Tensor) -> None:
        """Rank 0's host tensor ``t`` into every rank's ``t`` (same shape and dtype)."""
        start = time.perf_counter()
        dist.broadcast(t, src=0, group=self.host_group)
        self.broadcast_seconds += time.perf_counter() - start

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
