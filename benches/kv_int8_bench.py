"""The int8 KV cache against the bf16 one, in one run.

Through the server (``python -m iron_batch.server --backend torch``, the default pool of
``--kv-cache-memory-gb``): how many concurrent sequences of ``--context`` tokens each pool
holds (read from the page's info: its blocks over the blocks one sequence needs), and the
decode rate W with that many sequences at that context (the bench client's requests of
random prompt ids, every one in the pool at once; W = concurrency / median inter-token
time, the steady decode steps). int8 also runs at bf16's concurrency, the same work.

In process, on the same model: each step's logits with the int8 cache against the bf16
cache's on the same tokens (every step forced to the bf16 run's greedy token), and how
much of the free greedy run stays the same.

    python benches/kv_int8_bench.py                 # smollm2-135m, 4096-token sequences
    python benches/kv_int8_bench.py --w-context 1024 --w-memory-gb 0.125 --new-tokens 32
    python benches/kv_int8_bench.py --w-memory-gb 0.25 --new-tokens 16 --skip-logits
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(model: str, kv: str, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "iron_batch.server", "--backend", "torch", "--model", model,
           "--dtype", "bfloat16", "--kv-cache-dtype", kv, "--addr", f"127.0.0.1:{port}",
           "--no-ui", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server {cmd} exited")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server {cmd} did not start")


def pool_info(model: str, kv: str, extra: list[str]) -> dict[str, Any]:
    """The page's view of the pool (a server with the page on, stopped after)."""
    cmd_extra = [e for e in extra if e != "--no-ui"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "iron_batch.server", "--backend", "torch", "--model", model,
           "--dtype", "bfloat16", "--kv-cache-dtype", kv, "--addr", f"127.0.0.1:{port}",
           *cmd_extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                r = httpx.get(f"{url}/ui/api/info", timeout=1)
                if r.status_code == 200:
                    return dict(r.json()["kv"])
            except httpx.HTTPError:
                time.sleep(0.5)
        raise SystemExit("server did not start")
    finally:
        proc.terminate()
        proc.wait(30)


def decode_rate(url: str, concurrency: int, context: int, new: int,
                vocab: int) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, "-m", "iron_batch.bench_client", "--url", url, "--no-progress",
             "--concurrency", str(concurrency), "--total-requests", str(concurrency),
             "--prompt-tokens", str(context - new), "--random-prompts", str(vocab),
             "--max-new-tokens", str(new), "--json", out.name],
            check=True, stdout=subprocess.DEVNULL,
        )
        s = json.loads(Path(out.name).read_text())
    metrics = httpx.get(f"{url}/metrics", timeout=10).json()
    itl = s["itl_p50_ms"]
    return {"concurrency": concurrency, "ok": s["requests_ok"], "itl_p50_ms": itl,
            "W": round(concurrency / (itl / 1000), 1), "preemptions": metrics.get("preemptions"),
            "elapsed_s": s["elapsed_secs"]}


def logit_agreement(model: str, new: int) -> dict[str, Any]:
    import torch
    from iron_batch import Scheduler
    from iron_batch.backends.build import scheduler_config
    from iron_batch.backends.torch_backend import TorchBackend

    texts = [
        "The history of the printing press begins in",
        "To make a simple tomato soup, first",
        "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
        "The three laws of thermodynamics state that",
        "Once upon a time, in a village by the sea,",
        "Photosynthesis is the process by which plants",
    ]

    def run(be: TorchBackend, prompts: list[list[int]],
            forced: list[np.ndarray] | None) -> tuple[list[np.ndarray], torch.Tensor,
                                                      list[list[int]]]:
        logits: list[torch.Tensor] = []
        net = be.model
        forward = net._logits

        def keep(h: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
            out = forward(h, rows)
            logits.append(out.float().clone())
            return out

        net._logits = keep  # type: ignore[method-assign]
        s = Scheduler(scheduler_config(be))
        for i, p in enumerate(prompts):
            s.add_request(f"r{i}", p, new)
        steps: list[np.ndarray] = []
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        while s.has_work():
            batch = s.schedule()
            sampled = np.asarray(be.execute(batch))
            if forced is not None:
                sampled = forced[len(steps)]
            steps.append(sampled)
            events = s.commit(batch, sampled)
            for rid, tok in zip(events.request_ids, events.token_ids.tolist(), strict=True):
                if tok >= 0:
                    tokens[rid].append(tok)
        del net._logits
        return steps, torch.cat(logits), [tokens[f"r{i}"] for i in range(len(prompts))]

    out: dict[str, Any] = {}
    backends = {kv: TorchBackend.from_model(model, device="cpu", dtype="bfloat16",
                                            total_kv_blocks=256, kv_cache_dtype=kv)
                for kv in ("auto", "int8")}
    tok = backends["auto"].tokenizer
    assert tok is not None
    prompts = [tok.encode(t) for t in texts]
    steps, ref, ref_tokens = run(backends["auto"], prompts, None)
    _, forced, _ = run(backends["int8"], prompts, steps)
    _, _, free_tokens = run(backends["int8"], prompts, None)
    diff = (forced - ref).abs()
    out["rows"] = int(ref.shape[0])
    out["max_abs"] = round(diff.max().item(), 4)
    out["mean_abs"] = round(diff.mean().item(), 4)
    out["logit_std"] = round(ref.std().item(), 4)
    out["argmax_agreement"] = round((forced.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4)
    same = []
    for a, b in zip(ref_tokens, free_tokens, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        same.append(first)
    out["greedy_identical_prefix"] = same
    out["greedy_identical_sequences"] = sum(n == new for n in same)
    out["sequences"] = len(prompts)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=4096, help="tokens per sequence, all told")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--vocab", type=int, default=49152, help="random prompt ids below this")
    p.add_argument("--logit-tokens", type=int, default=64)
    p.add_argument("--json", default=None)
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--skip-logits", action="store_true", help="the server runs only")
    p.add_argument("--w-context", type=int, default=None,
                   help="tokens per sequence of the W runs (default --context)")
    p.add_argument("--w-memory-gb", type=float, default=None,
                   help="--kv-cache-memory-gb of the W runs (default: the server's default)")
    args = p.parse_args()
    result: dict[str, Any] = {"model": args.model, "context": args.context}
    if not args.skip_server:
        pools = {kv: pool_info(args.model, kv, []) for kv in ("auto", "int8")}
        for kv, info in pools.items():
            per_seq = -(-args.context // info["block_size"])
            info["sequences"] = info["blocks"] // per_seq
            print(f"{kv}: {info}", flush=True)
        result["pools"] = pools
        w_context = args.w_context or args.context
        w_extra = [] if args.w_memory_gb is None else ["--kv-cache-memory-gb",
                                                       str(args.w_memory_gb)]
        if w_context != args.context or w_extra:
            pools = {kv: pool_info(args.model, kv, w_extra) for kv in ("auto", "int8")}
            for info in pools.values():
                info["sequences"] = info["blocks"] // -(-w_context // info["block_size"])
            result["w_pools"] = pools
            print(f"W pools: {pools}", flush=True)
        runs = []
        for kv, conc in (("auto", pools["auto"]["sequences"]),
                         ("int8", pools["auto"]["sequences"]),
                         ("int8", pools["int8"]["sequences"])):
            proc, url = start_server(args.model, kv, w_extra)
            try:
                r = {"kv": kv, "context": w_context,
                     **decode_rate(url, conc, w_context, args.new_tokens, args.vocab)}
            finally:
                proc.terminate()
                proc.wait(30)
            print(r, flush=True)
            runs.append(r)
        result["runs"] = runs
    if not args.skip_logits:
        result["logits"] = logit_agreement(args.model, args.logit_tokens)
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
