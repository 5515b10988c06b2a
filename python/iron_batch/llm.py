"""Offline batch generation: ``LLM(model=...).generate(prompts, SamplingParams(...))``.

Drives the same :class:`Engine` as the server, synchronously on the caller's thread (no
background thread, no asyncio): add every request, step until all have finished.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from iron_batch.engine import Engine
from iron_batch.sampling_params import SamplingParams

if TYPE_CHECKING:
    from iron_batch.backends.base import Backend

_SCHEDULER_KEYS = ("max_batch_tokens", "max_running_seqs", "enable_prefix_caching",
                  "num_speculative_tokens", "speculative_max_rows", "speculative_method")


#: Tokens a draft model (``speculative_model``) proposes per step when no count is given.
_DEFAULT_DRAFT_TOKENS = 4


@dataclass
class RequestOutput:
    """The result of one prompt."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    #: With ``SamplingParams.prompt_logprobs``: per prompt token, None for the first, else
    #: (its logprob, [(token id, logprob)] top alternatives).
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]] | None] | None = None
    #: With ``SamplingParams.embed``: the prompt's pooled final hidden state (a float32
    #: numpy vector, not normalised; see ``iron_batch.pooling``).
    embedding: Any = None


class LLM:
    """Generate for a list of prompts with continuous batching.

    ``model`` is a checkpoint directory, GGUF file or short name for the torch backend
    (``device``, ``dtype``, ``total_kv_blocks``, ``kv_cache_memory_gb``,
    ``kv_cache_dtype`` ("auto" or "int8": int8 K/V with a float scale per token and head,
    about twice the tokens in the same memory), ``recurrent_state_dtype`` ("float32" or
    "bfloat16": how a model with recurrent-state layers, Qwen3.5's, keeps each sequence's
    state) and ``quantization`` go to it;
    ``tensor_parallel_size`` > 1 splits the model over that many local processes, or over
    torchrun's ranks, ``tp_timeout`` bounding each collective;
    see ``iron_batch.parallel``); or
    pass any ``backend`` (e.g. ``MockBackend()``). ``overlap_depth``: steps kept in flight
    while the next is scheduled (0: none; None: one when the backend's ``submit`` returns
    before the step is done, as on CUDA, else none; see :mod:`iron_batch.engine`).
    ``speculative_model`` (with ``speculative_quantization``): a draft model with the same
    tokenizer that proposes ``num_speculative_tokens`` (default 4) tokens per step for
    the model to verify (see :mod:`iron_batch.draft_model`).
    Scheduler options (``total_kv_blocks``, ``kv_block_size``, ``max_batch_tokens``,
    ``max_running_seqs``, ``enable_prefix_caching``) are keyword arguments.
    """

    def __init__(
        self,
        model: str | None = None,
        backend: Backend | None = None,
        *,
        total_kv_blocks: int | None = None,
        kv_block_size: int | None = None,
        device: str | None = None,
        dtype: str | None = None,
        kv_cache_memory_gb: float | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str | None = None,
        recurrent_state_dtype: str | None = None,
        tensor_parallel_size: int = 1,
        tp_timeout: float | None = None,
        overlap_depth: int | None = None,
        speculative_model: str | None = None,
        speculative_quantization: str | None = None,
        **scheduler_kwargs: Any,
    ) -> None:
        unknown = set(scheduler_kwargs) - set(_SCHEDULER_KEYS)
        if unknown:
            raise TypeError(f"unknown LLM argument(s): {', '.join(sorted(unknown))}")
        # Lazy: importing iron_batch must not import torch (build_backend imports it when
        # asked for a torch backend).
        from iron_batch.backends.build import build_backend, scheduler_config

        if backend is None:
            if model is None:
                raise ValueError("pass model= (a checkpoint directory) or backend=")
            backend = build_backend(
                "torch",
                model=model,
                device=device,
                dtype=dtype,
                total_kv_blocks=total_kv_blocks,
                kv_block_size=kv_block_size,
                kv_cache_memory_gb=kv_cache_memory_gb,
                quantization=quantization,
                kv_cache_dtype=kv_cache_dtype,
                recurrent_state_dtype=recurrent_state_dtype,
                tensor_parallel_size=tensor_parallel_size,
                tp_timeout=tp_timeout,
                speculative_model=speculative_model,
                speculative_quantization=speculative_quantization,
            )
            if speculative_model is not None:
                scheduler_kwargs.setdefault("num_speculative_tokens",
                                            _DEFAULT_DRAFT_TOKENS)
        elif model is not None:
            raise ValueError("pass model= or backend=, not both")
        config = scheduler_config(
            backend,
            total_kv_blocks=total_kv_blocks,
            kv_block_size=kv_block_size,
            **scheduler_kwargs,
        )
        self.backend = backend
        self.engine = Engine(backend, config, overlap_depth=overlap_depth)
        self._next_id = 0

    def close(self) -> None:
        """Release what the backend holds beyond this process's memory (the other ranks
        of a tensor-parallel model); also done at interpreter exit."""
        close = getattr(self.backend, "close", None)
        if callable(close):
            close()

    @property
    def tokenizer(self) -> Any:
        return self.backend.tokenizer

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Outputs in the order of ``prompts``. A request the scheduler rejects (it can
        never fit) raises ValueError before anything runs; a fatal backend fault (see
        ``FatalBackendError``) raises RuntimeError."""
        items: list[str | Sequence[int]] = (
            [prompts] if isinstance(prompts, str) else list(prompts)
        )
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(items)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(items):
                raise ValueError("need one SamplingParams per prompt, or a single one")
        for params in params_list:
            params.validate()

        outputs: dict[str, RequestOutput] = {}
        order: list[str] = []
        for prompt, params in zip(items, params_list, strict=True):
            ids = self._encode(prompt)
            request_id = f"llm-{self._next_id}"
            self._next_id += 1
            outputs[request_id] = RequestOutput(request_id, ids)
            order.append(request_id)
            self.engine.add_request(request_id, ids, params)

        engine = self.engine
        try:
            while engine.has_unfinished():
                for event in engine.step():
                    out = outputs.get(event.request_id)
                    if out is None:
                        continue
                    if event.finish_reason == "rejected":
                        raise ValueError(f"request {order.index(event.request_id)}: {event.error}")
                    if event.prompt_logprobs is not None:
                        out.prompt_logprobs = event.prompt_logprobs
                    if event.embedding is not None:
                        out.embedding = event.embedding
                    if event.token_id is not None:
                        out.token_ids.append(event.token_id)
                    if event.text:
                        out.text += event.text
                    if event.finished:
                        out.finish_reason = event.finish_reason
        except BaseException:
            # Leave the engine clean for the next call (KeyboardInterrupt included).
            for request_id in order:
                engine.abort(request_id)
            while engine.has_unfinished():
                engine.step()
            raise
        if engine.fatal_error is not None:
            # The backend is gone for good (a lost tensor-parallel rank, a device lost):
            # every request ended with an error, and no later call can do better.
            raise RuntimeError(f"fatal engine fault: {engine.fatal_error}")
        return [outputs[r] for r in order]

    def _encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            tokenizer = self.backend.tokenizer
            if tokenizer is None:
                raise ValueError("text prompts need a backend with a tokenizer")
            return list(tokenizer.encode(prompt))
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("empty prompt")
        return ids
