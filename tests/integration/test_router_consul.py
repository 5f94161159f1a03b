"""The router against a real Consul dev agent and stub llama-server upstreams.

Self-contained: a module fixture starts ``consul agent -dev`` on free ports
(binary from ``$LLMGW_CONSUL_BIN``, ``consul`` on PATH,
~/.cache/llmgw/bin/consul or /tmp/aptb/x/usr/bin/consul) and the router as a subprocess
(``python -m router serve``); stub upstreams are aiohttp servers on a
background thread that record what they saw, including client disconnects.
Everything is stopped at module teardown.

The routers run with activation off, except in the on-demand tests at the
end: there a scripted planner stub (:class:`PlannerStub`, the activator API
only) answers activate calls, and what the router waits for (a passing
replica, a parked record) comes from the real Consul. The real planner's side
is tested in test_on_demand.py.
"""

from __future__ import annotations

import asyncio
import base64
import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from email.message import Message
from pathlib import Path

import pytest
from aiohttp import web

from llmgw_contract import StateDocument, encode, routing_of
from tests.support.ports import free_port

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def consul_binary() -> str | None:
    for candidate in (
        os.environ.get("LLMGW_CONSUL_BIN"),
        shutil.which("consul"),
        str(Path.home() / ".cache/llmgw/bin/consul"),  # where devcluster bootstrap puts it
        "/tmp/aptb/x/usr/bin/consul",
    ):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def request(
    method: str, url: str, body: object | None = None, timeout: float = 10
) -> tuple[int, Message, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def eventually(check, timeout: float = 5.0, interval: float = 0.02) -> float:
    """Poll ``check`` until truthy; return the seconds it took."""
    started = time.monotonic()
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(interval)


# --- Consul ------------------------------------------------------------------


class Consul:
    def __init__(self, binary: str, workdir: Path, port: int | None = None) -> None:
        # ``port``: a Consul that lost its state, started again where one served.
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / "consul.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                binary,
                "agent",
                "-dev",
                "-bind",
                "127.0.0.1",
                "-client",
                "127.0.0.1",
                "-http-port",
                str(self.port),
                "-dns-port",
                "-1",
                "-grpc-port",
                "-1",
                "-serf-lan-port",
                str(free_port()),
                "-serf-wan-port",
                str(free_port()),
                "-server-port",
                str(free_port()),
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        eventually(self._has_leader, timeout=30, interval=0.1)

    def _has_leader(self) -> bool:
        try:
            return request("GET", f"{self.url}/v1/status/leader")[2] not in (b"", b'""')
        except OSError:
            return False

    def define(self, name: str, replicas: int = 1, **extra: object) -> None:
        doc = {
            "name": name,
            "definition_hash": f"h-{name}",
            "replicas": replicas,
            "source": "stub",
            "profile": {},
            **extra,
        }
        assert request("PUT", f"{self.url}/v1/kv/llmgw/models/{name}", doc)[0] == 200

    def undefine(self, name: str) -> None:
        assert request("DELETE", f"{self.url}/v1/kv/llmgw/models/{name}")[0] == 200

    def set_state(self, name: str, doc: dict) -> None:
        """Write the planner's per-model state (``llmgw/state/<name>``) and, in the same
        transaction, its routing document (``llmgw/routing/<name>``) as the planner
        does (`llmgw_contract.routing_of`)."""
        routing = routing_of(StateDocument.model_validate(doc))
        values = {f"llmgw/state/{name}": json.dumps(doc), f"llmgw/routing/{name}": encode(routing)}
        ops = [
            {"KV": {"Verb": "set", "Key": key, "Value": base64.b64encode(text.encode()).decode()}}
            for key, text in values.items()
        ]
        assert request("PUT", f"{self.url}/v1/txn", ops)[0] == 200

    def clear_state(self, name: str) -> None:
        ops = [
            {"KV": {"Verb": "delete", "Key": f"llmgw/{kind}/{name}"}}
            for kind in ("state", "routing")
        ]
        assert request("PUT", f"{self.url}/v1/txn", ops)[0] == 200

    def register(self, model: str, instance: str, port: int, passing: bool = True) -> str:
        service_id = f"llmgw-{model}-{instance}"
        service = {
            "ID": service_id,
            "Name": f"llmgw-{model}",
            "Address": "127.0.0.1",
            "Port": port,
            "Meta": {"llmgw_model": model, "llmgw_definition_hash": f"h-{model}"},
            "Check": {
                "CheckID": f"{service_id}-ttl",
                "TTL": "1h",
                "Status": "passing" if passing else "critical",
            },
        }
        assert request("PUT", f"{self.url}/v1/agent/service/register", service)[0] == 200
        return service_id

    def set_check(self, service_id: str, passing: bool) -> None:
        verb = "pass" if passing else "fail"
        assert request("PUT", f"{self.url}/v1/agent/check/{verb}/{service_id}-ttl")[0] == 200

    def deregister(self, service_id: str) -> None:
        assert request("PUT", f"{self.url}/v1/agent/service/deregister/{service_id}")[0] == 200

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# --- stub upstreams ----------------------------------------------------------


def sse_chunks(count: int) -> list[bytes]:
    """Deterministic llama-server-like SSE events, ending with [DONE]."""
    events = [
        b"data: "
        + json.dumps(
            {
                "id": "chatcmpl-stub",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "stub",
                "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
            }
        ).encode()
        + b"\n\n"
        for i in range(count)
    ]
    return [*events, b"data: [DONE]\n\n"]


class ThreadedServer:
    """An aiohttp server on its own event loop in a thread, so synchronous tests can
    run it beside the router; subclasses add their routes in ``routes``."""

    def __init__(self) -> None:
        self.port = free_port()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    def routes(self, app: web.Application) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        self.routes(app)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class Stub(ThreadedServer):
    """An OpenAI-ish upstream on a background event loop."""

    def __init__(self, name: str, chunk_delay_s: float = 0.15) -> None:
        self.name = name
        self.chunk_delay_s = chunk_delay_s
        self.requests: list[dict] = []
        self.disconnects = 0
        self.disconnected = threading.Event()
        self.completed_streams = 0
        super().__init__()

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/{kind:.*}", self._handle)
        app.router.add_get("/health", self._health)

    async def _health(self, req: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _handle(self, req: web.Request) -> web.StreamResponse:
        body = await req.json()
        self.requests.append({"path": req.path, "body": body, "headers": dict(req.headers)})
        if not body.get("stream"):
            # A slow non-streaming generation that notices its client leaving,
            # as llama-server does.
            deadline = time.monotonic() + float(body.get("delay_s", 0))
            while time.monotonic() < deadline:
                if req.transport is None or req.transport.is_closing():
                    self.disconnects += 1
                    self.disconnected.set()
                    return web.Response(status=499)
                await asyncio.sleep(0.02)
            return web.json_response(
                {
                    "id": f"cmpl-{self.name}",
                    "object": "text_completion",
                    "created": 0,
                    "model": body.get("model"),
                    "system_fingerprint": self.name,
                    "choices": [
                        {
                            "index": 0,
                            "text": f"hi from {self.name}",
                            "message": {"role": "assistant", "content": f"hi from {self.name}"},
                            "finish_reason": "stop",
                            "logprobs": None,
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(req)
        try:
            for chunk in sse_chunks(int(body.get("max_tokens", 5))):
                await resp.write(chunk)
                await asyncio.sleep(self.chunk_delay_s)
            await resp.write_eof()
            self.completed_streams += 1
        except (ConnectionError, asyncio.CancelledError):
            self.disconnects += 1
            self.disconnected.set()
            raise
        return resp


# --- router ------------------------------------------------------------------


class Router:
    def __init__(self, consul: Consul, workdir: Path, name: str = "router", *flags: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = workdir / f"{name}.log"
        self.log = open(self.log_path, "wb")  # noqa: SIM115
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "CONSUL_HTTP_ADDR": f"127.0.0.1:{consul.port}",
            # Off unless a test turns it on with --activation and its own
            # planner: the default planner URL may be a demo's planner.
            "LLMGW_ACTIVATION": "0",
        }
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "router",
                "serve",
                "--port",
                str(self.port),
                "--drain-timeout",
                "10",
                "--log-level",
                "info",
                *flags,
            ],
            cwd=REPO,
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        eventually(self._healthy, timeout=30, interval=0.1)

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text()
        try:
            return request("GET", f"{self.url}/health")[0] == 200
        except OSError:
            return False

    def metric(self, name: str, **labels: str) -> float | None:
        text = request("GET", f"{self.url}/metrics")[2].decode()
        for line in text.splitlines():
            series, _, value = line.rpartition(" ")
            family, _, label_text = series.partition("{")
            if family != name:
                continue
            found = dict(pair.split("=", 1) for pair in label_text.rstrip("}").split(",") if pair)
            if found == {k: f'"{v}"' for k, v in labels.items()}:
                return float(value)
        return None

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Consul, Router, Stub, Stub]]:
    binary = consul_binary()
    if binary is None:
        pytest.skip("no consul binary (set LLMGW_CONSUL_BIN)")
    workdir = tmp_path_factory.mktemp("router-consul")
    consul = Consul(binary, workdir)
    stubs: list[Stub] = []
    router = None
    try:
        stubs = [Stub("a"), Stub("b")]
        router = Router(consul, workdir)
        yield consul, router, stubs[0], stubs[1]
    finally:
        if router is not None:
            router.stop()
        for stub in stubs:
            stub.stop()
        consul.stop()


def endpoints_of(router: Router, model: str) -> float | None:
    return router.metric("llmgw_router_endpoints", model=model)


def define_serving(consul: Consul, router: Router, model: str, *stubs: Stub) -> list[str]:
    consul.define(model, replicas=len(stubs) or 1)
    ids = [consul.register(model, stub.name, stub.port) for stub in stubs]
    eventually(lambda: endpoints_of(router, model) == len(stubs))
    return ids


def assert_openai_error(body: bytes, code: str) -> dict:
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["message"]
    return error


def test_models_lists_kv_definitions(cluster) -> None:
    consul, router, _, _ = cluster
    consul.define("listed")
    eventually(lambda: endpoints_of(router, "listed") == 0)
    status, _, body = request("GET", f"{router.url}/v1/models")
    assert status == 200
    doc = json.loads(body)
    assert doc["object"] == "list"
    assert {"id": "listed", "object": "model", "created": 0, "owned_by": "llmgw"} in doc["data"]


def test_proxies_completion_to_passing_endpoint(cluster) -> None:
    consul, router, stub_a, _ = cluster
    define_serving(consul, router, "alpha", stub_a)
    body = {"model": "alpha", "prompt": "hi", "max_tokens": 1}
    status, headers, data = request("POST", f"{router.url}/v1/completions", body)
    assert status == 200, data
    assert json.loads(data)["system_fingerprint"] == "a"
    direct = request("POST", f"http://127.0.0.1:{stub_a.port}/v1/completions", body)[2]
    assert data == direct
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    seen = stub_a.requests[-1]
    assert seen["path"] == "/v1/completions" and seen["body"] == body
    assert "gzip" not in seen["headers"].get("Accept-Encoding", "")
    for path in ("/v1/chat/completions", "/v1/embeddings"):
        assert request("POST", router.url + path, {"model": "alpha", "input": "x"})[0] == 200
        assert stub_a.requests[-1]["path"] == path


def test_unknown_model_is_404_model_not_found(cluster) -> None:
    _, router, _, _ = cluster
    status, _, body = request("POST", f"{router.url}/v1/completions", {"model": "nope"})
    assert status == 404
    error = assert_openai_error(body, "model_not_found")
    assert error["type"] == "invalid_request_error" and error["param"] == "model"
    assert "nope" in error["message"]


def test_404_for_a_reserved_name_says_why_while_its_service_exists(cluster) -> None:
    # Issue 20, item 7: for a model named `planner` the 404 said "no Consul service
    # llmgw-planner" while the planner's own service of that name was registered.
    consul, router, stub_a, _ = cluster
    service_id = consul.register("planner", "p", stub_a.port)  # the service llmgw-planner
    try:
        for method, path, body in (
            ("POST", "/v1/completions", {"model": "planner"}),
            ("GET", "/v1/models/planner", None),
        ):
            status, _, answer = request(method, f"{router.url}{path}", body)
            assert status == 404
            message = assert_openai_error(answer, "model_not_found")["message"]
            assert "no Consul service" not in message
            assert "the name is reserved (llmgw keeps the names of its own jobs and " in message
            assert "llmgw-planner is the planner's service" in message
        status, _, answer = request("GET", f"{router.url}/v1/models")
        assert "planner" not in [m["id"] for m in json.loads(answer)["data"]]
    finally:
        consul.deregister(service_id)


def test_defined_model_without_passing_endpoint_is_503(cluster) -> None:
    consul, router, _, _ = cluster
    consul.define("idle", replicas=2)
    eventually(lambda: endpoints_of(router, "idle") == 0)
    status, headers, body = request("POST", f"{router.url}/v1/chat/completions", {"model": "idle"})
    assert status == 503
    error = assert_openai_error(body, "model_not_ready")
    assert "2 replica(s) desired" in error["message"] and "llmgw-idle" in error["message"]
    assert headers["Retry-After"] == "5"


def test_bad_requests_get_openai_errors(cluster) -> None:
    _, router, _, _ = cluster
    req = urllib.request.Request(f"{router.url}/v1/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=5)
    assert err.value.code == 400
    assert_openai_error(err.value.read(), "invalid_json")
    status, _, body = request("POST", f"{router.url}/v1/completions", {"prompt": "no model"})
    assert status == 400 and json.loads(body)["error"]["param"] == "model"
    status, _, body = request("GET", f"{router.url}/v1/completions")
    assert status == 405
    assert_openai_error(body, "method_not_allowed")
    status, _, body = request("GET", f"{router.url}/v1/nothing-here")
    assert status == 404
    assert_openai_error(body, "not_found")


def test_critical_or_deregistered_endpoint_leaves_table_quickly(cluster) -> None:
    consul, router, stub_a, _ = cluster
    (service_id,) = define_serving(consul, router, "gamma", stub_a)
    consul.set_check(service_id, passing=False)
    took = eventually(lambda: endpoints_of(router, "gamma") == 0, timeout=5)
    assert took < 2.0
    status, _, body = request("POST", f"{router.url}/v1/completions", {"model": "gamma"})
    assert status == 503
    assert_openai_error(body, "model_not_ready")

    consul.set_check(service_id, passing=True)
    eventually(lambda: endpoints_of(router, "gamma") == 1)
    consul.deregister(service_id)
    took = eventually(lambda: endpoints_of(router, "gamma") == 0, timeout=5)
    assert took < 2.0


def test_model_removed_from_kv_and_catalog_is_forgotten(cluster) -> None:
    consul, router, stub_a, _ = cluster
    (service_id,) = define_serving(consul, router, "delta", stub_a)
    consul.undefine("delta")
    # Its replica still passes: the model is still served (see C16 below).
    assert request("POST", f"{router.url}/v1/completions", {"model": "delta"})[0] == 200
    consul.deregister(service_id)
    eventually(lambda: endpoints_of(router, "delta") is None, timeout=3)
    status, _, body = request("POST", f"{router.url}/v1/completions", {"model": "delta"})
    assert status == 404
    assert_openai_error(body, "model_not_found")


def test_c16_kv_wiped_while_a_model_serves_it_keeps_serving(cluster) -> None:
    """C16: `consul kv delete -recurse llmgw/` while a model serves: never 404."""
    consul, router, stub_a, _ = cluster
    (service_id,) = define_serving(consul, router, "wiped", stub_a)
    consul.set_state("wiped-neighbour", planner_state("wiped-neighbour", parked=True))
    assert request("DELETE", f"{consul.url}/v1/kv/llmgw/?recurse=true")[0] == 200
    assert request("GET", f"{consul.url}/v1/kv/llmgw/?recurse=true")[0] == 404
    served = len(stub_a.requests)
    for _ in range(20):  # across the watch's update: every answer is the replica's
        status, _, body = request("POST", f"{router.url}/v1/completions", {"model": "wiped"})
        assert status == 200, body
        time.sleep(0.05)
    assert len(stub_a.requests) == served + 20
    listed = json.loads(request("GET", f"{router.url}/v1/models")[2])["data"]
    assert "wiped" in [m["id"] for m in listed]
    assert endpoints_of(router, "wiped") == 1
    assert "KV record is gone; still serving it" in router.log_path.read_text()
    # The planner restores the record; then the replica goes: still defined, not ready.
    consul.define("wiped")
    consul.deregister(service_id)
    eventually(lambda: endpoints_of(router, "wiped") == 0, timeout=3)
    assert refusal_code(router, "wiped") == "model_not_ready"
    consul.undefine("wiped")


def test_a_model_known_only_from_its_service_is_served(cluster) -> None:
    consul, router, stub_a, _ = cluster
    service_id = consul.register("hand-made", "a", stub_a.port)  # never applied: no KV record
    try:
        eventually(lambda: endpoints_of(router, "hand-made") == 1, timeout=3)
        status, _, body = request("POST", f"{router.url}/v1/completions", {"model": "hand-made"})
        assert status == 200 and json.loads(body)["system_fingerprint"] == "a"
    finally:
        consul.deregister(service_id)
    eventually(lambda: endpoints_of(router, "hand-made") is None, timeout=3)
    status, _, body = request("POST", f"{router.url}/v1/completions", {"model": "hand-made"})
    assert status == 404
    assert (
        "no Consul service llmgw-hand-made"
        in assert_openai_error(body, "model_not_found")["message"]
    )


def test_requests_spread_over_replicas_and_skip_dead_ones(cluster) -> None:
    consul, router, stub_a, stub_b = cluster
    define_serving(consul, router, "spread", stub_a, stub_b)
    served = {
        json.loads(request("POST", f"{router.url}/v1/completions", {"model": "spread"})[2])[
            "system_fingerprint"
        ]
        for _ in range(10)
    }
    assert served == {"a", "b"}
    # A replica that passes in Consul but refuses connections: retried elsewhere.
    consul.register("spread", "dead", free_port())
    eventually(lambda: endpoints_of(router, "spread") == 3)
    for _ in range(12):
        status, _, _ = request("POST", f"{router.url}/v1/completions", {"model": "spread"})
        assert status == 200


def test_prefix_routing_keeps_a_conversation_on_one_replica(cluster, tmp_path: Path) -> None:
    """--routing prefix (issue 10): every turn of a chat goes to the replica its
    first user message hashes to; different chats spread over both."""
    consul, _, stub_a, stub_b = cluster
    router = Router(consul, tmp_path, "prefix", "--routing", "prefix")
    try:
        define_serving(consul, router, "cached", stub_a, stub_b)

        def served(chat: int, turns: int) -> set[str]:
            messages = [
                {"role": "system", "content": "shared"},
                {"role": "user", "content": f"chat {chat}: tell me a story"},
            ]
            replicas = set()
            for turn in range(turns):
                status, _, body = request(
                    "POST",
                    f"{router.url}/v1/chat/completions",
                    {"model": "cached", "messages": messages},
                )
                assert status == 200
                replicas.add(json.loads(body)["system_fingerprint"])
                messages += [
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": f"turn {turn}"},
                ]
            return replicas

        # 16 chats: all on one replica by chance is 2 in 65,536 (ports change per run).
        homes = [served(chat, 3) for chat in range(16)]
        assert all(len(home) == 1 for home in homes)  # sequential turns: never spilled
        assert set().union(*homes) == {"a", "b"}
    finally:
        router.stop()


def read_stream(
    port: int, path: str, body: dict, timeout: float = 30
) -> tuple[list[tuple[float, bytes]], float]:
    """POST and read the chunked body piece by piece: ([(seconds, bytes)], total seconds).
    `timeout`: the socket's, a bound for a hang (not a measure) on each read."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    started = time.monotonic()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.getheader("Content-Type", "").startswith("text/event-stream")
    pieces = []
    while chunk := resp.read1(65536):
        pieces.append((time.monotonic() - started, chunk))
    conn.close()
    return pieces, time.monotonic() - started


def test_sse_passes_through_chunk_by_chunk_with_identical_bytes(cluster) -> None:
    consul, router, stub_a, _ = cluster
    define_serving(consul, router, "streamer", stub_a)
    body = {
        "model": "streamer",
        "stream": True,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    via, total = read_stream(router.port, "/v1/chat/completions", body)
    direct, _ = read_stream(stub_a.port, "/v1/chat/completions", body)
    assert b"".join(c for _, c in via) == b"".join(c for _, c in direct)
    assert b"".join(c for _, c in via).endswith(b"data: [DONE]\n\n")
    # 9 events 0.15 s apart: the first must arrive long before the last.
    assert via[0][0] < total - 0.8
    assert len(via) >= 5


def test_client_disconnect_mid_stream_closes_upstream(cluster) -> None:
    consul, router, _, _ = cluster
    slow = Stub("slow", chunk_delay_s=0.1)
    try:
        define_serving(consul, router, "leaver", slow)
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
        body = {"model": "leaver", "stream": True, "max_tokens": 200}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.read1(65536).startswith(b"data: ")
        started = time.monotonic()
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
        assert slow.disconnected.wait(5), "upstream never saw the client leave"
        assert time.monotonic() - started < 3
        assert slow.completed_streams == 0
        eventually(lambda: router.metric("llmgw_router_inflight_requests", model="leaver") == 0)
    finally:
        slow.stop()


def test_client_leaving_a_slow_non_streaming_request_closes_upstream(cluster) -> None:
    consul, router, _, _ = cluster
    slow = Stub("slow-whole")
    try:
        define_serving(consul, router, "patience", slow)
        body = json.dumps({"model": "patience", "prompt": "x", "delay_s": 20}).encode()
        with socket.create_connection(("127.0.0.1", router.port)) as sock:
            sock.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            eventually(lambda: slow.requests, timeout=5)
            time.sleep(0.5)
        started = time.monotonic()
        assert slow.disconnected.wait(5), "upstream never saw the client leave"
        assert time.monotonic() - started < 3
        eventually(lambda: router.metric("llmgw_router_inflight_requests", model="patience") == 0)
        assert router.metric("llmgw_router_requests_total", model="patience", code="499") == 1
    finally:
        slow.stop()


def test_silent_replica_times_out_once_without_retry(cluster, tmp_path: Path) -> None:
    consul, _, _, _ = cluster
    router = Router(consul, tmp_path, "impatient", "--upstream-read-timeout", "1")
    mute, other = Stub("mute"), Stub("other")
    try:
        define_serving(consul, router, "silent", mute)
        consul.register("silent", "other", other.port)
        eventually(lambda: endpoints_of(router, "silent") == 2)
        status, _, body = request(
            "POST", f"{router.url}/v1/completions", {"model": "silent", "delay_s": 3}
        )
        assert status == 504
        assert_openai_error(body, "upstream_timeout")
        # The replica got the request and stayed silent: no second replica
        # is made to wait out the same timeout.
        time.sleep(0.3)
        assert len(mute.requests) + len(other.requests) == 1
    finally:
        router.stop()
        mute.stop()
        other.stop()


def test_official_openai_client(cluster) -> None:
    openai = pytest.importorskip("openai")
    consul, router, stub_a, _ = cluster
    define_serving(consul, router, "oai", stub_a)
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
    completion = client.completions.create(model="oai", prompt="hi", max_tokens=1)
    assert completion.choices[0].text == "hi from a"
    chat = client.chat.completions.create(model="oai", messages=[{"role": "user", "content": "hi"}])
    assert chat.choices[0].message.content == "hi from a"
    stream = client.chat.completions.create(
        model="oai", messages=[{"role": "user", "content": "hi"}], stream=True, max_tokens=4
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream)
    assert text == "tok0 tok1 tok2 tok3 "
    assert [m.id for m in client.models.list()].count("oai") == 1
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="missing", prompt="x")
    assert err.value.code == "model_not_found"


def test_router_api_keys_with_the_official_client(cluster, tmp_path: Path) -> None:
    """Issue 10: the router's own keys (a file of SHA-256 digests with allowed
    models); 401 in OpenAI's shape, and the replica never sees the key."""
    import hashlib

    openai = pytest.importorskip("openai")
    consul, _, stub_a, _ = cluster
    key = "sk-llmgw-test-0123456789"
    keys = tmp_path / "keys.yaml"
    keys.write_text(
        f"keys:\n  - name: team\n    sha256: {hashlib.sha256(key.encode()).hexdigest()}\n"
        "    models: ['keyed-*']\n"
    )
    router = Router(consul, tmp_path, "keyed", "--api-keys-file", str(keys))
    try:
        define_serving(consul, router, "keyed-a", stub_a)
        define_serving(consul, router, "unkeyed", stub_a)
        client = openai.OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0)
        before = len(stub_a.requests)
        answer = client.completions.create(model="keyed-a", prompt="hi", max_tokens=1)
        assert answer.choices[0].text == "hi from a"
        assert "Authorization" not in stub_a.requests[before]["headers"]
        assert [m.id for m in client.models.list()] == ["keyed-a"]
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="unkeyed", prompt="hi")
        wrong = openai.OpenAI(base_url=router.url + "/v1", api_key="sk-wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as denied:
            wrong.completions.create(model="keyed-a", prompt="hi")
        assert denied.value.code == "invalid_api_key"
        assert len(stub_a.requests) == before + 1
    finally:
        router.stop()


def test_metrics_series(cluster) -> None:
    consul, router, stub_a, _ = cluster
    define_serving(consul, router, "metered", stub_a)
    consul.define("metered-idle", replicas=1)
    eventually(lambda: endpoints_of(router, "metered-idle") == 0)
    request("POST", f"{router.url}/v1/completions", {"model": "metered"})
    request("POST", f"{router.url}/v1/completions", {"model": "metered-idle"})
    assert router.metric("llmgw_router_requests_total", model="metered", code="200") >= 1
    assert router.metric("llmgw_router_requests_total", model="metered-idle", code="503") == 1
    assert router.metric("llmgw_router_request_duration_seconds_count", model="metered") >= 1
    assert router.metric("llmgw_router_inflight_requests", model="metered") == 0


def test_sigterm_drains_in_flight_stream_then_exits_cleanly(cluster, tmp_path: Path) -> None:
    consul, _, stub_a, _ = cluster
    router = Router(consul, tmp_path, name="draining")
    try:
        define_serving(consul, router, "drain", stub_a)
        conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=15)
        body = {"model": "drain", "stream": True, "max_tokens": 6}
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        first = resp.read1(65536)
        router.proc.send_signal(signal.SIGTERM)
        rest = resp.read()
        assert (first + rest).endswith(b"data: [DONE]\n\n")
        assert router.proc.wait(timeout=15) == 0
    finally:
        router.stop()
    log = router.log_path.read_text()
    for step in ("stop accepting", "cancelling Consul watches", "closing upstream", "done"):
        assert f"shutdown: {step}" in log, log


# --- parked and unplaceable models (the router reads llmgw/routing/) ---------

KEV_LINE = "llama_model_load: error loading model: unknown model architecture: 'kev'"
KEV_ERROR = "\n".join(
    [
        "Terminated: Exit Code: 1",
        "0.00.002.058 I srv  llama_server: initializing ...",
        f"0.00.010.861 E {KEV_LINE}",
        "0.00.010.889 E llama_model_load_from_file_impl: failed to load model",
        "0.00.012.319 I srv    operator(): operator(): cleaning up before exit...",
        "0.00.013.184 E srv  llama_server: exiting due to model loading error",
    ]
)
MISSING_GPU = 'no node has an nvidia/gpu device: 1 of 1 nodes filtered ("missing devices")'


def planner_state(name: str, *, parked: bool = False, unplaceable: bool = False) -> dict:
    """A state document shaped as the planner writes it, ignored keys included."""
    return {
        "name": name,
        "consecutive_failures": 5 if parked else 0,
        "last_error": KEV_ERROR,
        "last_error_at": "2026-11-29T21:00:00+00:00",
        "counted": [f"alloc{i}/server/{i}" for i in range(5)],
        "healthy_allocs": [],
        "healthy_at_ns": 0,
        "parked": {
            "reason": "5 consecutive start failures",
            "last_error": KEV_ERROR,
            "since": "2026-11-29T21:00:05+00:00",
            "definition_hash": f"h-{name}",
        }
        if parked
        else None,
        "unplaceable": {
            "reason": MISSING_GPU,
            "since": "2026-11-29T21:00:00+00:00",
            "eval_id": "0b7c5ef2",
        }
        if unplaceable
        else None,
    }


def refusal_code(router: Router, model: str) -> str | None:
    status, _, body = request("POST", f"{router.url}/v1/completions", {"model": model})
    return json.loads(body)["error"]["code"] if status >= 400 else None


def test_parked_model_is_refused_at_once_with_its_error(cluster) -> None:
    consul, router, stub_a, _ = cluster
    define_serving(consul, router, "kev", stub_a)
    assert refusal_code(router, "kev") is None

    consul.set_state("kev", planner_state("kev", parked=True))
    took = eventually(lambda: refusal_code(router, "kev") == "model_parked", timeout=3)
    assert took < 1.0
    served = len(stub_a.requests)
    status, headers, body = request("POST", f"{router.url}/v1/chat/completions", {"model": "kev"})
    # Parked wins over the endpoint that still passes, and says why.
    assert status == 503 and len(stub_a.requests) == served
    assert "Retry-After" not in headers
    error = assert_openai_error(body, "model_parked")
    assert error["param"] == "model" and error["type"] == "server_error"
    assert KEV_LINE in error["message"] and "Terminated: Exit Code: 1" in error["message"]
    assert "5 consecutive start failures" in error["message"]
    assert "change its source or profile, or run `planner retry kev`" in error["message"]
    assert "(`planner apply` first if its Nomad job is gone)" in error["message"]
    assert "retry shortly" not in error["message"] and len(error["message"]) < 1024
    assert router.metric("llmgw_router_refusals_total", model="kev", reason="parked") >= 2
    assert router.metric("llmgw_router_requests_total", model="kev", code="503") >= 2

    consul.clear_state("kev")
    took = eventually(lambda: refusal_code(router, "kev") is None, timeout=3)
    assert took < 1.0


def test_parked_model_without_endpoints_is_parked_not_loading(cluster) -> None:
    consul, router, _, _ = cluster
    consul.define("kev-stopped", replicas=1)
    eventually(lambda: endpoints_of(router, "kev-stopped") == 0)
    assert refusal_code(router, "kev-stopped") == "model_not_ready"
    consul.set_state("kev-stopped", planner_state("kev-stopped", parked=True))
    eventually(lambda: refusal_code(router, "kev-stopped") == "model_parked", timeout=1)
    consul.clear_state("kev-stopped")
    eventually(lambda: refusal_code(router, "kev-stopped") == "model_not_ready", timeout=1)


def test_unplaceable_model_is_refused_with_the_placement_reason(cluster) -> None:
    consul, router, stub_a, _ = cluster
    consul.define("huge", replicas=1)
    eventually(lambda: endpoints_of(router, "huge") == 0)
    consul.set_state("huge", planner_state("huge", unplaceable=True))
    eventually(lambda: refusal_code(router, "huge") == "model_unplaceable", timeout=1)
    status, headers, body = request("POST", f"{router.url}/v1/completions", {"model": "huge"})
    assert status == 503 and "Retry-After" not in headers
    error = assert_openai_error(body, "model_unplaceable")
    assert f"fits on no node (since 2026-11-29T21:00:00+00:00): {MISSING_GPU}" in error["message"]
    assert router.metric("llmgw_router_refusals_total", model="huge", reason="unplaceable") >= 2

    # Capacity appeared and a replica passes before the planner clears the
    # record: serve it (only "no passing endpoint" is unplaceable).
    consul.register("huge", "a", stub_a.port)
    eventually(lambda: refusal_code(router, "huge") is None, timeout=3)
    consul.clear_state("huge")


def test_router_started_after_parking_refuses_from_its_first_request(cluster, tmp_path) -> None:
    consul, _, stub_a, _ = cluster
    service_id = consul.register("early", "a", stub_a.port)
    consul.define("early", replicas=1)
    consul.set_state("early", planner_state("early", parked=True))
    router = Router(consul, tmp_path, "late-router")  # returns once /health is 200
    try:
        assert refusal_code(router, "early") == "model_parked"
    finally:
        router.stop()
        consul.deregister(service_id)
        consul.clear_state("early")


def test_a_state_write_changes_that_models_entry_only(cluster) -> None:
    """Issue 21, item 4: the router's own catalog, table and watches (in this test's
    event loop) on the real Consul. A write of one model's state document is the one
    document decoded; the other models' entries keep their very objects; a deleted
    key takes its state away."""
    from router.catalog import ConsulCatalog
    from router.endpoints import EndpointTable
    from router.metrics import RouterMetrics
    from router.watch import ConsulWatcher

    consul, _, _, _ = cluster
    names = ["churn-a", "churn-b", "churn-c"]
    for name in names:
        consul.define(name)
        consul.set_state(name, planner_state(name, parked=True))

    async def until(check) -> None:
        while not check():
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        catalog = ConsulCatalog(consul.url)
        table = EndpointTable(RouterMetrics())
        # A long wait: no read returns unchanged while the test looks at the last one.
        watcher = ConsulWatcher(catalog, table, wait_s=120, backoff_max_s=1)
        watcher.start()
        try:
            await until(lambda: all((e := table.get(n)) and e.parked for n in names))
            before = {n: table.get(n) for n in names}
            parked = {n: e.parked for n, e in before.items()}
            await asyncio.to_thread(
                consul.set_state, "churn-a", planner_state("churn-a", unplaceable=True)
            )
            await until(lambda: before["churn-a"].parked is None)
            assert before["churn-a"].unplaceable is not None
            assert catalog.state_view.decoded == 1
            for name in ("churn-b", "churn-c"):
                assert table.get(name) is before[name]
                assert before[name].parked is parked[name]
            await asyncio.to_thread(consul.clear_state, "churn-b")
            await until(lambda: before["churn-b"].parked is None)
            assert catalog.state_view.decoded == 0  # a removal decodes nothing
            assert before["churn-c"].parked is parked["churn-c"]
            assert before["churn-a"].unplaceable is not None
        finally:
            await watcher.stop()
            await catalog.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 30))
    finally:
        for name in names:
            consul.clear_state(name)
            consul.undefine(name)


def test_a_state_key_back_after_a_reset_ends_the_kept_parking(tmp_path: Path) -> None:
    """Review of issue 21: after a Consul reset (a dev agent started again on the same
    port, its KV empty and its indexes back at the start) the router keeps a parked
    model's state; when the planner writes that model's state back not parked, the
    model is no longer refused as parked at once (not REMEMBER_S later), though its
    record, written back before the router read it, never left."""
    from router.catalog import ConsulCatalog
    from router.endpoints import EndpointTable
    from router.metrics import RouterMetrics
    from router.watch import ConsulWatcher

    binary = consul_binary()
    if binary is None:
        pytest.skip("no consul binary (set LLMGW_CONSUL_BIN)")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    consuls = [Consul(binary, tmp_path / "a")]
    consuls[0].define("m")
    # Raise the first agent's index well above where the second's will be (a few
    # writes of its own start), so the second one's reads go back for sure.
    for i in range(30):
        assert request("PUT", f"{consuls[0].url}/v1/kv/filler/{i}", {})[0] == 200
    consuls[0].set_state("m", planner_state("m", parked=True))

    async def until(check) -> None:
        while not check():
            await asyncio.sleep(0.02)

    async def scenario() -> None:
        catalog = ConsulCatalog(consuls[0].url)
        # The models watch reads the new Consul only once the record is back there, so
        # the record is never dropped (what the reviewer's case needs): the order of
        # the two watches' reads, held by the test, the reads themselves real.
        first_gone, records_back = asyncio.Event(), asyncio.Event()
        read_models = catalog.models

        async def models(index: int, wait_s: float):
            if first_gone.is_set():
                await records_back.wait()
            return await read_models(index, wait_s)

        catalog.models = models  # type: ignore[method-assign]
        table = EndpointTable(RouterMetrics())
        watcher = ConsulWatcher(catalog, table, wait_s=120, backoff_max_s=0.2)
        watcher.start()
        try:
            await until(lambda: (e := table.get("m")) is not None and e.parked is not None)
            parked = table.get("m").parked
            first_gone.set()
            await asyncio.to_thread(consuls[0].stop)
            consuls.append(await asyncio.to_thread(Consul, binary, tmp_path / "b", consuls[0].port))
            await asyncio.to_thread(consuls[-1].define, "m")
            # The states watch read the new Consul: no state key; the parking is kept.
            await until(lambda: catalog.state_view.present == frozenset())
            records_back.set()
            assert table.get("m").parked == parked
            await asyncio.to_thread(consuls[-1].set_state, "m", planner_state("m"))
            await until(lambda: catalog.state_view.present == {"m"})
            assert table.get("m").parked is None
        finally:
            await watcher.stop()
            await catalog.close()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        for consul in consuls:
            consul.stop()


# --- on-demand activation (a scripted planner; real Consul) ------------------

PLANNER_TOKEN = "router-test-token"
LOADING = {"status": "loading", "reason": "scaled up from 0", "last_error": None, "since": None}


class PlannerStub(ThreadedServer):
    """The planner's activator API, scripted: ``answers[model]`` is the answer to
    every activate call for it (404 for a model without one). Records calls."""

    def __init__(self) -> None:
        self.answers: dict[str, dict] = {}
        self.delay_s: dict[str, float] = {}  # per model, before answering
        self.activations: list[tuple[float, str]] = []
        self.usage: list[list[str]] = []
        self.bad_tokens = 0
        super().__init__()
        self.url = f"http://127.0.0.1:{self.port}"

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/v1/models/{name}/activate", self._activate)
        app.router.add_post("/v1/usage", self._usage)

    def _authorized(self, req: web.Request) -> bool:
        ok = req.headers.get("Authorization") == f"Bearer {PLANNER_TOKEN}"
        self.bad_tokens += not ok
        return ok

    async def _activate(self, req: web.Request) -> web.Response:
        if not self._authorized(req):
            return web.json_response({"error": {"message": "bad token"}}, status=401)
        name = req.match_info["name"]
        self.activations.append((time.monotonic(), name))
        await asyncio.sleep(self.delay_s.get(name, 0.0))
        answer = self.answers.get(name)
        if answer is None:
            return web.json_response({"error": {"message": "never applied"}}, status=404)
        return web.json_response({"name": name, **answer})

    async def _usage(self, req: web.Request) -> web.Response:
        if not self._authorized(req):
            return web.json_response({"error": {"message": "bad token"}}, status=401)
        self.usage.append((await req.json())["models"])
        return web.Response(status=204)

    def calls(self, model: str) -> int:
        return sum(1 for _, name in self.activations if name == model)


@pytest.fixture(scope="module")
def on_demand(cluster, tmp_path_factory: pytest.TempPathFactory):
    consul, _, stub_a, _ = cluster
    planner = PlannerStub()
    router = None
    try:
        router = Router(
            consul,
            tmp_path_factory.mktemp("on-demand"),
            "activating-router",
            "--activation",
            "--planner-url",
            planner.url,
            "--planner-token",
            PLANNER_TOKEN,
            "--activation-window",
            "4",
            "--usage-interval",
            "0.2",
        )
        yield consul, router, planner, stub_a
    finally:
        if router is not None:
            router.stop()
        planner.stop()


def post_later(router: Router, model: str, **body: object) -> tuple[threading.Thread, dict]:
    """POST in a background thread; the dict gets status, headers, body, seconds."""
    result: dict = {}

    def go() -> None:
        started = time.monotonic()
        status, headers, data = request(
            "POST", f"{router.url}/v1/completions", {"model": model, **body}, timeout=30
        )
        result.update(status=status, headers=headers, body=data, done=time.monotonic())
        result["seconds"] = result["done"] - started

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    return thread, result


def test_loading_model_is_served_when_its_replica_passes_in_consul(on_demand) -> None:
    consul, router, planner, stub_a = on_demand
    planner.answers["cold"] = LOADING
    planner.delay_s["cold"] = 0.5  # all four requests arrive while the call is in flight
    consul.define("cold", replicas=1)
    eventually(lambda: endpoints_of(router, "cold") == 0)
    threads = [post_later(router, "cold") for _ in range(4)]
    eventually(lambda: planner.calls("cold") >= 1)
    time.sleep(0.8)
    assert not any(result for _, result in threads)  # held, not refused
    passed_at = time.monotonic()
    consul.register("cold", "a", stub_a.port)
    for thread, result in threads:
        thread.join(10)
        assert result["status"] == 200, result
        # Woken by the watch's change, not by a poll: well under a second.
        assert result["done"] - passed_at < 0.5
    # Four concurrent requests, one activate call.
    assert planner.calls("cold") == 1
    assert router.metric("llmgw_router_activations_total", model="cold", outcome="loading") == 1
    assert router.metric("llmgw_router_activation_wait_seconds_count", model="cold") == 4
    assert planner.bad_tokens == 0


def test_window_runs_out_then_the_next_request_is_served(on_demand) -> None:
    consul, router, planner, stub_a = on_demand
    planner.answers["slow-load"] = LOADING
    consul.define("slow-load", replicas=1)
    eventually(lambda: endpoints_of(router, "slow-load") == 0)
    started = time.monotonic()
    status, headers, body = request("POST", f"{router.url}/v1/completions", {"model": "slow-load"})
    assert 4 <= time.monotonic() - started < 6
    assert status == 503 and headers["Retry-After"] == "5"
    error = assert_openai_error(body, "model_loading")
    assert "`slow-load` is loading" in error["message"]
    consul.register("slow-load", "a", stub_a.port)
    eventually(lambda: endpoints_of(router, "slow-load") == 1)
    status, _, _ = request("POST", f"{router.url}/v1/completions", {"model": "slow-load"})
    assert status == 200
    assert router.metric("llmgw_router_refusals_total", model="slow-load", reason="loading") == 1


def test_parked_in_consul_while_waiting_is_refused_at_once(on_demand) -> None:
    consul, router, planner, _ = on_demand
    planner.answers["doomed"] = LOADING
    consul.define("doomed", replicas=1)
    eventually(lambda: endpoints_of(router, "doomed") == 0)
    thread, result = post_later(router, "doomed")
    eventually(lambda: planner.calls("doomed") >= 1)
    time.sleep(0.3)
    parked_at = time.monotonic()
    consul.set_state("doomed", planner_state("doomed", parked=True))
    thread.join(5)
    assert result["status"] == 503 and result["done"] - parked_at < 1.0
    error = assert_openai_error(result["body"], "model_parked")
    assert KEV_LINE in error["message"]
    # Parked in KV: refused without asking the planner again.
    assert refusal_code(router, "doomed") == "model_parked"
    assert planner.calls("doomed") == 1
    consul.clear_state("doomed")


def test_unplaceable_answer_is_refused_at_once(on_demand) -> None:
    consul, router, planner, _ = on_demand
    since = "2026-11-29T21:00:00+00:00"
    planner.answers["too-big"] = {"status": "unplaceable", "reason": MISSING_GPU, "since": since}
    consul.define("too-big", replicas=1)
    eventually(lambda: endpoints_of(router, "too-big") == 0)
    started = time.monotonic()
    status, headers, body = request("POST", f"{router.url}/v1/completions", {"model": "too-big"})
    assert time.monotonic() - started < 1.0
    assert status == 503 and "Retry-After" not in headers
    assert MISSING_GPU in assert_openai_error(body, "model_unplaceable")["message"]


def test_stopped_answer_is_refused_at_once_without_retry(on_demand) -> None:
    consul, router, planner, _ = on_demand
    planner.answers["halted"] = {"status": "stopped", "reason": "defined with replicas: 0"}
    consul.define("halted", replicas=0)
    eventually(lambda: endpoints_of(router, "halted") == 0)
    started = time.monotonic()
    status, headers, body = request("POST", f"{router.url}/v1/completions", {"model": "halted"})
    assert time.monotonic() - started < 1.0
    assert status == 503 and "Retry-After" not in headers
    assert headers["x-should-retry"] == "false"
    error = assert_openai_error(body, "model_stopped")
    assert "defined with replicas: 0" in error["message"]
    assert router.metric("llmgw_router_refusals_total", model="halted", reason="stopped") == 1
    assert router.metric("llmgw_router_activations_total", model="halted", outcome="stopped") == 1


def test_usage_reports_reach_the_planner(on_demand) -> None:
    consul, router, planner, stub_a = on_demand
    define_serving(consul, router, "busy", stub_a)
    request("POST", f"{router.url}/v1/completions", {"model": "busy"})
    eventually(lambda: any("busy" in models for models in planner.usage), timeout=3)
    # A long stream keeps its model reported while it lasts.
    before = len(planner.usage)
    body = {"model": "busy", "stream": True, "max_tokens": 8}  # 8 x 0.15 s
    read_stream(router.port, "/v1/completions", body)
    assert sum("busy" in models for models in planner.usage[before:]) >= 3


def test_planner_down_is_planner_unavailable_fast(cluster, tmp_path: Path) -> None:
    consul, _, _, _ = cluster
    down = f"http://127.0.0.1:{free_port()}"
    router = Router(consul, tmp_path, "orphan", "--activation", "--planner-url", down)
    try:
        consul.define("orphaned", replicas=1)
        eventually(lambda: endpoints_of(router, "orphaned") == 0)
        started = time.monotonic()
        status, headers, body = request(
            "POST", f"{router.url}/v1/completions", {"model": "orphaned"}
        )
        assert time.monotonic() - started < 1.0
        assert status == 503 and headers["Retry-After"] == "5"
        assert down in assert_openai_error(body, "planner_unavailable")["message"]
    finally:
        router.stop()
