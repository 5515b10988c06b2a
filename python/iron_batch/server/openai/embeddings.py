"""``POST /v1/embeddings``: OpenAI's embeddings endpoint on the served decoder.

Each input (a string or a list of token ids) is one engine request with
``SamplingParams.embed`` set and one token to sample (never returned), so embeddings run
through the scheduler as prefill work in the same batches as generation; the backend pools
the prompt's final-normed hidden states (:mod:`iron_batch.pooling`). ``dimensions`` keeps
the first that many components (Matryoshka checkpoints such as Qwen3-Embedding train for
it) and is then normalised again when the checkpoint normalises. ``encoding_format``
``base64`` sends the float32 little-endian bytes, as OpenAI's client expects.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from iron_batch.pooling import PoolingConfig, finish_embedding
from iron_batch.sampling_params import SamplingParams
from iron_batch.server import fields
from iron_batch.server.admission import check_size
from iron_batch.server.asgi import Scope, Send, dumps, send_error, send_json
from iron_batch.server.errors import ApiError
from iron_batch.server.fields import MAX_CHOICES
from iron_batch.server.openai.protocol import OpenAIRequest, check_model
from iron_batch.server.openai.serving import GenerationEndpoint, OpenAIServer
from iron_batch.stream import RequestStream


@dataclass
class EmbeddingContext:
    encoding: str
    dimensions: int | None


def _inputs(value: Any, server: OpenAIServer) -> list[list[int]]:
    model = server.model
    if isinstance(value, str) or (isinstance(value, list) and value and all(
            isinstance(t, int) and not isinstance(t, bool) for t in value)):
        items: list[Any] = [value]
    elif isinstance(value, list) and value:
        items = value
    else:
        raise ApiError("input must be a string, a list of strings, a list of token ids or a "
                       "list of token-id lists", param="input")
    if len(items) > MAX_CHOICES:
        raise ApiError(f"at most {MAX_CHOICES} inputs per request", param="input")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise ApiError("an input is an empty string", param="input")
            ids = fields.encode_text(model.tokenizer, item, "input")
            if not ids:
                raise ApiError("an input encodes to no tokens", param="input")
        else:
            ids = list(fields.token_ids(item, "input", model.vocab_size))
        check_size(model.limits, len(ids), 1, prompt_param="input", new_tokens_param="input")
        if len(ids) + 1 > model.max_seq_tokens:
            raise ApiError(f"an input has {len(ids)} tokens; this server fits at most "
                           f"{model.max_seq_tokens - 1}", param="input",
                           code="context_length_exceeded")
        prompts.append(ids)
    return prompts


def parse_embeddings(body: dict[str, Any], server: OpenAIServer,
                     pooling: PoolingConfig) -> tuple[OpenAIRequest, EmbeddingContext]:
    name = check_model(body, server.model)
    if not server.embeddings:
        raise ApiError("this server's backend does not compute embeddings (a torch model "
                       "does)", param="input")
    if body.get("input") is None:
        raise ApiError("input is required", param="input")
    encoding = body.get("encoding_format") or "float"
    if encoding not in ("float", "base64"):
        raise ApiError("encoding_format must be float or base64", param="encoding_format")
    dimensions = body.get("dimensions")
    size = server.embedding_size
    if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(
            dimensions, int) or not 1 <= dimensions <= (size or 0)):
        raise ApiError(f"dimensions must be an integer in [1, {size}]", param="dimensions")
    prompts = _inputs(body["input"], server)
    params = [[SamplingParams(max_new_tokens=1, embed=pooling.mode)] for _ in prompts]
    req = OpenAIRequest("completion", name, prompts, [None] * len(prompts), params, 1)
    return req, EmbeddingContext(encoding, dimensions)


class EmbeddingsEndpoint(GenerationEndpoint):
    """POST /v1/embeddings."""

    id_prefix = "embd-"

    def __init__(self, server: OpenAIServer, pooling: PoolingConfig) -> None:
        super().__init__(server)
        self.pooling = pooling

    def parse(self, body: dict[str, Any], scope: Scope) -> tuple[OpenAIRequest, Any]:
        return parse_embeddings(body, self.server, self.pooling)

    async def respond(self, req: OpenAIRequest, context: Any, response_id: str,
                      streams: list[RequestStream], send: Send) -> None:
        ctx: EmbeddingContext = context
        choices = await self.results(streams, send)
        if choices is None:
            return
        data = []
        for index, choice in enumerate(choices):
            if choice.embedding is None:
                await send_error(send, ApiError("the backend returned no embedding",
                                                status=500))
                return
            vector = finish_embedding(choice.embedding, self.pooling.normalize, ctx.dimensions)
            value: Any = (base64.b64encode(vector.astype("<f4").tobytes()).decode()
                          if ctx.encoding == "base64" else vector.tolist())
            data.append({"object": "embedding", "index": index, "embedding": value})
        tokens = sum(len(p) for p in req.prompts)
        body = {"object": "list", "data": data, "model": req.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}
        await send_json(send, 200, dumps(body))
