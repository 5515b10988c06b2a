"""Command line of ``python -m iron_batch.server``: flags, backend construction, uvicorn."""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import sys
import textwrap
from typing import Any

from iron_batch.cli_args import (
    non_negative_float,
    non_negative_int,
    parse_addr,
    positive_int,
)
from iron_batch.platform.switches import SWITCHES

_DESCRIPTION = """\
iron-batch server: continuous batching over a paged KV cache, streaming NDJSON.

Endpoints:
  POST /generate  {"prompt_tokens": 128, "max_new_tokens": 64} (or "prompt_token_ids": [...],
                  or "prompt": "text" with a tokenizer) streams one JSON line per token.
  GET  /metrics   JSON; Prometheus text when the Accept header asks for text/plain or
                  application/openmetrics-text.
  GET  /health    200 while the engine thread runs steps (never needs the API key)
  GET  /          a page for people: chat playground and live dashboard (--no-ui: off)
  OpenAI-compatible: GET /v1/models, POST /v1/completions, POST /v1/chat/completions
                  (stream: true for server-sent events); POST /tokenize, /detokenize;
                  GET /tokenizer_info, /openapi.json
"""

_MOCK_HELP = """\
mock backend latency model: a memory-bound accelerator reads all weights once per decode
step, so one step costs --mock-token-latency-us whatever the batch size, and every running
sequence gets its next token after that long (batching raises tok/s with concurrency).
Prompt tokens add --mock-prefill-token-latency-us each to the step that processes them.
"""

_TUNING_HELP = textwrap.fill(
    "the CPU kernels read these environment variables when the model loads: " + "; ".join(
        f"{s.env}={'|'.join(s.choices) or 'N'} (default {s.default})"
        for s in SWITCHES.values()), width=88)


def build_parser() -> argparse.ArgumentParser:
    from iron_batch import flags
    from iron_batch.backends.build import ALIASES, BACKEND_KINDS, DEFAULTS
    from iron_batch.engine import DEFAULT_MAX_STREAM_BUFFER_EVENTS
    from iron_batch.server.admission import DEFAULT_MAX_WAITING_REQUESTS
    from iron_batch.server.fields import MAX_BODY_BYTES

    p = argparse.ArgumentParser(
        prog="python -m iron_batch.server",
        usage="%(prog)s [options]",
        description=_DESCRIPTION,
        epilog=_MOCK_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    # --help lists the groups in this order; which group a flag is in changes nothing else.
    model = p.add_argument_group("model", "what is served, and on which backend")
    memory = p.add_argument_group("memory", "the paged KV cache and its prefix cache")
    scheduling = p.add_argument_group("scheduling", "what one engine step may hold")
    distributed = p.add_argument_group(
        "remote worker and tensor parallelism",
        "the model in a `python -m iron_batch.worker` on another host, or split over ranks")
    server = p.add_argument_group("server", "HTTP listener, page, logging, shutdown")
    limits = p.add_argument_group(
        "limits", "requests past these get a 4xx or a 503 + Retry-After, and change nothing")
    auth = p.add_argument_group("auth", "API keys and tenants")
    tuning = p.add_argument_group("tuning", _TUNING_HELP)
    # The model's flags, as the worker and the tensor-parallel ranks define them too.
    flags.add(model, ("--model", "--device", "--dtype", "--quantization",
                      "--mock-token-latency-us", "--mock-prefill-token-latency-us"))
    flags.add(memory, ("--total-kv-blocks", "--kv-block-size", "--kv-cache-memory-gb",
                       "--kv-cache-dtype", "--recurrent-state-dtype"))
    server.add_argument("--addr", type=parse_addr, default="0.0.0.0:8080",
                   help="HOST:PORT to listen on (default 0.0.0.0:8080)")
    scheduling.add_argument("--max-batch-tokens", type=positive_int, default=None,
                   help="token budget of one step, prefill chunks included (default "
                   f"{DEFAULTS.max_batch_tokens})")
    scheduling.add_argument("--max-running-seqs", type=positive_int, default=None,
                   help=f"sequences in one step at most (default {DEFAULTS.max_running_seqs})")
    scheduling.add_argument("--speculative-method", choices=("ngram", "draft"), default=None,
                   help="speculative decoding: ngram (prompt lookup: a repeat of the "
                   "sequence's last tokens in its prompt and output proposes what followed "
                   "them) or draft (a smaller model with the same tokenizer, "
                   "--speculative-model, proposes greedily); the model verifies them in the "
                   "same step, greedy and seeded output unchanged (default off)")
    flags.add(scheduling, flags.DRAFT_FLAGS)
    scheduling.add_argument("--num-speculative-tokens", type=positive_int, default=None,
                   help="speculative decoding: most tokens proposed per sequence per step "
                   "(default 4 with --speculative-method)")
    memory.add_argument("--no-prefix-caching", action="store_true",
                   help="disable reuse of cached KV blocks across requests")
    model.add_argument("--backend", choices=(*BACKEND_KINDS, *ALIASES), default="mock",
                   help="mock (no weights), torch (local HF checkpoint, --model), or remote "
                   "(a `python -m iron_batch.worker` at --backend-url; 'real' is an old "
                   "alias) (default mock)")
    distributed.add_argument("--backend-url", default="",
                   help="remote: worker address, tcp://HOST:PORT or HOST:PORT")
    distributed.add_argument("--backend-api-key", default=None,
                   help="remote: the worker's --api-key (default: this server's --api-key)")
    distributed.add_argument("--backend-timeout", type=non_negative_float, default=30.0,
                   help="remote: seconds to wait for one worker call before failing its "
                   "requests (default 30)")
    distributed.add_argument("--steps-per-call", type=positive_int, default=1,
                   help="remote: decode steps the worker runs per call; K > 1 amortises the "
                   "network round trip, surplus tokens after a stop are discarded (default 1)")
    scheduling.add_argument("--overlap-depth", type=int, default=None, choices=range(0, 5),
                   metavar="N",
                   help="steps kept in flight on the backend while the engine schedules the "
                   "next one (placeholders for their tokens are filled in by the backend); 2 "
                   "hides a remote round trip longer than a step; ignored with "
                   "--steps-per-call > 1 (default: the engine's choice: for the remote backend "
                   "and torch on CUDA, whose steps run while the engine schedules, from 1 up "
                   "to 4 as far as a step deeper raises the step rate; 0 for torch on CPU and "
                   "mock, whose steps run to the end when submitted, where a step in flight "
                   "would only hand every token out a step late)")
    scheduling.add_argument("--no-overlap", action="store_const", const=0, dest="overlap_depth",
                   help="run each step to the end before scheduling the next "
                   "(--overlap-depth 0)")
    distributed.add_argument("--tensor-parallel-size", type=positive_int, default=1,
                   help="torch: split the model over this many ranks (torch.distributed: gloo "
                   "on CPU, NCCL on CUDA). Alone, the server spawns the other ranks itself; "
                   "under torchrun (several hosts) it must equal the world size, rank 0 serves "
                   "HTTP and the other ranks only run their shard (default 1)")
    distributed.add_argument("--tp-timeout", type=non_negative_float, default=None,
                   help="torch, tensor parallel: seconds a rank may keep the others waiting "
                   "in one collective before the group counts as failed (default 120)")
    auth.add_argument("--api-key", action="append", default=None,
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                   "(default: $IRON_BATCH_API_KEY; none when unset). Repeat it (or use "
                   "--api-key-file) for several keys: each key is a tenant, and tenants "
                   "never share prefix-cache blocks")
    auth.add_argument("--api-key-file", default=None,
                   help="read API keys from this file, one per line (blank lines and lines "
                   "starting with # are skipped); adds to --api-key")
    auth.add_argument("--shared-prefix-cache", action="store_true",
                   help="with several API keys: let tenants share prefix-cache blocks "
                   "(default: each key's requests get a cache salt of their own, so no "
                   "tenant can probe another's prompts through time to first token)")
    limits.add_argument("--max-waiting-requests", type=non_negative_int,
                   default=DEFAULT_MAX_WAITING_REQUESTS,
                   help="/generate and /v1 answer 503 + Retry-After while this many requests "
                   f"wait for admission (default {DEFAULT_MAX_WAITING_REQUESTS})")
    limits.add_argument("--max-waiting-tokens", type=positive_int, default=None,
                   help="503 + Retry-After while this many prompt tokens wait for their "
                   "first token (default: no limit)")
    limits.add_argument("--max-body-bytes", type=positive_int, default=MAX_BODY_BYTES,
                   help=f"larger request bodies are a 413 (default {MAX_BODY_BYTES})")
    limits.add_argument("--max-prompt-tokens", type=positive_int, default=None,
                   help="longer prompts are a 400 (default: what fits the KV pool / model)")
    limits.add_argument("--max-new-tokens-limit", type=positive_int, default=None,
                   help="max_new_tokens / max_tokens above this is a 400; an omitted /v1 "
                   "max_tokens is clamped to it (default: what fits)")
    limits.add_argument("--max-stream-buffer-events", type=non_negative_int,
                   default=DEFAULT_MAX_STREAM_BUFFER_EVENTS,
                   help="a client that leaves this many events unread (it stopped reading) "
                   f"has its request aborted and its KV blocks freed (default "
                   f"{DEFAULT_MAX_STREAM_BUFFER_EVENTS}; 0: never)")
    server.add_argument("--max-consecutive-step-failures", type=non_negative_int, default=8,
                   help="this many failed engine steps in a row (or one FatalBackendError) "
                   "is fatal: live requests get an error, /health fails, the process exits "
                   "with status 1 (default 8; 0: never)")
    server.add_argument("--drain-timeout", type=non_negative_float, default=30.0,
                   help="on SIGTERM: stop accepting, let in-flight requests finish for this "
                   "many seconds, then end the rest with finish_reason 'abort' and exit 0 "
                   "(default 30)")
    model.add_argument("--served-model-name", default=None,
                   help="model id of the /v1 endpoints (default: the backend's model name, "
                   "e.g. the checkpoint folder or short name; 'mock' for mock)")
    tuning.add_argument("--switch-interval-us", type=non_negative_float, default=200.0,
                   help="Python GIL switch interval in microseconds (default 200; Python's "
                   "own is 5000, which lets a busy HTTP loop delay each engine step by "
                   "up to 5 ms)")
    model.add_argument("--reasoning-parser", choices=("auto", "think", "gemma4", "none"),
                   default="auto",
                   help="split chat output into reasoning and answer: 'think' at "
                   "<think>...</think>, 'gemma4' at Gemma 4's <|channel>thought...<channel|>, "
                   "'none' never, 'auto' (default) when the model's chat template writes "
                   "either format's tags or its vocabulary has Gemma 4's channel tokens")
    model.add_argument("--embedding-pooling", choices=("auto", "last", "mean"), default="auto",
                   help="/v1/embeddings pooling: 'auto' (default) as the checkpoint's "
                   "sentence-transformers config says (last token without one), or "
                   "'last'/'mean'; normalised as that config says (yes without one)")
    server.add_argument("--no-ui", action="store_true",
                   help="do not serve the chat playground and dashboard page at /")
    server.add_argument("--log-level", default="warning",
                   choices=("critical", "error", "warning", "info", "debug"),
                   help="log level (default warning; access logs are off for speed)")
    return p


def api_keys(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """Every API key from --api-key, --api-key-file and $IRON_BATCH_API_KEY (the latter
    only when neither flag is given)."""
    keys = list(args.api_key or [])
    if args.api_key_file:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                lines = [line.strip() for line in f]
        except OSError as exc:
            parser.error(f"--api-key-file: {exc}")
        keys += [line for line in lines if line and not line.startswith("#")]
        if not keys:
            parser.error(f"--api-key-file {args.api_key_file}: no keys in it")
    if not keys and os.environ.get("IRON_BATCH_API_KEY"):
        keys = [os.environ["IRON_BATCH_API_KEY"]]
    if any(not k or any(c.isspace() for c in k) for k in keys):
        parser.error("API keys must be non-empty and contain no whitespace")
    return list(dict.fromkeys(keys))


def build_engine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Any:
    """Backend and engine from parsed flags; bad combinations exit through ``parser.error``."""
    from iron_batch.backends.build import (
        ALIASES,
        BackendConfigError,
        build_backend,
        scheduler_config,
        shared_options,
    )
    from iron_batch.engine import Engine

    if args.num_speculative_tokens is not None and args.speculative_method is None:
        parser.error("--num-speculative-tokens needs --speculative-method")
    if args.speculative_model is not None and args.speculative_method != "draft":
        parser.error("--speculative-model needs --speculative-method draft")
    if (args.speculative_method == "draft" and args.speculative_model is None
            and args.backend not in ("remote", *ALIASES)):
        # A remote backend's draft model is the worker's (its own --speculative-model).
        parser.error("--speculative-method draft needs --speculative-model")
    if args.speculative_quantization is not None and args.speculative_model is None:
        parser.error("--speculative-quantization needs --speculative-model")
    keys = getattr(args, "api_keys", None)
    if keys is None:
        keys = args.api_keys = api_keys(args, parser)
    try:
        backend = build_backend(
            args.backend,
            **shared_options(args),
            url=args.backend_url,
            # One server key doubles as the worker's by default (several: name it).
            api_key=args.backend_api_key or (keys[0] if len(keys) == 1 else None),
            timeout=args.backend_timeout,
            steps_per_call=args.steps_per_call,
            tensor_parallel_size=args.tensor_parallel_size,
            tp_timeout=args.tp_timeout,
        )
        config = scheduler_config(
            backend,
            total_kv_blocks=args.total_kv_blocks,
            kv_block_size=args.kv_block_size,
            max_batch_tokens=args.max_batch_tokens,
            max_running_seqs=args.max_running_seqs,
            enable_prefix_caching=not args.no_prefix_caching,
            num_speculative_tokens=speculative_tokens(args.speculative_method,
                                                      args.num_speculative_tokens),
            speculative_method=args.speculative_method,
        )
    except BackendConfigError as exc:
        parser.error(str(exc))
    method = args.speculative_method
    methods = getattr(backend, "speculative_methods", ())
    if method is not None and method not in methods:
        if args.backend in ("remote", *ALIASES):
            if args.steps_per_call > 1:
                parser.error(f"--speculative-method {method} needs --steps-per-call 1")
            if "draft" in methods:
                parser.error(f"--speculative-method {method}: the worker at "
                             f"{args.backend_url} runs a draft model, which fills every "
                             "proposal row (use --speculative-method draft)")
            parser.error(f"--speculative-method {method}: the worker at {args.backend_url} "
                         "does not verify it" + (" (start the worker with "
                         "--speculative-model)" if method == "draft" else ""))
        parser.error(f"--speculative-method needs the torch backend (not --backend "
                     f"{args.backend})")
    return Engine(
        backend,
        config,
        max_consecutive_failures=args.max_consecutive_step_failures,
        max_stream_buffer_events=args.max_stream_buffer_events,
        overlap_depth=args.overlap_depth,
    )


def uvicorn_options() -> dict[str, str]:
    """The fastest loop and HTTP parser installed (uvloop/httptools are C; the fallbacks
    are pure Python and cost throughput, not correctness)."""
    return {
        "loop": "uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        "http": "httptools" if importlib.util.find_spec("httptools") else "h11",
    }


def page_urls(host: str, port: int) -> list[str]:
    """Where to point a browser: a wildcard address is not one, so name loopback for it."""
    if host in ("0.0.0.0", "::", ""):
        return [f"http://localhost:{port}/  (listening on all interfaces)"]
    if ":" in host:
        host = f"[{host}]"
    return [f"http://{host}:{port}/"]


def _draining_server(
    config: Any, admission: Any, drain_timeout: float, started_text: str | None = None
) -> Any:
    """A uvicorn Server whose shutdown drains first (see Admission.drain): listeners close
    at once (new connections are refused), idle keep-alive connections close, requests
    still arriving on busy ones get a 503, in-flight ones get ``drain_timeout`` seconds.
    ``started_text`` is printed once it listens."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started and started_text:
                print(started_text, flush=True)

        async def shutdown(self, sockets: Any = None) -> None:
            for server in self.servers:
                server.close()
            for sock in sockets or []:
                sock.close()
            for connection in list(self.server_state.connections):
                connection.shutdown()
            await admission.drain(drain_timeout)
            await super().shutdown(sockets)

    return DrainingServer(config)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)  # string defaults go through type= too (parse_addr)
    args.api_keys = api_keys(args, parser)
    logging.basicConfig(level=args.log_level.upper())
    if args.switch_interval_us > 0:
        # The engine thread wakes from the backend (sleep, GPU wait) needing the GIL for
        # commit + publish; with the default 5 ms interval the asyncio thread, busy writing
        # the previous step's tokens, keeps it that long and the engine stalls.
        sys.setswitchinterval(args.switch_interval_us / 1e6)
    engine = build_engine(args, parser)

    import uvicorn

    from iron_batch.server.admission import ServerLimits
    from iron_batch.server.app import create_app

    host, port = args.addr
    limits = ServerLimits(
        max_body_bytes=args.max_body_bytes,
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=args.max_new_tokens_limit,
        max_waiting_requests=args.max_waiting_requests,
        max_waiting_tokens=args.max_waiting_tokens,
    )
    app = create_app(
        engine,
        api_key=args.api_keys or None,
        served_model_name=args.served_model_name,
        isolate_tenant_caches=not args.shared_prefix_cache,
        limits=limits,
        ui=not args.no_ui,
        reasoning_parser=args.reasoning_parser,
        pooling=_pooling(args),
    )
    from iron_batch.server.ui import banner

    started_text = banner(app.state.info, page_urls(host, port), ui=not args.no_ui)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=args.log_level,
        access_log=False,
        lifespan="on",
        # Our drain runs first; this only bounds handlers stuck writing to dead clients.
        timeout_graceful_shutdown=10,
        **uvicorn_options(),  # type: ignore[arg-type]
    )
    server = _draining_server(config, app.state.admission, args.drain_timeout, started_text)

    def on_fatal(message: str) -> None:  # the engine's thread; uvicorn polls the flag
        server.should_exit = True

    engine.on_fatal = on_fatal
    lost: list[str] = []
    if hasattr(engine.backend, "on_lost"):  # tensor parallel: a rank lost while idle

        def on_lost(message: str) -> None:  # the backend's thread
            lost.append(message)
            server.should_exit = True

        engine.backend.on_lost = on_lost
    failure = _serve(server, engine)
    if failure is not None:
        print(f"error: cannot serve on {host}:{port}: {failure}", file=sys.stderr)
        sys.exit(1)
    if engine.fatal_error is not None or lost:
        print(f"error: fatal engine fault: {engine.fatal_error or lost[0]}", file=sys.stderr)
        sys.exit(1)
    if not server.started:
        sys.exit(1)


def _serve(server: Any, engine: Any) -> str | None:
    """uvicorn on a thread of its own and the engine's step loop on this, the main, thread,
    until both have stopped; returns why uvicorn could not start (a port in use), else None.

    The step loop belongs on the thread that loaded the model: that thread's OpenMP team
    stays the only one, and glibc serves its allocations from the main arena, whose
    settings (``platform/heap.py``) keep a step's large temporaries in the heap. On any
    other thread, blocks above 64 MiB (a 64-row step's float32 logits over a large
    vocabulary, Qwen3.5's prompt temporaries) were mapped and faulted in at every step.
    Signals reach the main thread only; SIGINT and SIGTERM ask uvicorn to drain and stop,
    as its own handlers would (a second SIGINT stops without waiting), and the lifespan's
    end stops the loop. uvicorn re-raises no signal from a thread of its own, so a drained
    shutdown exits 0.
    """
    import threading

    failure: list[str] = []

    def serve() -> None:
        try:
            server.run()
        except SystemExit as exc:  # uvicorn's way out when it cannot listen (it logs why)
            if exc.code:
                failure.append("uvicorn stopped while starting (its log above says why)")
        except BaseException as exc:  # noqa: BLE001 -- reported on the main thread
            failure.append(f"{type(exc).__name__}: {exc}")
        finally:
            engine.shutdown(timeout=0)  # the loop ends even where no lifespan ran

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, server.handle_exit)
    http = threading.Thread(target=serve, name="iron-batch-http", daemon=True)
    engine.run(ready=http.start)  # started first, so the lifespan starts no thread of its own
    # A fatal fault or the lifespan's end stopped the loop: uvicorn stops too.
    server.should_exit = True
    while http.is_alive():
        http.join(0.2)
    return failure[0] if failure else None


def _pooling(args: argparse.Namespace) -> Any:
    """The embedding pooling of ``--embedding-pooling`` and the checkpoint folder's config."""
    from pathlib import Path

    from iron_batch.pooling import read_pooling_config

    folder = Path(args.model) if args.model and Path(args.model).is_dir() else None
    mode = None if args.embedding_pooling == "auto" else args.embedding_pooling
    return read_pooling_config(folder, mode)


#: Proposed tokens per sequence per step with --speculative-method and no count given.
DEFAULT_SPECULATIVE_TOKENS = 4


def speculative_tokens(method: str | None, count: int | None) -> int:
    """The scheduler's ``num_speculative_tokens`` from the two flags (0: off)."""
    if method is None:
        return 0
    return count if count is not None else DEFAULT_SPECULATIVE_TOKENS
