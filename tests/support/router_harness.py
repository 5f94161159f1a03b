"""The router app run in a test's event loop, without its lifespan, and the
real aiohttp servers on 127.0.0.1 it talks to (a stand-in planner, upstream
replicas).

Used by the router's unit tests (tests/unit/router/test_activation.py,
test_admission.py, test_proxy.py) and the router's contract test
(tests/unit/contract/test_router_reads.py). No Consul: a test writes the
models, services, states and endpoints into the app's table by hand, as the
Consul watch would. The lifespan with real Consul is tested in
tests/integration/test_router_consul.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
from aiohttp import web
from fastapi import FastAPI

from llmgw_contract import ModelRecord
from router.activation import Activator
from router.app import control_session, create_app, upstream_session
from router.catalog import ServiceAddress
from router.endpoints import EndpointTable, ModelEntry
from router.settings import RouterSettings
from tests.support.ports import free_port


def run(scenario: Coroutine[Any, Any, None], timeout: float = 20) -> None:
    """Run `scenario` in a fresh event loop; TimeoutError after `timeout` s."""
    asyncio.run(asyncio.wait_for(scenario, timeout))


async def until(condition: Callable[[], object], within_s: float = 10.0, what: str = "") -> None:
    """Return once ``condition()`` is true, polled every 5 ms; AssertionError naming
    `what` after `within_s` s. A test waits on this, never on a fixed sleep: a sleep
    long enough on an idle machine is too short on a loaded one."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s:g} s: {what or condition}")
        await asyncio.sleep(0.005)


def count_activation_steps(monkeypatch: pytest.MonkeyPatch) -> tuple[Counter[str], Counter[str]]:
    """Count, per model, the requests that entered the activator
    (:class:`router.activation.Activator` called) and its waits for a change
    (:meth:`router.endpoints.ModelEntry.wait_changed` called): (entered, waits).

    A spy, not a fake: both run as they would. Each count rises synchronously
    before the call first suspends, so once a test (which runs only while the
    router's tasks are suspended) sees ``waits[m] == n``, a request for `m` is
    blocked in its n-th wait, having checked the entry after every change
    before it (what "still waiting" means, with no fixed sleep).
    """
    entered: Counter[str] = Counter()
    waits: Counter[str] = Counter()
    call, wait_changed = Activator.__call__, ModelEntry.wait_changed

    async def counted_call(self: Activator, entry: ModelEntry) -> None:
        entered[entry.name] += 1
        await call(self, entry)

    async def counted_wait(self: ModelEntry, timeout_s: float) -> bool:
        waits[self.name] += 1
        return await wait_changed(self, timeout_s)

    monkeypatch.setattr(Activator, "__call__", counted_call)
    monkeypatch.setattr(ModelEntry, "wait_changed", counted_wait)
    return entered, waits


class LocalServer:
    """A real aiohttp server on 127.0.0.1, at a free port, serving `routes`.

    Subclasses pass their handlers' routes; after :meth:`start`, ``port`` and
    ``url`` (``http://127.0.0.1:<port>``) say where it listens.
    """

    def __init__(self, *routes: web.RouteDef) -> None:
        app = web.Application()
        app.add_routes(routes)
        self._runner = web.AppRunner(app)

    async def start(self, ssl_context: ssl.SSLContext | None = None) -> ServiceAddress:
        """Listen (HTTPS with `ssl_context`); returns the address, as the router's
        catalog would list it."""
        await self._runner.setup()
        self.port = free_port()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=ssl_context).start()
        scheme = "https" if ssl_context is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        return ServiceAddress("127.0.0.1", self.port)

    async def stop(self) -> None:
        await self._runner.cleanup()


def router_app(
    settings: RouterSettings, models: tuple[str, ...] = ("m",), replicas: int = 1
) -> FastAPI:
    """:func:`router.app.create_app` for `settings`, its table filled as after the
    watch's first read: `models` defined (each with `replicas`), no services, no
    states. Nothing is opened: see :func:`in_process_router`."""
    app = create_app(settings)
    app.state.table.set_models(
        {n: ModelRecord(name=n, definition_hash="h", replicas=replicas) for n in models}
    )
    app.state.table.set_services(())
    app.state.table.set_states({})
    return app


@contextlib.asynccontextmanager
async def in_process_router(
    settings: RouterSettings, models: tuple[str, ...] = ("m",), replicas: int = 1
) -> AsyncIterator[FastAPI]:
    """:func:`router_app` with the clients its lifespan would open: the planner
    client (when ``settings.activation`` is on) and the upstream session. They
    are closed on the way out in the lifespan's order (usage reports, activate
    calls, planner client, ``/props`` reads, upstream pools, body parser). The usage loop is
    not started: a test starts it when it wants reports."""
    app = router_app(settings, models, replicas)
    state = app.state
    if state.activator is not None:
        await state.activator.api.start()
    state.proxy.session = upstream_session(settings)
    state.proxy.control = control_session(settings)
    try:
        yield app
    finally:
        if state.usage is not None:
            await state.usage.stop()
        if state.activator is not None:
            await state.activator.close()
            await state.activator.api.close()
        if state.capacity is not None:
            await state.capacity.close()
        await state.proxy.first_byte.close()
        await state.proxy.outliers.close()
        await state.proxy.session.close()
        await state.proxy.control.close()
        await state.proxy.bodies.close()


class RouterUnderTest:
    """An in-process router app and the server that plays its model's replica."""

    def __init__(self, app: FastAPI, replica: LocalServer) -> None:
        self.app = app
        self.replica = replica
        self.table: EndpointTable = app.state.table

    def pass_endpoint(self, model: str = "m") -> None:
        """What the Consul watch does when the replica passes its check."""
        self.table.set_endpoints(model, [ServiceAddress("127.0.0.1", self.replica.port)])

    def metric(self, name: str, **labels: str) -> float | None:
        """The sample `name` with `labels` from the router's registry, None if absent."""
        return self.app.state.metrics.registry.get_sample_value(name, labels)


async def asgi_post(
    app: Any,
    body: dict,
    leave_after_s: float | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    leave: asyncio.Event | None = None,
    query: bytes = b"",
) -> tuple[int | None, dict[str, str], dict]:
    """POST `body` as JSON to ``/v1/completions`` over ASGI, as one client connection.

    Returns (status, headers, JSON body); (None, {}, {}) when the app sent
    nothing. The arguments are :func:`asgi_messages`'.
    """
    sent = await asgi_messages(app, body, leave_after_s, headers, leave, query)
    if not sent:
        return None, {}, {}
    answer = {k.decode(): v.decode() for k, v in sent[0]["headers"]}
    return sent[0]["status"], answer, json.loads(b"".join(m.get("body", b"") for m in sent[1:]))


async def asgi_messages(
    app: Any,
    body: dict,
    leave_after_s: float | None = None,
    headers: list[tuple[bytes, bytes]] | None = None,
    leave: asyncio.Event | None = None,
    query: bytes = b"",
) -> list[dict]:
    """POST `body` as JSON to ``/v1/completions`` over ASGI, as one client connection;
    the ASGI messages the app sent, once it returned (a stream's events as sent).

    ``headers`` are sent besides the JSON content type, ``query`` as the query
    string. The client stays connected
    until the app answers, or leaves (``http.disconnect``) `leave_after_s` s after
    sending the body, or once `leave` is set (when the test chooses, whatever the
    machine's load).
    """
    sent: list[dict] = []
    payload = json.dumps(body).encode()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": payload, "more_body": False}
        if leave is not None:
            await leave.wait()
            return {"type": "http.disconnect"}
        if leave_after_s is None:
            await asyncio.Event().wait()  # connected until cancelled
        await asyncio.sleep(leave_after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/completions",
        "query_string": query,
        "headers": [(b"content-type", b"application/json"), *(headers or [])],
    }
    await app(scope, receive, send)
    return sent
