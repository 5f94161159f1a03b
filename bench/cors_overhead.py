"""What CORS adds to a request in the router's ASGI entry (router.app.with_cors).

Calls an ASGI app that answers at once, 100,000 times each: bare, behind
Starlette's ``CORSMiddleware`` alone, and behind the router's gate
(``with_cors``: only requests with an ``Origin`` header reach the middleware),
with and without an allowed ``Origin``. Prints microseconds per request. No
network and no server: the figure is the entry's CPU cost only. Usage::

    python bench/cors_overhead.py [--requests 100000]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from starlette.middleware.cors import CORSMiddleware

from router.app import with_cors

ORIGIN = "https://app.example.com"
HEADERS = [(b"host", b"x"), (b"content-type", b"application/json"), (b"content-length", b"40")]


async def answer(scope: dict, receive: object, send: object) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"{}"})  # type: ignore[operator]


async def per_request_us(app: object, headers: list, n: int) -> float:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers}

    async def send(message: dict) -> None:
        pass

    async def receive() -> dict:
        return {"type": "http.request", "body": b""}

    started = time.perf_counter()
    for _ in range(n):
        await app(scope, receive, send)  # type: ignore[operator]
    return (time.perf_counter() - started) / n * 1e6


async def main(n: int) -> None:
    starlette = CORSMiddleware(answer, allow_origins=[ORIGIN], allow_headers=["*"])
    gated = with_cors(answer, (ORIGIN,))
    with_origin = [*HEADERS, (b"origin", ORIGIN.encode())]
    bare = await per_request_us(answer, HEADERS, n)
    rows = [
        ("bare", bare),
        ("CORSMiddleware, no Origin", await per_request_us(starlette, HEADERS, n)),
        ("router gate, no Origin", await per_request_us(gated, HEADERS, n)),
        ("router gate, allowed Origin", await per_request_us(gated, with_origin, n)),
    ]
    for label, us in rows:
        print(f"{label:<30} {us:6.2f} us  (+{us - bare:.2f})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=100_000)
    asyncio.run(main(parser.parse_args().requests))
