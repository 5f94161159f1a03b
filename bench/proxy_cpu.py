"""The router's own CPU per request, in process: its proxy against the bare forwarder's
Starlette route, with the network and the upstream client left out.

Why: ``bench/side_by_side.py`` measures what a client gets, but on the shared
2-core machine its figures move by 10-30 % between runs, more than one change to
the router's hot path is worth (docs/benchmarks.md). Here both apps are called as
ASGI apps in one event loop (uvloop), on one fixed ``POST /v1/completions``, with
a stand-in upstream session that answers at once: a **fake**, so what is measured
is the code each app runs of its own (the router's ``Proxy``; the forwarder's
Starlette routing, request and response), not aiohttp, uvicorn or a socket, which
both share. Process CPU time (``time.process_time``) over ``--requests`` requests,
in ``--rounds`` alternating rounds, after a warm-up; the median and min-max of the
rounds. It moves less than a side-by-side figure, but still with the machine's
speed (the forwarder's own figure was 14-22 us in runs minutes apart on
2026-12-03): compare the two apps of one run, not runs.

The router runs with its defaults (least-outstanding routing, token accounting on,
no API keys), one model ``bench`` with one replica. ``--profile`` prints where the
router's time goes (cProfile, which adds its own cost per call: shares, not
microseconds).

Usage::

    python bench/proxy_cpu.py [--requests 20000] [--rounds 5] [--profile] [--output json]

Exit codes: 0 measured; 1 an app answered something other than 200.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import pstats
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import forwarder  # bench/forwarder.py
import uvloop
from _support import REPO

from llmgw_contract import ModelRecord
from router.app import create_app
from router.catalog import ServiceAddress
from router.proxy import Receive, Scope, Send
from router.serving import BODY_WHOLE
from router.settings import RouterSettings

MODEL = "bench"
BODY = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 1}).encode()
ANSWER = json.dumps(
    {"id": "cmpl-bench", "object": "text_completion", "model": MODEL,
     "choices": [{"index": 0, "text": " world", "finish_reason": "length"}],
     "usage": {"prompt_tokens": 2, "completion_tokens": 1, "total_tokens": 3}}
).encode()  # fmt: skip
# What wrk sends (bench/side_by_side.py), and what nginx answers.
REQUEST_HEADERS = [
    (b"host", b"127.0.0.1:8000"),
    (b"content-type", b"application/json"),
    (b"content-length", str(len(BODY)).encode()),
]
ANSWER_HEADERS = (
    (b"Server", b"nginx"),
    (b"Date", b"Thu, 03 Dec 2026 14:00:00 GMT"),
    (b"Content-Type", b"application/json"),
    (b"Content-Length", str(len(ANSWER)).encode()),
    (b"Connection", b"keep-alive"),
)

App = Callable[[Scope, Receive, Send], Awaitable[None]]


class StandInResponse:
    """What both apps read of an aiohttp response; answers at once."""

    status = 200
    content_type = "application/json"
    raw_headers = ANSWER_HEADERS

    async def read(self) -> bytes:
        return ANSWER

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass

    async def __aenter__(self) -> StandInResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        pass


class StandInSession:
    """The upstream session both apps hold (a fake: see the module docstring)."""

    timeout = None

    async def request(self, method: str, url: object, **kwargs: object) -> StandInResponse:
        return StandInResponse()

    def post(self, url: object, **kwargs: object) -> StandInResponse:
        return StandInResponse()

    async def close(self) -> None:
        pass


def router_app() -> App:
    """The router's proxy for one model with one replica, its session the stand-in."""
    app = create_app(RouterSettings())
    table = app.state.table
    table.set_models({MODEL: ModelRecord(name=MODEL, definition_hash="h", replicas=1)})
    table.set_services((MODEL,))
    table.set_states({})
    table.set_endpoints(MODEL, [ServiceAddress("127.0.0.1", 9)])
    proxy = app.state.proxy
    proxy.session = StandInSession()
    return proxy


async def forwarder_app(stack: contextlib.AsyncExitStack) -> App:
    """The forwarder's Starlette app, its lifespan entered with the stand-in session."""
    real = forwarder.aiohttp.ClientSession
    forwarder.aiohttp.ClientSession = lambda *a, **k: StandInSession()  # type: ignore[assignment]
    app = forwarder.create_app("http://127.0.0.1:9")
    try:
        await stack.enter_async_context(app.router.lifespan_context(app))
    finally:
        forwarder.aiohttp.ClientSession = real  # type: ignore[assignment]
    return app


async def cpu_per_request(app: App, requests: int) -> float:
    """Microseconds of process CPU per request over ``requests`` requests; raises
    ``SystemExit(1)`` unless every answer was 200."""
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
        "scheme": "http", "path": "/v1/completions", "raw_path": b"/v1/completions",
        "query_string": b"", "root_path": "", "headers": REQUEST_HEADERS,
        "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 50000),
        # As router.serving marks a body received whole before the app ran.
        "extensions": {BODY_WHOLE: True},
    }  # fmt: skip
    message = {"type": "http.request", "body": BODY, "more_body": False}
    statuses: list[int] = []

    async def receive() -> dict:
        return message

    async def send(event: dict) -> None:
        if event["type"] == "http.response.start":
            statuses.append(event["status"])

    started = time.process_time()
    for _ in range(requests):
        await app(dict(scope), receive, send)
    spent = time.process_time() - started
    if set(statuses) != {200}:
        raise SystemExit(f"an app answered {sorted(set(statuses))}, not only 200")
    return spent / requests * 1e6


async def measure(requests: int, rounds: int, profile: bool) -> dict[str, Any]:
    async with contextlib.AsyncExitStack() as stack:
        apps = {"router": router_app(), "forwarder": await forwarder_app(stack)}
        for app in apps.values():
            await cpu_per_request(app, 2000)  # warm-up: caches, first label children
        figures: dict[str, list[float]] = {name: [] for name in apps}
        for i in range(rounds):
            for name in list(apps) if i % 2 == 0 else list(reversed(apps)):
                figures[name].append(await cpu_per_request(apps[name], requests))
        if profile:
            profiler = cProfile.Profile()
            profiler.enable()
            await cpu_per_request(apps["router"], requests)
            profiler.disable()
            pstats.Stats(profiler).sort_stats("tottime").print_stats(30)
    return {
        name: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v)}
        for name, v in figures.items()
    } | {"requests": requests, "rounds": rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=20000, help="per app and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profile", action="store_true", help="cProfile the router after")
    parser.add_argument("--output", choices=("table", "json"), default="table")
    args = parser.parse_args()
    result = uvloop.run(measure(args.requests, args.rounds, args.profile))
    if args.output == "json":
        print(json.dumps(result, indent=1))
        return
    print(
        f"own CPU per request, in process, {args.rounds} rounds of {args.requests} "
        f"(median, min-max); repo {REPO}"
    )
    for name in ("forwarder", "router"):
        f = result[name]
        print(f"{name:10s} {f['median_us']:6.1f} us ({f['min_us']:.1f}-{f['max_us']:.1f})")
    extra = result["router"]["median_us"] - result["forwarder"]["median_us"]
    print(f"router - forwarder: {extra:+.1f} us a request")


if __name__ == "__main__":
    main()
