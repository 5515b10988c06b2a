"""Torch backend throughput against Hugging Face transformers, measured side by side.

    python benches/torch_throughput.py --model smollm2-135m --dtype bfloat16
    python benches/torch_throughput.py --shape qwen2.5-0.5b --dtype bfloat16
    python benches/torch_throughput.py --model smollm2-135m --prefix-cache

Every figure of one invocation comes from the same run, so ratios hold even on a noisy
machine. Both engines load the same plain checkpoint in the same dtype: a GGUF model is
first dequantized by transformers (``GgufConfig(dequantize=True)``) and saved as a plain
safetensors checkpoint, because transformers' own GGUF path keeps the weights packed and
computes through float32 casts, which is not its best setting.

iron-batch is measured three ways: the offline ``LLM`` (engine stepped on this thread), the
same engine on its own thread (as the server runs it), and through the server
(``python -m iron_batch.server`` in a subprocess, driven by ``iron_batch.bench_client`` with
distinct random prompts and ``ignore_eos``): the last is what a user sees. Prints a markdown
table and, with --json, writes the raw numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from iron_batch import Engine, SamplingParams
from iron_batch.backends.torch_backend import TorchBackend
from iron_batch.llm import LLM
from iron_batch.models.loader import resolve
from server_bench import free_port  # benches/, next to this script

SHAPES = {
    # hidden, layers, heads, kv heads, ffn, vocab: Qwen2.5-0.5B's published config.
    "qwen2.5-0.5b": dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, intermediate_size=4864, vocab_size=151936),
}


def copy_bandwidth_gbs() -> float:
    """Best of several large tensor copies: read + write bytes per second."""
    src = torch.empty(256 * 2**20 // 4, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(8):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def build_shape_model(name: str, dtype: torch.dtype, folder: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(**SHAPES[name], max_position_embeddings=4096, tie_word_embeddings=True,
                      rope_theta=1_000_000.0)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).to(dtype)
    model.save_pretrained(folder)
    return folder


def plain_checkpoint(model: str, dtype: torch.dtype, folder: Path) -> str:
    """A GGUF model dequantized once into a plain checkpoint (the fair baseline's weights);
    any other model as it is."""
    src = resolve(model)
    if src.gguf is None:
        return model
    from transformers import AutoModelForCausalLM, GgufConfig

    m = AutoModelForCausalLM.from_pretrained(
        src.gguf.parent, gguf_file=src.gguf.name, dtype=dtype,
        quantization_config=GgufConfig(dequantize=True),
    )
    m.save_pretrained(folder)
    return str(folder)


def hf_model(model: str, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(resolve(model).folder, dtype=dtype)
    m = m.eval()
    m.generation_config.eos_token_id = None  # always run the full length
    m.generation_config.pad_token_id = 0
    return m


def warm(fn: Any, seconds: float) -> None:
    """The CPU runs slower for a while after idling: spin the workload first."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        fn()


def hf_static(m: Any, prompts: np.ndarray, batch: int, new: int) -> float:
    """Output tok/s of transformers generate over static batches."""
    total = 0
    t = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(prompts), batch):
            ids = torch.from_numpy(prompts[i : i + batch])
            out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False)
            total += (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return total / (time.perf_counter() - t)


def hf_ms_per_token(m: Any, prompt: np.ndarray, new: int) -> float:
    ids = torch.from_numpy(prompt[None, :])
    with torch.inference_mode():
        t = time.perf_counter()
        m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new + 1,
                   min_new_tokens=new + 1, do_sample=False)
        t2 = time.perf_counter() - t
    return (t2 - t1) / new * 1e3


def ours_throughput(llm: LLM, prompts: np.ndarray, new: int) -> float:
    params = SamplingParams(max_new_tokens=new, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate([p.tolist() for p in prompts], params)
    elapsed = time.perf_counter() - t
    return sum(len(o.token_ids) for o in outs) / elapsed


def ours_ms_per_token(llm: LLM, prompt: np.ndarray, new: int) -> tuple[float, float]:
    """(ms per decode step, share of it spent outside the model forward)."""
    engine = llm.engine
    params = SamplingParams(max_new_tokens=new + 1, ignore_eos=True)
    engine.add_request("b1", prompt.tolist(), params)
    engine.step()  # prefill (and first token)
    model = llm.backend.model  # type: ignore[attr-defined]
    forward = model.forward
    spent = [0.0]

    def timed_forward(**kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return forward(**kw)
        finally:
            spent[0] += time.perf_counter() - t0

    model.forward = timed_forward
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
    elapsed = time.perf_counter() - t
    model.forward = forward
    return elapsed / steps * 1e3, 1 - spent[0] / elapsed


def ours_engine_thread_ms(llm: LLM, prompt: np.ndarray, new: int) -> float:
    """Batch-1 ms per decode step with the engine on its own thread, as the server runs it:
    the time between the first and the last token's arrival on this thread's event loop."""
    engine = Engine(llm.backend, llm.engine.config)
    engine.start()
    params = SamplingParams(max_new_tokens=new + 1, ignore_eos=True)

    async def consume() -> list[float]:
        arrivals: list[float] = []
        async for events in engine.submit("b1-thread", prompt.tolist(), params):
            arrivals.extend(time.perf_counter() for e in events if e.token_id is not None)
        return arrivals

    try:
        arrivals = asyncio.run(consume())
    finally:
        engine.shutdown()
    return (arrivals[-1] - arrivals[0]) / (len(arrivals) - 1) * 1e3


def server_run(model: str, dtype: str, vocab: int, args: argparse.Namespace,
               extra: list[str] | None = None) -> dict[str, float]:
    """Output tok/s of W and batch-1 ms/token through ``python -m iron_batch.server``
    (``extra``: more server arguments)."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "iron_batch.server", "--backend", "torch", "--model", model,
           "--dtype", dtype, "--device", "cpu", "--addr", f"127.0.0.1:{port}",
           "--max-batch-tokens", str(args.max_batch_tokens), *(extra or [])]
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    def client(concurrency: int, total: int, new: int, seed: int) -> dict[str, Any]:
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run(
                [sys.executable, "-m", "iron_batch.bench_client", "--url", url, "--no-progress",
                 "--concurrency", str(concurrency), "--total-requests", str(total),
                 "--prompt-tokens", str(args.prompt_tokens), "--max-new-tokens", str(new),
                 "--random-prompts", str(vocab - 100), "--seed", str(seed), "--ignore-eos",
                 "--json", out.name],
                check=True, stdout=subprocess.DEVNULL,
            )
            result = dict(json.loads(Path(out.name).read_text()))
        if result["requests_failed"]:
            raise SystemExit(f"server run failed: {result['errors']}")
        return result

    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                tail = log.read()[-2000:].decode(errors="replace")
                raise SystemExit(f"server did not start: {' '.join(cmd)}\n{tail}")
            time.sleep(0.2)
        end = time.monotonic() + args.warmup_s
        while time.monotonic() < end:  # the measured workload itself, other prompts
            client(args.requests, args.requests, args.new_tokens, seed=1)
        w = client(args.requests, args.requests, args.new_tokens, seed=2)
        b1 = client(1, 3, args.new_tokens, seed=3)
    finally:
        proc.terminate()
        proc.wait(30)
    return {"tok_s": float(w["tokens_per_sec"]), "ms_per_token_b1": float(b1["itl_p50_ms"])}


def prefix_cache_run(model: str, dtype: str, caching: bool, n: int = 64) -> dict[str, float]:
    """64 requests sharing a 512-token system prompt plus 32 own tokens, 32 new each."""
    rng = np.random.default_rng(1)
    llm = LLM(model=model, dtype=dtype, device="cpu", enable_prefix_caching=caching,
              max_batch_tokens=2048)
    vocab = llm.backend.model.config.vocab_size  # type: ignore[attr-defined]
    system = rng.integers(100, vocab - 100, 512).tolist()
    warm(lambda: llm.generate([system[:64]], SamplingParams(max_new_tokens=4)), 5)
    engine = llm.engine
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    t0 = time.perf_counter()
    first: dict[str, float] = {}
    for i in range(n):
        engine.add_request(f"p{i}", system + rng.integers(100, vocab - 100, 32).tolist(), params)
    tokens = 0
    while engine.has_unfinished():
        for ev in engine.step():
            if ev.token_id is not None:
                tokens += 1
                first.setdefault(ev.request_id, time.perf_counter() - t0)
    elapsed = time.perf_counter() - t0
    ttft = sorted(first.values())
    stats = engine.scheduler.stats()
    return {
        "tok_s": tokens / elapsed,
        "ttft_p50_ms": statistics.median(ttft) * 1e3,
        "ttft_p99_ms": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))] * 1e3,
        "prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="checkpoint dir, GGUF file or short name (smollm2-135m)")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="random-weight model of this shape")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hf-batches", default="16,64")
    ap.add_argument("--warmup-s", type=float, default=8.0)
    ap.add_argument("--max-batch-tokens", type=int, default=8192,
                    help="iron-batch's token budget per step (the server's default)")
    ap.add_argument("--server", action="store_true",
                    help="also measure through python -m iron_batch.server (what users see)")
    ap.add_argument("--prefix-cache", action="store_true",
                    help="run the shared-system-prompt comparison instead")
    ap.add_argument("--json", help="write the numbers here")
    args = ap.parse_args()
    if args.prefix_cache:
        model = args.model or "smollm2-135m"
        rows = {on: prefix_cache_run(model, args.dtype, on) for on in (False, True)}
        print("| prefix cache | tok/s | TTFT p50 ms | TTFT p99 ms | cached tokens |")
        print("|---|---|---|---|---|")
        for on, r in rows.items():
            print(f"| {'on' if on else 'off'} | {r['tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | "
                  f"{r['ttft_p99_ms']:.0f} | {r['prefix_cache_hit_tokens']} |")
        if args.json:
            Path(args.json).write_text(json.dumps({str(k): v for k, v in rows.items()}, indent=2))
        return

    dtype = getattr(torch, args.dtype)
    tmp = tempfile.TemporaryDirectory()
    if args.shape:
        model = str(build_shape_model(args.shape, dtype, Path(tmp.name)))
    elif args.model:
        model = plain_checkpoint(args.model, dtype, Path(tmp.name))
    else:
        ap.error("give --model or --shape")
    bandwidth = copy_bandwidth_gbs()
    llm = LLM(model=model, dtype=args.dtype, device="cpu", max_batch_tokens=args.max_batch_tokens)
    backend: TorchBackend = llm.backend  # type: ignore[assignment]
    net = backend.model
    weight_bytes = sum(
        t.numel() * t.element_size()
        for t in {id(t): t for t in _weights(net)}.values()
    )
    vocab = net.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = rng.integers(100, vocab - 100, (args.requests, args.prompt_tokens), dtype=np.int64)
    new = args.new_tokens

    # Warm-up runs the measured workload's shapes on other prompts: the same prompts would
    # be served from the prefix cache in the measured run.
    others = rng.integers(100, vocab - 100, prompts.shape, dtype=np.int64)
    warm(lambda: ours_throughput(llm, others, new), args.warmup_s)
    ours = ours_throughput(llm, prompts, new)
    ours_ms, overhead = ours_ms_per_token(llm, prompts[0], new)
    thread_ms = ours_engine_thread_ms(llm, prompts[1], new)
    llm = None  # free our model before loading the reference
    server = server_run(model, args.dtype, vocab, args) if args.server else None

    hf = hf_model(model, dtype)
    hf_rows = {}
    for b in [int(x) for x in args.hf_batches.split(",")]:
        hf_static(hf, prompts[:b], b, new)  # warm-up with this batch's shapes
        hf_rows[b] = hf_static(hf, prompts, b, new)
    hf_ms = hf_ms_per_token(hf, prompts[0], new)
    # Measured again after the runs; the best figure makes the strictest floor.
    bandwidth = max(bandwidth, copy_bandwidth_gbs())
    floor_ms = weight_bytes / (bandwidth * 1e9) * 1e3
    best_hf = max(hf_rows.values())
    result = {
        "model": args.shape or model, "dtype": args.dtype, "requests": args.requests,
        "prompt_tokens": args.prompt_tokens, "new_tokens": new,
        "copy_bandwidth_gbs": bandwidth, "weight_bytes": weight_bytes,
        "iron_batch_tok_s": ours, "hf_static_tok_s": hf_rows,
        "iron_batch_ms_per_token_b1": ours_ms, "python_overhead_share_b1": overhead,
        "iron_batch_engine_thread_ms_per_token_b1": thread_ms, "server": server,
        "hf_ms_per_token_b1": hf_ms, "bandwidth_floor_ms": floor_ms,
    }
    name = args.shape or args.model
    print(f"\n{name} {args.dtype}, {args.requests} x {args.prompt_tokens} in x {new} out; "
          f"copy bandwidth {bandwidth:.1f} GB/s, weights {weight_bytes / 1e6:.0f} MB")
    print("| engine | output tok/s | vs best transformers |")
    print("|---|---|---|")
    if server is not None:
        print(f"| iron-batch server (HTTP, {args.requests} streams) | {server['tok_s']:.1f} | "
              f"{server['tok_s'] / best_hf:.2f}x |")
    print(f"| iron-batch in process (LLM) | {ours:.1f} | {ours / best_hf:.2f}x |")
    for b, v in hf_rows.items():
        print(f"| transformers generate, static batch {b} | {v:.1f} | {v / best_hf:.2f}x |")
    print("| batch-1 decode | ms/token | vs transformers | vs bandwidth floor |")
    print("|---|---|---|---|")
    if server is not None:
        s_ms = server["ms_per_token_b1"]
        print(f"| iron-batch server (HTTP, inter-token p50) | {s_ms:.1f} | {s_ms / hf_ms:.2f}x | "
              f"{s_ms / floor_ms:.2f}x |")
    print(f"| iron-batch engine thread | {thread_ms:.1f} | {thread_ms / hf_ms:.2f}x | "
          f"{thread_ms / floor_ms:.2f}x |")
    print(f"| iron-batch caller's thread (LLM) | {ours_ms:.1f} | {ours_ms / hf_ms:.2f}x | "
          f"{ours_ms / floor_ms:.2f}x (outside forward: {overhead:.0%}) |")
    print(f"| transformers | {hf_ms:.1f} | 1.00x | {hf_ms / floor_ms:.2f}x |")
    print(f"| floor (weights / copy bandwidth) | {floor_ms:.1f} | | 1.00x |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def _weights(net: Any) -> list[torch.Tensor]:
    out = [net.embed, net.norm, net.lm_head]
    for layer in net.layers:
        out.extend(t for t in vars(layer).values() if isinstance(t, torch.Tensor))
    return out


if __name__ == "__main__":
    main()
