"""The reference the router's hot path is held to: a bare Starlette + aiohttp forwarder.

Issue 10 ("Performance"): the router must add no more latency than this and
carry at least its requests/s, with a p99 no worse, measured in the same run
(bench/router_overhead.py starts it beside the router against the same stub).

What it does is the least a forwarder can do and still be a real one: one
Starlette route, ``POST /v1/completions``; read the body, send it with the
client's headers (less the hop-by-hop ones) to one fixed upstream over one
shared aiohttp keep-alive pool, and return the upstream's status, content type
and body. No model lookup, no balancing, no limits, no metrics, no error shape.
Served by uvicorn with the router's own settings (uvloop, httptools, no access
log, no server header, no proxy headers).

Usage (the bench starts it; by hand)::

    python bench/forwarder.py --port 9000 --upstream http://127.0.0.1:9001
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import AsyncIterator

import aiohttp
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

_HOP_BY_HOP = frozenset(
    {
        "host",
        "content-length",
        "connection",
        "keep-alive",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
    }
)


def create_app(upstream: str) -> Starlette:
    """The forwarder for ``upstream`` (``http://host:port``)."""
    session: aiohttp.ClientSession | None = None
    target = upstream.rstrip("/") + "/v1/completions"

    async def forward(request: Request) -> Response:
        assert session is not None
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k not in _HOP_BY_HOP}
        async with session.post(target, data=body, headers=headers) as resp:
            data = await resp.read()
            return Response(data, status_code=resp.status, media_type=resp.content_type)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        nonlocal session
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256, keepalive_timeout=4),
            auto_decompress=False,
        )
        try:
            yield
        finally:
            await session.close()

    return Starlette(
        routes=[Route("/v1/completions", forward, methods=["POST"])], lifespan=lifespan
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    uvicorn.run(
        create_app(args.upstream),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        server_header=False,
        proxy_headers=False,
        backlog=2048,
    )


if __name__ == "__main__":
    main()
