"""Torch backend throughput against Hugging Face transformers, measured side by side.

    python benches/torch_throughput.py --model smollm2-135m --dtype bfloat16
    python benches/torch_throughput.py --shape qwen2.5-0.5b --dtype bfloat16
    python benches/torch_throughput.py --shape gemma-3-1b --dtype bfloat16 --server
    python benches/torch_throughput.py --model smollm2-135m --prefix-cache

Every figure of one invocation comes from the same run, so ratios hold even on a noisy
machine: each of ``--rounds`` rounds measures ours and transformers' figures back to back,
and the table gives the median of the rounds' ratios with their range. The batch-1 floor
(weight bytes / copy bandwidth) is taken from copy-bandwidth samples right before and after
the run it is compared with, since this machine's memory bandwidth moves by 2x between
minutes. Both engines load the same plain checkpoint in the same dtype: a GGUF model is
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
import functools
import itertools
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
from iron_batch.loader import resolve
from server_bench import free_port  # benches/, next to this script

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    # hidden, layers, heads, kv heads, ffn, vocab: Qwen2.5-0.5B's published config.
    "qwen2.5-0.5b": ("Qwen2Config", dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1_000_000.0)),
    # Gemma-3-1B's published text config: 22 sliding layers (window 512) and 4 global ones.
    "gemma-3-1b": ("Gemma3TextConfig", dict(
        hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
        head_dim=256, intermediate_size=6912, vocab_size=262144, sliding_window=512,
        query_pre_attn_scalar=256, tie_word_embeddings=True)),
    # A Qwen3.5 of about 0.8B: 24 layers (18 Gated DeltaNet, 6 gated full attention),
    # hidden 1024, 16 key and 16 value heads of 128 in the linear layers, 8 query / 2 K/V
    # heads of 256 in the attention ones, tied 248k vocabulary.
    "qwen3.5-0.8b": ("Qwen3_5TextConfig", dict(
        hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
        head_dim=256, intermediate_size=3584, vocab_size=248320, linear_num_key_heads=16,
        linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=True)),
    # Qwen3.5-4B's published text config: 32 layers (24 Gated DeltaNet, 8 gated full
    # attention), hidden 2560, 16 key and 32 value heads of 128 in the linear layers, 16
    # query / 4 K/V heads of 256 in the attention ones, MLP 9216, tied 248k vocabulary.
    "qwen3.5-4b": ("Qwen3_5TextConfig", dict(
        hidden_size=2560, num_hidden_layers=32, num_attention_heads=16, num_key_value_heads=4,
        head_dim=256, intermediate_size=9216, vocab_size=248320, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        tie_word_embeddings=True)),
    # Phi-4-mini's published layer (partial rotary 0.75, LongRoPE, tied 200k vocabulary)
    # with 8 of its 32 layers, so that the three copies this script loads fit 24 GiB.
    "phi-4-mini-8l": ("Phi3Config", dict(
        hidden_size=3072, num_hidden_layers=8, num_attention_heads=24, num_key_value_heads=8,
        intermediate_size=8192, vocab_size=200064, tie_word_embeddings=True,
        original_max_position_embeddings=4096,
        rope_scaling={"rope_type": "longrope", "partial_rotary_factor": 0.75,
                      "short_factor": [1.0] * 48, "long_factor": [2.0] * 48})),
    # A small Qwen3-MoE (32 experts of 384 rows, top 4 renormalised, in 8 layers): a
    # mixture of experts transformers runs in bf16 here.
    "qwen3-moe-small": ("Qwen3MoeConfig", dict(
        hidden_size=768, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4,
        head_dim=64, intermediate_size=2048, moe_intermediate_size=384, num_experts=32,
        num_experts_per_tok=4, norm_topk_prob=True, vocab_size=32000,
        tie_word_embeddings=False)),
    # A small Qwen3.5-MoE (Qwen3.5's hybrid layers, 6 Gated DeltaNet to 2 gated attention,
    # each MLP 32 experts of 384 rows, top 4, and a shared expert of 768): a hybrid mixture
    # of experts transformers runs in bf16 here.
    "qwen3.5-moe-small": ("Qwen3_5MoeTextConfig", dict(
        hidden_size=768, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
        head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16,
        linear_key_head_dim=64, linear_value_head_dim=64, moe_intermediate_size=384,
        shared_expert_intermediate_size=768, num_experts=32, num_experts_per_tok=4,
        vocab_size=32000, tie_word_embeddings=False)),
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
    import transformers

    cls_name, fields = SHAPES[name]
    fields = dict(fields)
    if "rope_scaling" in fields:  # transformers 5 reads rope settings from rope_parameters
        fields["rope_parameters"] = {"rope_theta": 10000.0, **fields.pop("rope_scaling")}
    cfg = getattr(transformers, cls_name)(**fields, max_position_embeddings=131072
                                          if cls_name == "Phi3Config" else 4096)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
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


class Server:
    """``python -m iron_batch.server`` in a subprocess, measured with
    ``iron_batch.bench_client`` (distinct random prompts, ``ignore_eos``)."""

    def __init__(self, model: str, dtype: str, vocab: int, args: argparse.Namespace,
                 extra: list[str] | None = None, python: str = sys.executable) -> None:
        """``python``: the interpreter (and so the build of iron_batch) that serves."""
        import httpx

        self.args, self.vocab = args, vocab
        self.url = f"http://127.0.0.1:{free_port()}"
        cmd = [python, "-m", "iron_batch.server", "--backend", "torch", "--model",
               model, "--dtype", dtype, "--device", "cpu",
               "--addr", self.url.removeprefix("http://"),
               "--max-batch-tokens", str(args.max_batch_tokens), *(extra or [])]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                self.log.seek(0)
                tail = self.log.read()[-2000:].decode(errors="replace")
                raise SystemExit(f"server did not start: {' '.join(cmd)}\n{tail}")
            time.sleep(0.2)

    def client(self, concurrency: int, total: int, seed: int) -> dict[str, Any]:
        args = self.args
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            subprocess.run(
                [sys.executable, "-m", "iron_batch.bench_client", "--url", self.url,
                 "--no-progress", "--concurrency", str(concurrency), "--total-requests",
                 str(total), "--prompt-tokens", str(args.prompt_tokens), "--max-new-tokens",
                 str(args.new_tokens), "--random-prompts", str(self.vocab - 100), "--seed",
                 str(seed), "--ignore-eos", "--json", out.name],
                check=True, stdout=subprocess.DEVNULL,
            )
            result = dict(json.loads(Path(out.name).read_text()))
        if result["requests_failed"]:
            raise SystemExit(f"server run failed: {result['errors']}")
        return result

    def throughput(self, seed: int) -> float:
        """Output tok/s of W (fresh prompts: ``seed`` must differ between runs)."""
        n = self.args.requests
        return float(self.client(n, n, seed)["tokens_per_sec"])

    def ms_per_token(self, seed: int) -> float:
        """Batch-1 inter-token p50 over three requests in a row."""
        return float(self.client(1, 3, seed)["itl_p50_ms"])

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def server_run(model: str, dtype: str, vocab: int, args: argparse.Namespace,
               extra: list[str] | None = None) -> dict[str, float]:
    """One warmed-up measurement of W tok/s and batch-1 ms/token through the server
    (``extra``: more server arguments)."""
    server = Server(model, dtype, vocab, args, extra)
    try:
        end = time.monotonic() + args.warmup_s
        seed = 100
        while time.monotonic() < end:
            seed += 1
            server.throughput(seed)
        return {"tok_s": server.throughput(2), "ms_per_token_b1": server.ms_per_token(3)}
    finally:
        server.stop()


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
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure every figure this many times, ours and transformers' "
                    "alternating; report the median of each round's ratio")
    ap.add_argument("--max-batch-tokens", type=int, default=8192,
                    help="iron-batch's token budget per step (the server's default)")
    ap.add_argument("--kv-cache-memory-gb", type=float, default=None,
                    help="iron-batch's KV and state memory, in process and in the server "
                    "(its default when not given)")
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
    llm = LLM(model=model, dtype=args.dtype, device="cpu", max_batch_tokens=args.max_batch_tokens,
              kv_cache_memory_gb=args.kv_cache_memory_gb)
    backend: TorchBackend = llm.backend  # type: ignore[assignment]
    net = backend.model
    weight_bytes = sum(
        t.numel() * t.element_size()
        for t in {id(t): t for t in _weights(net)}.values()
    )
    # A recurrent-state model (Qwen3.5) also reads one sequence's state per decode step.
    state_bytes = net.state_slot_bytes()
    vocab = net.config.vocab_size
    rng = np.random.default_rng(0)
    new = args.new_tokens

    def fresh() -> np.ndarray:
        # New prompts for every run: the same ones would come from the prefix cache.
        return rng.integers(100, vocab - 100, (args.requests, args.prompt_tokens),
                            dtype=np.int64)

    def floor(measure: Any) -> tuple[float, float]:
        """(measure(), the bandwidth floor in ms per token): the floor from the better of
        two copy-bandwidth samples taken right before and right after, so that both sides
        of the ratio see the same state of this shared machine's memory system."""
        before = copy_bandwidth_gbs()
        value = measure()
        best = max(before, copy_bandwidth_gbs())
        return value, (weight_bytes + state_bytes) / (best * 1e9) * 1e3

    memory = ([] if args.kv_cache_memory_gb is None
              else ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)])
    server = Server(model, args.dtype, vocab, args, memory) if args.server else None
    hf = hf_model(model, dtype)
    batches = [int(x) for x in args.hf_batches.split(",")]
    warm(lambda: ours_throughput(llm, fresh(), new), args.warmup_s)
    for b in batches:  # transformers' warm-up, with each batch's shapes
        hf_static(hf, fresh()[:b], b, new)
    seeds = itertools.count(1000)  # the server's prompts: fresh for every run
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        # One round measures every figure once, ours and transformers' back to back.
        row: dict[str, Any] = {}
        row["ours_tok_s"] = ours_throughput(llm, fresh(), new)
        (row["ours_ms"], row["overhead"]), row["ours_floor_ms"] = floor(
            functools.partial(ours_ms_per_token, llm, fresh()[0], new))
        row["thread_ms"] = ours_engine_thread_ms(llm, fresh()[0], new)
        if server is not None:
            if r == 0:
                warm(lambda: server.throughput(next(seeds)), args.warmup_s)
            row["server_tok_s"] = server.throughput(next(seeds))
            row["server_ms"], row["server_floor_ms"] = floor(
                functools.partial(server.ms_per_token, next(seeds)))
        row["hf_tok_s"] = {b: hf_static(hf, fresh(), b, new) for b in batches}
        row["hf_ms"] = hf_ms_per_token(hf, fresh()[0], new)
        best_hf = max(row["hf_tok_s"].values())
        row["ratios"] = {
            "ours_vs_hf_tok_s": row["ours_tok_s"] / best_hf,
            "ours_ms_vs_hf": row["ours_ms"] / row["hf_ms"],
            "ours_ms_vs_floor": row["ours_ms"] / row["ours_floor_ms"],
        }
        if server is not None:
            row["ratios"].update({
                "server_vs_hf_tok_s": row["server_tok_s"] / best_hf,
                "server_ms_vs_hf": row["server_ms"] / row["hf_ms"],
                "server_ms_vs_floor": row["server_ms"] / row["server_floor_ms"],
            })
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items()),
              flush=True)
    if server is not None:
        server.stop()

    def med(key: str) -> float:
        return statistics.median(row[key] for row in rounds)

    def ratio(key: str) -> str:
        values = sorted(row["ratios"][key] for row in rounds)
        spread = f" ({values[0]:.2f}-{values[-1]:.2f})" if len(values) > 1 else ""
        return f"{statistics.median(values):.2f}x{spread}"

    result = {"model": args.shape or model, "dtype": args.dtype, "requests": args.requests,
              "prompt_tokens": args.prompt_tokens, "new_tokens": new,
              "weight_bytes": weight_bytes, "state_bytes": state_bytes, "rounds": rounds}
    name = args.shape or args.model
    print(f"\n{name} {args.dtype}, {args.requests} x {args.prompt_tokens} in x {new} out, "
          f"weights {weight_bytes / 1e6:.0f} MB"
          + (f", state {state_bytes / 1e6:.1f} MB per sequence" if state_bytes else "")
          + f"; medians of {len(rounds)} rounds, each ratio "
          "taken within its round (its range in brackets)")
    print("| engine | output tok/s | vs best transformers |")
    print("|---|---|---|")
    if server is not None:
        print(f"| iron-batch server (HTTP, {args.requests} streams) | {med('server_tok_s'):.1f} "
              f"| {ratio('server_vs_hf_tok_s')} |")
    print(f"| iron-batch in process (LLM) | {med('ours_tok_s'):.1f} | "
          f"{ratio('ours_vs_hf_tok_s')} |")
    for b in batches:
        v = statistics.median(row["hf_tok_s"][b] for row in rounds)
        print(f"| transformers generate, static batch {b} | {v:.1f} | |")
    print("| batch-1 decode | ms/token | vs transformers | vs bandwidth floor |")
    print("|---|---|---|---|")
    if server is not None:
        print(f"| iron-batch server (HTTP, inter-token p50) | {med('server_ms'):.1f} | "
              f"{ratio('server_ms_vs_hf')} | {ratio('server_ms_vs_floor')} |")
    print(f"| iron-batch engine thread | {med('thread_ms'):.1f} | | |")
    print(f"| iron-batch caller's thread (LLM) | {med('ours_ms'):.1f} | "
          f"{ratio('ours_ms_vs_hf')} | {ratio('ours_ms_vs_floor')} "
          f"(outside forward: {med('overhead'):.0%}) |")
    print(f"| transformers | {med('hf_ms'):.1f} | 1.00x | |")
    print(f"| floor (weights + state / copy bandwidth, next to our run) | "
          f"{med('ours_floor_ms'):.1f} | | 1.00x |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


def _weights(net: Any) -> list[torch.Tensor]:
    out = [net.embed.table, net.norm.weight, net.lm_head.linear.weight]
    for layer in net.layers:
        out += [layer.input_norm.weight, layer.post_norm.weight]
        mixer = getattr(layer, "mixer", None)
        if mixer is not None:  # a linear-attention layer (Qwen3.5): its projections
            for lin in (*mixer.linears(), layer.mlp.gate_up, layer.mlp.down):
                out += lin.tensors()
            continue
        out += [norm.weight for norm in (layer.q_norm, layer.k_norm) if norm is not None]
        for lin in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down):
            out += [lin.weight] + ([lin.bias] if lin.bias is not None else [])
    return out


if __name__ == "__main__":
    main()
