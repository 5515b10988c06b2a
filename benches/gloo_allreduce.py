"""Latency of one gloo all-reduce between two local processes (what each of the 50
collectives of a Qwen2.5-0.5B-shaped TP=2 step costs at least on this host).

    python benches/gloo_allreduce.py
"""

from __future__ import annotations

import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _run(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (1, 16):
            t = torch.ones(rows, 896, dtype=dtype)
            for _ in range(50):
                dist.all_reduce(t)
            start = time.perf_counter()
            for _ in range(500):
                dist.all_reduce(t)
            us = (time.perf_counter() - start) / 500 * 1e6
            if rank == 0:
                print(f"| {str(dtype).removeprefix('torch.')} | {rows} x 896 | {us:.0f} |")
    dist.destroy_process_group()


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print("| dtype | tensor | us per all-reduce |\n|---|---|---|")
    mp.spawn(_run, args=(port,), nprocs=2)


if __name__ == "__main__":
    main()
