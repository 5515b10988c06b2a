"""Backend construction and the scheduler configuration that matches it, for the server
CLI, the worker and the offline :class:`iron_batch.llm.LLM` alike.

Scheduler defaults are the Rust core's (``SchedulerConfig()``); nothing here restates them.
"""

from __future__ import annotations

from typing import Any

from iron_batch import flags
from iron_batch._core import CacheGroup, SchedulerConfig
from iron_batch.backends.base import Backend
from iron_batch.backends.mock import DEFAULT_PREFILL_TOKEN_LATENCY_US, DEFAULT_TOKEN_LATENCY_US
from iron_batch.backends.remote import DEFAULT_TIMEOUT_S
from iron_batch.layers import KV_CACHE_DTYPES, STATE_DTYPES

# ``--quantization`` modes of the torch backend (``iron_batch.layers.quant``).
from iron_batch.layers import QUANTIZATION_MODES as QUANTIZATION_MODES

#: Backend kinds; ``real`` is the old name of ``remote``.
BACKEND_KINDS = ("mock", "torch", "remote")
ALIASES = {"real": "remote"}
_TORCH_ONLY = ("model", "device", "dtype", "kv_cache_memory_gb", "quantization",
               "tensor_parallel_size", "kv_cache_dtype", "speculative_model",
               "recurrent_state_dtype")

#: The Rust core's scheduler defaults.
DEFAULTS = SchedulerConfig()


class BackendConfigError(ValueError):
    """A bad combination of options, or a backend that cannot be built from them; the
    message names the option (CLIs print it as a usage error)."""


#: Flags the server and the worker both parse (``iron_batch.flags``), passed on as they are.
SHARED_FLAGS = (*flags.MODEL_FLAGS, *flags.DRAFT_FLAGS, "--mock-token-latency-us",
                "--mock-prefill-token-latency-us")


def shared_options(args: Any) -> dict[str, Any]:
    """The :func:`build_backend` keywords the server's and the worker's parsed flags share."""
    return flags.values(args, SHARED_FLAGS)


def build_backend(
    kind: str,
    *,
    model: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    total_kv_blocks: int | None = None,
    kv_block_size: int | None = None,
    kv_cache_memory_gb: float | None = None,
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    recurrent_state_dtype: str | None = None,
    mock_token_latency_us: float = DEFAULT_TOKEN_LATENCY_US,
    mock_prefill_token_latency_us: float = DEFAULT_PREFILL_TOKEN_LATENCY_US,
    url: str | None = None,
    api_key: str | None = None,
    timeout: float = DEFAULT_TIMEOUT_S,
    steps_per_call: int = 1,
    tensor_parallel_size: int = 1,
    tp_timeout: float | None = None,
    speculative_model: str | None = None,
    speculative_quantization: str | None = None,
) -> Backend:
    """The backend of ``kind`` (mock, torch, remote; real = remote). A torch backend with
    ``tensor_parallel_size`` > 1 splits the model over that many ranks (see
    ``iron_batch.parallel``); under torchrun, ranks >= 1 never return from here.
    ``speculative_model``: a draft model the torch backend runs beside ``model``
    (``--speculative-method draft``), quantized as ``speculative_quantization`` says.
    ``recurrent_state_dtype``: how a model with recurrent-state layers keeps its states
    (float32 by default, or bfloat16)."""
    kind = ALIASES.get(kind, kind)
    if kv_cache_dtype is not None and kv_cache_dtype not in KV_CACHE_DTYPES:
        raise BackendConfigError(f"--kv-cache-dtype {kv_cache_dtype!r} is not one of "
                                 f"{', '.join(KV_CACHE_DTYPES)}")
    if recurrent_state_dtype is not None and recurrent_state_dtype not in STATE_DTYPES:
        raise BackendConfigError(f"--recurrent-state-dtype {recurrent_state_dtype!r} is not "
                                 f"one of {', '.join(STATE_DTYPES)}")
    if kind != "torch":
        given = {"model": model, "device": device, "dtype": dtype,
                 "kv_cache_memory_gb": kv_cache_memory_gb, "quantization": quantization,
                 "tensor_parallel_size": tensor_parallel_size > 1,
                 "kv_cache_dtype": kv_cache_dtype not in (None, "auto"),
                 "speculative_model": speculative_model,
                 "recurrent_state_dtype": recurrent_state_dtype not in (None, "float32")}
        for name in _TORCH_ONLY:
            if given[name]:
                raise BackendConfigError(f"--{name.replace('_', '-')} only applies to "
                                         "--backend torch")
    if kind == "mock":
        from iron_batch.backends.mock import MockBackend

        return MockBackend(
            token_latency_us=mock_token_latency_us,
            prefill_token_latency_us=mock_prefill_token_latency_us,
        )
    if kind == "torch":
        if not model:
            raise BackendConfigError("--backend torch requires --model PATH")
        if speculative_quantization and not speculative_model:
            raise BackendConfigError("--speculative-quantization needs --speculative-model")
        if tensor_parallel_size > 1:
            if speculative_model:
                raise BackendConfigError("--speculative-model is not supported with "
                                         "--tensor-parallel-size > 1")
            return _tensor_parallel_backend(
                model, tensor_parallel_size, device=device, dtype=dtype,
                total_kv_blocks=total_kv_blocks, kv_block_size=kv_block_size,
                kv_cache_memory_gb=kv_cache_memory_gb, quantization=quantization,
                timeout=tp_timeout, kv_cache_dtype=kv_cache_dtype,
                recurrent_state_dtype=recurrent_state_dtype)
        # Imported lazily: the mock server must not need (or pay for) torch.
        from iron_batch.backends.torch_backend import TorchBackend
        from iron_batch.draft_model import DraftModelError

        try:
            return TorchBackend.from_model(
                model,
                device=device or "auto",
                dtype=dtype or "auto",
                total_kv_blocks=total_kv_blocks,
                kv_block_size=kv_block_size or DEFAULTS.kv_block_size,
                kv_cache_memory_gb=kv_cache_memory_gb or None,
                quantization=quantization or None,
                kv_cache_dtype=kv_cache_dtype or "auto",
                recurrent_state_dtype=recurrent_state_dtype or "float32",
                speculative_model=speculative_model or None,
                speculative_quantization=speculative_quantization or None,
            )
        except DraftModelError as exc:
            raise BackendConfigError(f"--speculative-model {speculative_model!r}: {exc}") from exc
        except (OSError, ValueError) as exc:
            raise BackendConfigError(f"cannot load --model {model!r}: {exc}") from exc
    if kind == "remote":
        if not url:
            raise BackendConfigError(f"--backend {kind} requires --backend-url")
        from iron_batch.backends.remote import RemoteBackend

        try:
            return RemoteBackend(url, api_key=api_key, timeout=timeout,
                                 steps_per_call=steps_per_call)
        except (OSError, ValueError) as exc:
            raise BackendConfigError(f"cannot use worker {url!r}: {exc}") from exc
    raise BackendConfigError(f"unknown backend {kind!r} (one of {', '.join(BACKEND_KINDS)})")


def _tensor_parallel_backend(
    model: str, world: int, *, device: str | None, dtype: str | None,
    total_kv_blocks: int | None, kv_block_size: int | None,
    kv_cache_memory_gb: float | None, quantization: str | None, timeout: float | None,
    kv_cache_dtype: str | None = None,
    recurrent_state_dtype: str | None = None,
) -> Backend:
    from iron_batch.models.partition import TensorParallelError
    from iron_batch.parallel.backend import TensorParallelTorchBackend
    from iron_batch.parallel.group import DEFAULT_TIMEOUT_S

    try:
        return TensorParallelTorchBackend.from_model(
            model,
            tensor_parallel_size=world,
            device=device or "auto",
            dtype=dtype or "auto",
            total_kv_blocks=total_kv_blocks,
            kv_block_size=kv_block_size or DEFAULTS.kv_block_size,
            kv_cache_memory_gb=kv_cache_memory_gb or None,
            quantization=quantization or None,
            kv_cache_dtype=kv_cache_dtype or "auto",
            recurrent_state_dtype=recurrent_state_dtype or "float32",
            timeout_s=timeout or DEFAULT_TIMEOUT_S,
        )
    except TensorParallelError as exc:
        raise BackendConfigError(f"--tensor-parallel-size {world}: {exc}") from exc
    except (OSError, ValueError, RuntimeError) as exc:
        raise BackendConfigError(f"cannot load --model {model!r} over {world} ranks: "
                                 f"{exc}") from exc


def scheduler_config(
    backend: Backend,
    *,
    total_kv_blocks: int | None = None,
    kv_block_size: int | None = None,
    **options: Any,
) -> SchedulerConfig:
    """A scheduler configuration that fits ``backend``: a backend that owns KV storage
    (torch, remote) decides the pool's geometry, and the arguments may only use less of it;
    otherwise the arguments do, with the core's defaults. ``options``: the other
    ``SchedulerConfig`` fields (max_batch_tokens, max_running_seqs, enable_prefix_caching).
    """
    own_blocks = backend.num_kv_blocks
    own_size = backend.kv_block_size
    if own_blocks is not None and total_kv_blocks is not None and total_kv_blocks > own_blocks:
        raise BackendConfigError(f"--total-kv-blocks {total_kv_blocks} exceeds the backend's "
                                 f"{own_blocks} blocks")
    if own_size is not None and kv_block_size is not None and kv_block_size != own_size:
        raise BackendConfigError(f"--kv-block-size {kv_block_size} differs from the "
                                 f"backend's {own_size}")
    blocks = int(total_kv_blocks or own_blocks or DEFAULTS.total_kv_blocks)
    if ("draft" in getattr(backend, "speculative_methods", ())
            and options.get("num_speculative_tokens")
            and options.get("speculative_method") is None):
        # The backend's draft model proposes (the core reserves the rows).
        options["speculative_method"] = "draft"
    # A model with sliding-window layers has a cache group per kind of layer (the backend
    # sizes their pools; ``total_kv_blocks`` may only shrink each).
    groups = [CacheGroup(g.kind, min(g.size, total_kv_blocks or g.size), window=g.window,
                         unit_bytes=g.unit_bytes)
              for g in getattr(backend, "cache_groups", None) or []]
    try:
        return SchedulerConfig(
            total_kv_blocks=blocks,
            kv_block_size=int(own_size or kv_block_size or DEFAULTS.kv_block_size),
            max_model_len=backend.max_model_len,
            cache_groups=groups,
            **{k: v for k, v in options.items() if v is not None},
        )
    except (ValueError, OverflowError) as exc:
        raise BackendConfigError(f"invalid scheduler configuration: {exc}") from exc
