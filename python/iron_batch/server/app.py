"""The Starlette app: routes, /metrics, /health and the engine's lifespan.

The front ends live in their own modules: :mod:`iron_batch.server.generate` (/generate,
NDJSON), :mod:`iron_batch.server.openai.serving` (/v1 chat and completions, /tokenize,
/detokenize), :mod:`iron_batch.server.openai.responses_api` (/v1/responses),
:mod:`iron_batch.server.openai.embeddings` (/v1/embeddings) and
:mod:`iron_batch.server.anthropic.messages` (/v1/messages). Imports run one way: errors ->
fields -> admission -> asgi -> front ends -> app.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time
from collections.abc import AsyncIterator, Sequence

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from iron_batch.engine import Engine
from iron_batch.pooling import PoolingConfig
from iron_batch.server.admission import Admission, ServerLimits
from iron_batch.server.anthropic.messages import message_routes
from iron_batch.server.asgi import api_key_bytes, guarded
from iron_batch.server.generate import GenerateEndpoint
from iron_batch.server.metrics import (
    make_registry,
    metrics_json,
    prometheus_text,
    wants_prometheus,
)
from iron_batch.server.openai.embeddings import EmbeddingsEndpoint
from iron_batch.server.openai.responses_api import (
    MAX_STORED_RESPONSES,
    ResponseStore,
    response_routes,
)
from iron_batch.server.openai.serving import OpenAIServer
from iron_batch.server.openapi import openapi_schema
from iron_batch.server.ui import UI, server_info

#: /health fails when the engine has been inside one loop iteration this long: a step
#: that slow is a hang (a long CPU prefill takes seconds, not a minute).
HEALTH_STALL_S = 60.0


def create_app(
    engine: Engine,
    *,
    api_key: str | Sequence[str] | None = None,
    max_waiting_requests: int | None = None,
    served_model_name: str | None = None,
    limits: ServerLimits | None = None,
    ui: bool = True,
    isolate_tenant_caches: bool = True,
    reasoning_parser: str = "auto",
    pooling: PoolingConfig | None = None,
    max_stored_responses: int = MAX_STORED_RESPONSES,
) -> Starlette:
    """The server app; its lifespan starts the engine's thread (unless the engine already
    runs, as the command line runs it on the main thread) and stops the engine.

    ``limits`` bound bodies, prompts, max_new_tokens and the waiting queue on every
    generation endpoint; ``max_waiting_requests``, when given, overrides its queue cap
    (503 + Retry-After beyond it). ``served_model_name`` is the model id of /v1 (default:
    the backend's model_name). ``app.state.admission`` drains the app at shutdown.
    ``ui`` serves the page for people at ``/`` (see :mod:`iron_batch.server.ui`);
    ``app.state.info`` is the configuration it and the console banner show.
    ``api_key`` may be several keys, one per tenant: then, with ``isolate_tenant_caches``,
    each key's requests get a prefix-cache salt of their own (no tenant can time another's
    prompts through the cache). ``reasoning_parser`` (auto, think, gemma4, none) says how chat
    output splits into reasoning and answer (see :mod:`iron_batch.server.openai.reasoning`).
    ``pooling`` is how /v1/embeddings pools (default: last token, normalised; see
    :func:`iron_batch.pooling.read_pooling_config`). ``max_stored_responses`` bounds the
    Responses API's store (all tenants together; the oldest is evicted first).
    """
    limits = dataclasses.replace(limits) if limits is not None else ServerLimits()
    if max_waiting_requests is not None:
        limits.max_waiting_requests = max_waiting_requests
    admission = Admission(engine, limits)
    registry = make_registry(engine.stats)
    key = api_key_bytes(api_key)
    tenant_keys = key if isinstance(key, tuple) and isolate_tenant_caches else None
    openai_server = OpenAIServer(
        engine, api_key=key, admission=admission, served_model_name=served_model_name,
        tenant_keys=tenant_keys, reasoning_parser=reasoning_parser,
    )
    schema = openapi_schema(openai_server.model.name, ui=ui)
    info = server_info(
        engine,
        model_name=openai_server.model.name,
        max_seq_tokens=openai_server.model.max_seq_tokens,
        limits=limits,
        auth=key is not None,
    )
    page = UI(engine, info, key) if ui else None

    async def metrics(request: Request) -> Response:
        accept = request.headers.get("accept", "")
        if wants_prometheus(accept):
            body, content_type = prometheus_text(registry, accept)
            return Response(body, media_type=content_type)
        return Response(json.dumps(metrics_json(engine.stats)), media_type="application/json")

    async def health(request: Request) -> Response:
        if engine.fatal_error is not None:
            return JSONResponse(
                {"status": "engine failed", "error": engine.fatal_error}, status_code=503
            )
        if engine.started and not engine.running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        if (
            engine.started
            and not engine.idle
            and time.monotonic() - engine.heartbeat > HEALTH_STALL_S
        ):
            return JSONResponse({"status": "engine stalled"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def openapi(request: Request) -> Response:
        return JSONResponse(schema)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        if not engine.started:
            engine.start()
        try:
            if page is None:
                yield
            else:
                async with page.running():
                    yield
        finally:
            # Joining the thread blocks; do it off the loop so late deliveries still land.
            await asyncio.to_thread(engine.shutdown)

    routes = [
        Route("/generate", GenerateEndpoint(engine, key, admission, tenant_keys),
              methods=["POST"]),
        *openai_server.routes(),
        *response_routes(openai_server, ResponseStore(max_stored_responses)),
        *message_routes(openai_server),
        Route("/v1/embeddings", EmbeddingsEndpoint(openai_server, pooling or PoolingConfig()),
              methods=["POST"]),
        Route("/metrics", guarded(metrics, key), methods=["GET"]),
        Route("/health", health, methods=["GET"]),  # never needs the API key
        Route("/openapi.json", guarded(openapi, key), methods=["GET"]),
        *(page.routes() if page is not None else []),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.engine = engine
    app.state.registry = registry
    app.state.admission = admission
    app.state.info = info
    return app
