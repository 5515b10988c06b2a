"""Ranks >= 1 of a tensor-parallel model: receive each step from rank 0, run the same
forward on this rank's shard, repeat until rank 0 says stop or is gone.

``python -m iron_batch.parallel.shard_loop`` is how a single-host server spawns its other ranks
(the server's own flags are passed on); under torchrun, ranks >= 1 of the server command call
:func:`serve` directly instead of serving HTTP.
"""

from __future__ import annotations

import argparse
import ctypes
import logging
import signal
import sys

from iron_batch import flags
from iron_batch.batch import GROUP_MODEL_INPUTS, MODEL_INPUTS, STATE_MODEL_INPUTS
from iron_batch.parallel import step_broadcast
from iron_batch.parallel.rank import LoadedRank
from iron_batch.parallel.step_broadcast import Message

logger = logging.getLogger("iron_batch.parallel.shard_loop")


def serve(loaded: LoadedRank, kv_block_size: int) -> int:
    """The shard loop; the exit status: 0 when rank 0 said stop, 1 when it was lost."""
    model, group = loaded.model, loaded.group
    model.allocate_kv_cache(loaded.num_kv_blocks, kv_block_size)
    try:
        while True:
            kind, inputs = step_broadcast.receive(group)
            if kind == Message.STOP:
                break
            if kind == Message.STEP:
                model.forward(**{k: v for k, v in inputs.items() if k in MODEL_INPUTS
                                 or k in GROUP_MODEL_INPUTS or k in STATE_MODEL_INPUTS})
    except Exception as exc:  # a peer died or timed out: nothing left to serve
        print(f"iron-batch tensor-parallel rank {group.rank}: lost the group: {exc}",
              file=sys.stderr, flush=True)
        return 1
    group.destroy()
    return 0


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the process that spawned it ends."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m iron_batch.parallel.shard_loop")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store", required=True, help="HOST:PORT of rank 0's rendezvous store")
    # The model's flags as the server defines them; rank 0 passes its own values on.
    flags.add(p, flags.MODEL_FLAGS, **{n: {"required": True} for n in (
        "--model", "--device", "--dtype", "--kv-block-size")})
    p.add_argument("--timeout", type=float, required=True)
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    _die_with_parent()
    logging.basicConfig(level=logging.WARNING)

    import torch

    from iron_batch.backends.torch_backend import pick_dtype
    from iron_batch.loader import read_config, resolve
    from iron_batch.parallel.group import Rendezvous, join_store
    from iron_batch.parallel.rank import load_rank, rank_device, share_cores

    rendezvous = Rendezvous(args.rank, args.world_size, args.world_size, args.rank)
    store = join_store(args.store, args.rank, args.world_size, args.timeout)
    source = resolve(args.model)
    share_cores(rendezvous.local_world)
    device = rank_device(torch.device(args.device), rendezvous)
    loaded = load_rank(
        source, read_config(source), rendezvous,
        device=device, dtype=pick_dtype(args.dtype, device, args.quantization),
        timeout_s=args.timeout, quantization=args.quantization,
        total_kv_blocks=args.total_kv_blocks, kv_block_size=args.kv_block_size,
        kv_cache_memory_gb=args.kv_cache_memory_gb, store=store,
        kv_cache_dtype=args.kv_cache_dtype or "auto",
        recurrent_state_dtype=args.recurrent_state_dtype or "float32",
    )
    sys.exit(serve(loaded, args.kv_block_size))


if __name__ == "__main__":
    main()
