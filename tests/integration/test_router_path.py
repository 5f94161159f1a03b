"""The router's request path under real traffic, on a real Consul dev agent and a
real llama-server: a wedged replica ejected (C21), a busy model that never delays
another, every model-addressed route and CORS (C22), and 503 before the first
Consul read.

Parts: ``consul agent -dev`` and the router as subprocesses (the classes of
test_router_consul.py), one llama-server on the tiny random model
(tests/support/tiny_gguf.py), the aiohttp stub replicas of test_router_consul.py
where a test needs a replica to behave in a set way (slow, streaming), and one
FAKE: :class:`tests.support.wedged.WedgedReplica`, a TCP server that accepts and
never answers (a wedged replica cannot be produced on demand with a real one).
"""

from __future__ import annotations

import http.client
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.bootstrap import BIN
from tests.integration.test_router_consul import (
    REPO,
    Consul,
    Router,
    Stub,
    consul_binary,
    eventually,
    read_stream,
    request,
)
from tests.support.ports import free_port
from tests.support.tiny_gguf import write_tiny_gguf
from tests.support.wedged import WedgedReplica

pytestmark = pytest.mark.integration

FIRST_BYTE_TIMEOUT_S = 2.0
ORIGIN = "https://app.example.com"


class LlamaServer:
    """A real llama-server on the tiny model, 2 slots, on 127.0.0.1; ``args`` added."""

    def __init__(self, model: Path, workdir: Path, *args: str, name: str = "llama") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(workdir / f"{name}-server.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                str(BIN / "llama-server"), "-m", str(model), "--host", "127.0.0.1",
                "--port", str(self.port), "--threads", "1", "--ctx-size", "1024",
                "--parallel", "2", *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        eventually(self._ready, timeout=60, interval=0.1)

    def _ready(self) -> bool:
        assert self.proc.poll() is None, "llama-server exited"
        try:
            return request("GET", f"{self.url}/health", timeout=2)[0] == 200
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class Parts:
    def __init__(
        self, consul: Consul, router: Router, llama: LlamaServer, reranker: LlamaServer
    ) -> None:
        self.consul = consul
        self.router = router
        self.llama = llama
        self.reranker = reranker

    def serve(self, model: str, **replicas: int) -> None:
        """Define ``model`` with the given replicas (instance name -> port), passing."""
        self.consul.define(model, replicas=len(replicas))
        for instance, port in replicas.items():
            self.consul.register(model, instance, port)
        eventually(
            lambda: self.router.metric("llmgw_router_endpoints", model=model) == len(replicas),
            timeout=10,
        )


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parts]:
    binary = consul_binary()
    if binary is None or not (BIN / "llama-server").exists():
        pytest.skip("no consul or llama-server binary (run the bootstrap)")
    workdir = tmp_path_factory.mktemp("router-path")
    model = write_tiny_gguf(workdir / "tiny.gguf")
    consul = Consul(binary, workdir)
    llama = reranker = router = None
    try:
        llama = LlamaServer(model, workdir)
        # A reranker model: the model definition's `args: ["--reranking"]`.
        reranker = LlamaServer(model, workdir, "--reranking", name="reranker")
        router = Router(
            consul, workdir, "router",
            "--first-byte-timeout", str(FIRST_BYTE_TIMEOUT_S),
            "--cors-origin", ORIGIN,
            "--replica-concurrency", "2",
            "--max-connections-per-replica", "2",
            "--queue-timeout", "1",
        )  # fmt: skip
        yield Parts(consul, router, llama, reranker)
    finally:
        if router is not None:
            router.stop()
        for server in (llama, reranker):
            if server is not None:
                server.stop()
        consul.stop()


def completion(router: Router, model: str, **extra: object) -> tuple[int, float, bytes]:
    started = time.monotonic()
    body = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0, **extra}
    status, _, data = request("POST", f"{router.url}/v1/completions", body, timeout=30)
    return status, time.monotonic() - started, data


def test_c21_wedged_replica_is_ejected_and_requests_succeed(parts: Parts) -> None:
    wedged = WedgedReplica()
    try:
        parts.serve("wedge", real=parts.llama.port, wedged=wedged.port)
        results = [completion(parts.router, "wedge") for _ in range(20)]
    finally:
        wedged.stop()
    statuses = [status for status, _, _ in results]
    durations = [seconds for _, seconds, _ in results]
    assert statuses.count(200) >= 18, statuses
    # The replica was ejected at its first failed /health, so only that
    # request waited for it, for the first-byte timeout, and then got its
    # answer from the real replica.
    slow = [d for d in durations if d > FIRST_BYTE_TIMEOUT_S / 2]
    assert len(slow) <= 1, durations
    fast = sorted(durations)[len(durations) // 2]
    assert max(durations) < FIRST_BYTE_TIMEOUT_S + fast + 1.0, durations
    router = parts.router
    reason = {"model": "wedge", "reason": "liveness_failed"}
    assert router.metric("llmgw_router_replica_ejections_total", **reason) == 1
    assert router.metric("llmgw_router_ejected_replicas", model="wedge") == 1
    assert "ejected for 30 s (liveness_failed" in router.log_path.read_text()
    status, _, body = request("GET", f"{router.url}/v1/models/wedge")
    assert status == 200
    assert json.loads(body)["llmgw"]["ejected_replicas"] == 1


def test_c21_a_stream_is_retried_on_the_real_replica_too(parts: Parts) -> None:
    wedged = WedgedReplica()
    try:
        parts.serve("wedge-stream", real=parts.llama.port, wedged=wedged.port)
        body = {"model": "wedge-stream", "prompt": "hi", "max_tokens": 4, "stream": True}
        for _ in range(4):
            pieces, seconds = read_stream(parts.router.port, "/v1/completions", body)
            assert b"".join(p for _, p in pieces).rstrip().endswith(b"data: [DONE]")
            assert seconds < FIRST_BYTE_TIMEOUT_S + 1.5, seconds
        assert wedged.accepted >= 1  # it was tried, and given up on in time
    finally:
        wedged.stop()


def test_a_slow_replica_that_answers_its_probe_is_not_cut(parts: Parts) -> None:
    slow = Stub("slow-alive")
    try:
        parts.serve("patient", slow=slow.port)
        # Its answer comes after twice the first-byte timeout; it answers the
        # liveness probe (GET /health) meanwhile, so the request waits for it.
        status, seconds, data = completion(parts.router, "patient", delay_s=4)
        assert status == 200, data
        assert seconds >= 4
        assert len(slow.requests) == 1
        assert not parts.router.metric(
            "llmgw_router_replica_ejections_total", model="patient", reason="liveness_failed"
        )
    finally:
        slow.stop()


def test_a_busy_model_never_delays_another(parts: Parts) -> None:
    busy, idle = Stub("busy", chunk_delay_s=0.1), Stub("idle")
    try:
        parts.serve("model-a", a=busy.port)
        parts.serve("model-b", b=idle.port)
        body = {"model": "model-a", "stream": True, "max_tokens": 60}
        streams = [
            threading.Thread(target=read_stream, args=(parts.router.port, "/v1/completions", body))
            for _ in range(2)
        ]
        for stream in streams:
            stream.start()
        # Both of model A's slots (and its 2 pooled connections) are taken.
        eventually(lambda: len(busy.requests) == 2, timeout=5)
        status, seconds, _ = completion(parts.router, "model-b")
        assert status == 200 and seconds < 1.0, seconds
        # A third request for A waits its bounded time, then hears "busy".
        status, headers, data = request(
            "POST", f"{parts.router.url}/v1/completions", {"model": "model-a"}
        )
        assert status == 503 and json.loads(data)["error"]["code"] == "replicas_busy"
        assert headers["Retry-After"] == "2"
        assert (
            parts.router.metric(
                "llmgw_router_refusals_total", model="model-a", reason="replicas_busy"
            )
            == 1
        )
        for stream in streams:
            stream.join(30)
    finally:
        busy.stop()
        idle.stop()


def test_a_huge_body_naming_its_model_last_is_routed(parts: Parts) -> None:
    # The OpenAI SDK's order: messages first, model after them. Over 256 KiB the
    # router hands the parse to its worker process (router.bodies), under uvloop;
    # llama-server ignores the extra field.
    parts.serve("huge", real=parts.llama.port)
    padding = [{"role": "user", "content": "x" * 1000}] * 20_000
    body = {"content": "hi", "messages": padding, "model": "huge"}
    via = request("POST", f"{parts.router.url}/tokenize", body, timeout=60)
    direct = request("POST", f"{parts.llama.url}/tokenize", body, timeout=60)
    assert via[0] == 200 and via[2] == direct[2], via


LLAMA_ROUTES = (
    ("/tokenize", {"content": "hello"}),
    ("/detokenize", {"tokens": [104, 105]}),
    ("/apply-template", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/infill", {"input_prefix": "def f(", "input_suffix": ")", "n_predict": 2}),
    ("/v1/rerank", {"query": "q", "documents": ["a", "b"]}),
    ("/v1/embeddings", {"input": "x"}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 2}),
)


def test_c22_every_model_route_reaches_the_replica(parts: Parts) -> None:
    parts.serve("routes", real=parts.llama.port)
    router, llama = parts.router, parts.llama
    seen = {}
    for path, body in LLAMA_ROUTES:
        via = request("POST", router.url + path, {"model": "routes", **body})
        direct = request("POST", llama.url + path, {"model": "routes", **body})
        assert via[0] == direct[0], (path, via, direct)
        if path in ("/tokenize", "/detokenize", "/apply-template"):
            assert via[0] == 200 and via[2] == direct[2], path
        else:
            assert json.loads(via[2]).keys() == json.loads(direct[2]).keys(), path
        seen[path] = via[0]
    # Served by the replica, not answered by the router: llama-server's own 501.
    status, _, data = request("POST", router.url + "/v1/rerank", {"model": "routes", "query": "q"})
    assert status == 501 and "rerank" in data.decode().lower()
    # A reranker model's replica ranks.
    parts.serve("reranker", real=parts.reranker.port)
    body = {"model": "reranker", "query": "q", "documents": ["a", "b"]}
    for path in ("/v1/rerank", "/rerank"):
        via = request("POST", router.url + path, body)
        direct = request("POST", parts.reranker.url + path, body)
        assert via[0] == 200 and via[2] == direct[2], (path, via)
        assert len(json.loads(via[2])["results"]) == 2
    status, _, data = request("POST", router.url + "/tokenize", {"model": "nope", "content": "x"})
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"
    status, _, data = request("GET", f"{router.url}/v1/models/routes")
    assert status == 200
    model = json.loads(data)
    assert {k: model[k] for k in ("id", "object", "owned_by")} == {
        "id": "routes", "object": "model", "owned_by": "llmgw",
    }  # fmt: skip
    assert model["llmgw"]["passing_replicas"] == 1 and model["llmgw"]["desired_replicas"] == 1
    status, _, data = request("GET", f"{router.url}/v1/models/nope")
    assert status == 404 and json.loads(data)["error"]["code"] == "model_not_found"


def cors_request(
    router: Router, method: str, path: str, headers: dict[str, str], body: dict | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=30)
    payload = None if body is None else json.dumps(body)
    conn.request(method, path, payload, {"Content-Type": "application/json", **headers})
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    # Browsers refuse an answer whose Allow-Origin has two values (the replica's
    # own beside the router's): a dict of the headers would hide the second.
    allow = [v for k, v in resp.getheaders() if k.lower() == "access-control-allow-origin"]
    assert len(allow) <= 1, f"{method} {path}: Access-Control-Allow-Origin {allow}"
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data


def test_c22_cors_preflight_and_headers_on_every_answer(parts: Parts) -> None:
    parts.serve("browser", real=parts.llama.port)
    router = parts.router
    preflight = {
        "Origin": ORIGIN,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type, authorization",
    }
    status, headers, _ = cors_request(router, "OPTIONS", "/v1/chat/completions", preflight)
    assert status == 200
    assert headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert "authorization" in headers["access-control-allow-headers"].lower()
    evil = {**preflight, "Origin": "https://evil.example.com"}
    status, headers, _ = cors_request(router, "OPTIONS", "/v1/chat/completions", evil)
    assert status == 400 and "access-control-allow-origin" not in headers
    origin = {"Origin": ORIGIN}
    answers = {
        "completion": cors_request(
            router, "POST", "/v1/completions", origin,
            {"model": "browser", "prompt": "hi", "max_tokens": 2},
        ),
        "stream": cors_request(
            router, "POST", "/v1/completions", origin,
            {"model": "browser", "prompt": "hi", "max_tokens": 2, "stream": True},
        ),
        "model_not_found": cors_request(
            router, "POST", "/v1/completions", origin, {"model": "nope"}
        ),
        "bad_json": cors_request(router, "POST", "/v1/completions", origin, None),
        "route_404": cors_request(router, "GET", "/nowhere", origin),
        "models": cors_request(router, "GET", "/v1/models", origin),
    }  # fmt: skip
    assert [a[0] for a in answers.values()] == [200, 200, 404, 400, 404, 200]
    assert answers["stream"][1]["content-type"].startswith("text/event-stream")
    for name, (_, headers, _) in answers.items():
        assert headers.get("access-control-allow-origin") == ORIGIN, name
    assert "retry-after" in answers["completion"][1]["access-control-expose-headers"].lower()
    # No Origin header: no CORS headers.
    plain = cors_request(router, "POST", "/v1/completions", {}, {"model": "nope"})
    assert "access-control-allow-origin" not in plain[1]
    # A simple request (no preflight) from an origin not allowed: served, but nothing
    # lets that page's script read it (llama-server would allow every origin).
    status, headers, _ = cors_request(
        router, "POST", "/v1/completions",
        {"Origin": "https://evil.example.com", "Content-Type": "text/plain"},
        {"model": "browser", "prompt": "hi", "max_tokens": 2},
    )  # fmt: skip
    assert status == 200 and "access-control-allow-origin" not in headers
    # Dot segments never reach a replica's routes outside /v1/ (its slot actions).
    # Every other spelling, against a recording stub: test_router_security.py.
    for path in ("/v1/../slots/0?action=erase", "/v1/%2e%2e/slots/0?action=erase",
                 "/v1/..%2fslots/0?action=erase", "/v1/%252e%252e/slots/0?action=erase",
                 "/v1/%252e%252e/props", "/v1/%252e%252e/lora-adapters"):  # fmt: skip
        status, _, body = cors_request(router, "POST", path, {}, {"model": "browser"})
        # The router's own 404, not llama-server's slot handler (its 501 names
        # --slot-save-path).
        assert status == 404 and json.loads(body)["error"]["code"] == "not_found", (path, body)


def test_before_its_first_consul_read_the_router_says_503_retry_after(tmp_path: Path) -> None:
    # Consul is not listening at this address, so the first read never comes.
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "CONSUL_HTTP_ADDR": f"127.0.0.1:{free_port()}",
        "LLMGW_ACTIVATION": "0",
    }
    with (tmp_path / "router.log").open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", "--port", str(port)],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:

        def up() -> bool:
            try:
                return request("GET", f"{url}/health", timeout=2)[0] == 503
            except OSError:
                return False

        eventually(up, timeout=30, interval=0.1)
        for method, path, body in (
            ("POST", "/v1/chat/completions", {"model": "any"}),
            ("GET", "/v1/models", None),
            ("GET", "/v1/models/any", None),
        ):
            status, headers, data = request(method, url + path, body)
            assert status == 503, (path, data)
            assert json.loads(data)["error"]["code"] == "router_starting"
            assert headers["Retry-After"] == "1"
    finally:
        proc.terminate()
        proc.wait(20)
