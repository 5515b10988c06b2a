"""Ceiling for the streaming benchmark: a bare Starlette endpoint, no engine.

POST /generate streams ``max_new_tokens`` NDJSON lines in the same format as the iron-batch
server (one ``send`` per line, through Starlette's StreamingResponse), as fast as the
connection takes them. The bench client against this measures what HTTP streaming alone
costs on this machine; iron-batch's tok/s divided by this is the engine's efficiency.

    python benches/bare_stream_server.py --addr 127.0.0.1:8081
    python -m iron_batch.bench_client --url http://127.0.0.1:8081
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

_LINE = b'{"token_index":%d,"token_id":%d,"done":false}\n'
_LAST = b'{"token_index":%d,"token_id":%d,"done":true,"finish_reason":"length"}\n'


async def _lines(n: int) -> AsyncIterator[bytes]:
    if n == 0:
        yield b'{"token_index":0,"token_id":null,"done":true,"finish_reason":"length"}\n'
        return
    for i in range(n - 1):
        yield _LINE % (i, i)
    yield _LAST % (n - 1, n - 1)


async def generate(request: Request) -> Response:
    body = json.loads(await request.body())
    n = int(body.get("max_new_tokens", 16))
    return StreamingResponse(_lines(n), media_type="application/x-ndjson")


async def metrics(request: Request) -> Response:
    return JSONResponse({})


app = Starlette(
    routes=[
        Route("/generate", generate, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--addr", default="127.0.0.1:8081", help="HOST:PORT")
    args = parser.parse_args()
    host, _, port = args.addr.rpartition(":")
    uvicorn.run(
        app,
        host=host,
        port=int(port),
        log_level="warning",
        access_log=False,
        # Same server stack as iron-batch, so the comparison is about the engine only.
        loop="uvloop" if importlib.util.find_spec("uvloop") else "asyncio",
        http="httptools" if importlib.util.find_spec("httptools") else "h11",
    )


if __name__ == "__main__":
    main()
