"""The router under replica faults (issue 21), on a real Consul dev agent and real
llama-servers: a dead replica costs one short wait with the default settings, a busy
one is never ejected nor asked twice, a replica's errors reach the client in OpenAI's
shape, a client leaving a long non-streaming completion frees its slot, and a stream
waiting for its on-demand model is told it is waiting.

Parts: ``consul agent -dev`` and two routers as subprocesses (test_router_consul.py's
classes: one with every default, one with a 2 s first-byte timeout so a short busy
step outlasts several probes), llama-server on the tiny random model and on Gemma 3
270M (the bootstrap's model, where a ~2,200-token prompt in one ``-ub 4096`` batch
step takes about 10 s on this CPU), and one FAKE: :class:`tests.support.wedged.WedgedReplica`
(accepts and never answers; a stopped real llama-server, ``SIGSTOP``, is the real
twin of it and is tested too). On-demand loading asks a scripted planner
(test_router_consul.py's :class:`PlannerStub`).
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from devcluster.bootstrap import BIN, CACHE
from tests.integration.test_router_consul import (
    LOADING,
    PLANNER_TOKEN,
    Consul,
    PlannerStub,
    Router,
    consul_binary,
    eventually,
    read_stream,
    request,
)
from tests.integration.test_router_path import LlamaServer
from tests.support.tiny_gguf import write_tiny_gguf
from tests.support.wedged import WedgedReplica

pytestmark = pytest.mark.integration

GEMMA = CACHE / "models" / "gemma-3-270m-q4_k_m.gguf"
QUICK_FIRST_BYTE_S = 2.0
# Issue 21: with the defaults, a wedged replica's one request is answered within 15 s.
DEAD_BUDGET_S = 15.0
# The busy replica's prompt step takes about 10 s on an idle core and several times that
# on a loaded machine (a 30 s socket timeout fired at load average 7): the client's bound
# is for a hang only, far above any honest step.
BUSY_BOUND_S = 300.0


class Parts:
    def __init__(
        self, consul: Consul, router: Router, quick: Router, tiny: LlamaServer, workdir: Path
    ) -> None:
        self.consul = consul
        self.router = router  # every default
        self.quick = quick  # --first-byte-timeout 2
        self.tiny = tiny
        self.workdir = workdir

    def serve(self, model: str, **replicas: int) -> None:
        """Define ``model`` with the given replicas (instance name -> port), passing."""
        self.consul.define(model, replicas=len(replicas))
        for instance, port in replicas.items():
            self.consul.register(model, instance, port)
        for router in (self.router, self.quick):
            eventually(
                lambda r=router: r.metric("llmgw_router_endpoints", model=model) == len(replicas),
                timeout=10,
            )


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parts]:
    binary = consul_binary()
    if binary is None or not (BIN / "llama-server").exists():
        pytest.skip("no consul or llama-server binary (run the bootstrap)")
    workdir = tmp_path_factory.mktemp("router-faults")
    consul = Consul(binary, workdir)
    tiny = router = quick = None
    try:
        tiny = LlamaServer(write_tiny_gguf(workdir / "tiny.gguf"), workdir, "--metrics")
        router = Router(consul, workdir, "router")
        quick = Router(consul, workdir, "quick", "--first-byte-timeout", str(QUICK_FIRST_BYTE_S))
        yield Parts(consul, router, quick, tiny, workdir)
    finally:
        for r in (router, quick):
            if r is not None:
                r.stop()
        if tiny is not None:
            tiny.stop()
        consul.stop()


@pytest.fixture(scope="module")
def gemma(parts: Parts) -> Iterator[LlamaServer]:
    """Gemma 3 270M, one slot, prompts processed in one batch step of up to 4096."""
    if not GEMMA.exists():
        pytest.skip("no Gemma model (run the bootstrap)")
    server = LlamaServer(
        GEMMA, parts.workdir, "--metrics", "--ctx-size", "4096", "--parallel", "1",
        "-b", "4096", "-ub", "4096", name="gemma",
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def completion(router: Router, model: str, **extra: object) -> tuple[int, float, bytes]:
    started = time.monotonic()
    body = {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0, **extra}
    status, _, data = request("POST", f"{router.url}/v1/completions", body, timeout=60)
    return status, time.monotonic() - started, data


def ejections(router: Router, model: str, reason: str) -> float:
    return router.metric("llmgw_router_replica_ejections_total", model=model, reason=reason) or 0


def counter(server: LlamaServer, name: str) -> float:
    """A llama-server /metrics counter (``llamacpp:<name>``)."""
    _, _, text = request("GET", f"{server.url}/metrics")
    match = re.search(rf"^llamacpp:{name} (\S+)$", text.decode(), re.MULTILINE)
    assert match, text
    return float(match.group(1))


def dead_replica_costs_one_short_request(parts: Parts, model: str, dead_port: int) -> float:
    """Serve ``model`` from the tiny llama-server and ``dead_port`` through the
    default router; returns the one slow request's seconds."""
    parts.serve(model, real=parts.tiny.port, dead=dead_port)
    results = [completion(parts.router, model) for _ in range(6)]
    assert [status for status, _, _ in results] == [200] * 6, results
    durations = [seconds for _, seconds, _ in results]
    # Least-outstanding takes turns, so one of the first two went to the dead
    # replica; it alone waited, and was answered by the real one in time.
    slow = [d for d in durations if d > 2.0]
    assert len(slow) == 1, durations
    assert slow[0] < DEAD_BUDGET_S, durations
    # Ejected by that one failed /health, at once.
    assert ejections(parts.router, model, "liveness_failed") == 1
    assert parts.router.metric("llmgw_router_ejected_replicas", model=model) == 1
    return slow[0]


def test_c21_a_wedged_replica_costs_one_request_within_15_s_with_the_defaults(
    parts: Parts,
) -> None:
    wedged = WedgedReplica()
    try:
        seconds = dead_replica_costs_one_short_request(parts, "wedge", wedged.port)
    finally:
        wedged.stop()
    print(f"\nwedged replica: its one request answered by the other replica in {seconds:.1f} s")
    assert "ejected for 30 s (liveness_failed" in parts.router.log_path.read_text()


def test_a_stopped_llama_server_is_dead_the_same_way(parts: Parts) -> None:
    """A real llama-server under SIGSTOP: the kernel still accepts connections, nothing
    in the process answers (the wedged replica, for real)."""
    frozen = LlamaServer(parts.workdir / "tiny.gguf", parts.workdir, name="frozen")
    os.kill(frozen.proc.pid, signal.SIGSTOP)
    try:
        seconds = dead_replica_costs_one_short_request(parts, "frozen", frozen.port)
    finally:
        os.kill(frozen.proc.pid, signal.SIGCONT)
        frozen.stop()
    print(f"\nstopped llama-server: one request, answered elsewhere in {seconds:.1f} s")


def long_prompt(words: int = 560) -> str:
    # About 2,200 Gemma tokens: one batch step of about 10 s on this CPU (one thread).
    return " ".join(f"word{i}" for i in range(words))


def slots_latency(server: LlamaServer, stop: threading.Event, seen: list[float]) -> None:
    """Time ``GET /slots`` on ``server`` while a request runs (what the old probe asked)."""
    while not stop.is_set():
        started = time.monotonic()
        try:
            request("GET", f"{server.url}/slots", timeout=60)
        except OSError:
            return
        seen.append(time.monotonic() - started)
        stop.wait(0.5)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_busy_replica_is_never_ejected_nor_asked_twice(
    parts: Parts, gemma: LlamaServer, stream: bool
) -> None:
    model = f"busy-{'stream' if stream else 'whole'}"
    parts.serve(model, gemma=gemma.port)
    prompt_tokens = counter(gemma, "prompt_tokens_total")
    decodes = counter(gemma, "n_decode_total")
    body = {
        "model": model, "prompt": long_prompt(), "max_tokens": 1, "cache_prompt": False,
        "stream": stream,
    }  # fmt: skip
    stop, seen = threading.Event(), []
    watcher = threading.Thread(target=slots_latency, args=(gemma, stop, seen), daemon=True)
    watcher.start()
    try:
        if stream:
            pieces, seconds = read_stream(parts.quick.port, "/v1/completions", body, BUSY_BOUND_S)
            first_byte_s = pieces[0][0]
            assert b"".join(p for _, p in pieces).rstrip().endswith(b"data: [DONE]")
        else:
            started = time.monotonic()
            status, _, data = request(
                "POST", f"{parts.quick.url}/v1/completions", body, BUSY_BOUND_S
            )
            seconds = first_byte_s = time.monotonic() - started
            assert status == 200, data
    finally:
        stop.set()
        watcher.join()
    # Several probe windows passed before the first byte: it was asked, answered
    # /health, and kept its request.
    assert first_byte_s > 2 * QUICK_FIRST_BYTE_S, first_byte_s
    assert not any(
        ejections(parts.quick, model, r) for r in ("liveness_failed", "stalled", "connect_error")
    )
    # Run once: the prompt counted once, in one batch step (plus the token's).
    assert counter(gemma, "n_decode_total") - decodes <= 2
    added = counter(gemma, "prompt_tokens_total") - prompt_tokens
    assert 2000 < added < 2500, added
    print(
        f"\nbusy replica ({'stream' if stream else 'non-streaming'}): first byte after "
        f"{first_byte_s:.1f} s, answered in {seconds:.1f} s, not ejected, run once; "
        f"GET /slots meanwhile answered in at most {max(seen, default=0):.3f} s"
    )


def test_a_replica_error_reaches_the_client_in_openai_shape(parts: Parts) -> None:
    """An over-long prompt: llama-server's exceed_context_size_error (numeric code,
    its own type), through the router as OpenAI's context_length_exceeded, read by
    the official client, with llama-server's n_prompt_tokens and n_ctx kept."""
    parts.serve("errors", tiny=parts.tiny.port)
    prompt = "x" * 2000  # the tiny model: one token a byte; its slots hold 512
    client = openai.OpenAI(base_url=f"{parts.router.url}/v1", api_key="unused", max_retries=0)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="errors", prompt=prompt, max_tokens=4, stream=stream)
        error = caught.value.body
        assert isinstance(error, dict), error
        assert error["type"] == "invalid_request_error"
        assert error["code"] == "context_length_exceeded"
        assert caught.value.code == "context_length_exceeded"
        assert error["param"] is None
        assert error["n_prompt_tokens"] > error["n_ctx"] > 0
    status, _, data = request(
        "POST", f"{parts.router.url}/v1/completions", {"model": "errors", "prompt": prompt}
    )
    assert status == 400
    error = json.loads(data)["error"]
    assert list(error)[:4] == ["message", "type", "param", "code"]


def slot_busy(server: LlamaServer) -> bool:
    _, _, data = request("GET", f"{server.url}/slots")
    return any(slot["is_processing"] for slot in json.loads(data))


def log_seconds(line: str) -> float:
    """llama-server's log time (``M.SS.mmm.uuu`` since it started) in seconds."""
    minutes, seconds, millis, micros = line.split(" ", 1)[0].split(".")
    return int(minutes) * 60 + int(seconds) + int(millis) / 1e3 + int(micros) / 1e6


@contextlib.contextmanager
def reading_metrics(server: LlamaServer, every_s: float = 0.1) -> Iterator[None]:
    """Reads `server`'s /metrics every `every_s` seconds, as a second router's load
    sampler does to a busy replica (router.replicaload.LoadSampler, 0.1 s)."""
    stop = threading.Event()

    def read() -> None:
        while not stop.wait(every_s):
            request("GET", f"{server.url}/metrics")

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield
    finally:
        stop.set()
        reader.join()


def test_a_client_leaving_a_long_completion_frees_the_slot(
    parts: Parts, gemma: LlamaServer
) -> None:
    """Measured from llama-server's own log (slot launched, slot released) against the
    client's clock (request sent, connection closed), while another reader (a second
    router) reads the replica's /metrics every 0.1 s and the test polls /slots: each of
    their results restarted unpatched llama-server's 1 s wait for the request's next
    result, so the closed connection was never seen and the request ran to its end (the
    bootstrap's build keeps that wait's deadline: devcluster/llama_patches.py)."""
    parts.serve("leaver", gemma=gemma.port)
    log_path = parts.workdir / "gemma-server.log"
    before = log_path.read_text(errors="replace").count("launch_slot_")
    body = json.dumps(
        {"model": "leaver", "prompt": "Tell me a story", "max_tokens": 3000, "ignore_eos": True}
    ).encode()
    client = socket.create_connection(("127.0.0.1", parts.router.port))
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    sent = time.monotonic()
    eventually(lambda: log_path.read_text(errors="replace").count("launch_slot_") > before, 20)
    time.sleep(1.5)  # generating: the answer is minutes away
    assert slot_busy(gemma)
    with reading_metrics(gemma):
        client.close()
        closed = time.monotonic()
        eventually(lambda: not slot_busy(gemma), timeout=20, interval=0.1)
    lines = log_path.read_text(errors="replace").splitlines()
    launch = [line for line in lines if "launch_slot_" in line][-1]
    release = [line for line in lines if "stop processing" in line][-1]
    after_close = log_seconds(release) - log_seconds(launch) - (closed - sent)
    print(f"\nnon-streaming client left: slot released {after_close:.2f} s after the close")
    # llama-server notices within its 1 s poll, then cancels after the current step.
    assert after_close < 2.5, after_close


def send_completion(port: int, model: str, max_tokens: int) -> socket.socket:
    """A raw client: sends one non-streaming completion and returns its socket."""
    body = json.dumps(
        {"model": model, "prompt": "Tell me a story", "max_tokens": max_tokens,
         "ignore_eos": True}
    ).encode()  # fmt: skip
    client = socket.create_connection(("127.0.0.1", port))
    client.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    return client


def test_a_queued_client_that_leaves_frees_its_place_at_once(
    parts: Parts, gemma: LlamaServer
) -> None:
    """Issue 21, item 6: one replica, one slot (Gemma, ``--parallel 1``), busy with A's
    long completion; B, C and D queue in the router, in that order. B leaves: the
    queue is 2 at once, not when B's turn comes. A leaves: C is served, then D."""
    model = "queue"
    slots_line = f"127.0.0.1:{gemma.port}: 1 slots (from /props)"
    seen = parts.router.log_path.read_text().count(slots_line)
    parts.serve(model, gemma=gemma.port)
    eventually(lambda: parts.router.log_path.read_text().count(slots_line) > seen, 10)

    def queued() -> float | None:
        return parts.router.metric("llmgw_router_queued_requests", model=model)

    a = send_completion(parts.router.port, model, 3000)
    eventually(lambda: slot_busy(gemma), 20)
    b = send_completion(parts.router.port, model, 4)
    eventually(lambda: queued() == 1)
    finished: list[str] = []
    answers: dict[str, bytes] = {}

    def client(name: str) -> None:
        status, _, data = request(
            "POST", f"{parts.router.url}/v1/completions",
            {"model": model, "prompt": "hi", "max_tokens": 4}, timeout=120,
        )  # fmt: skip
        answers[name] = data
        assert status == 200, data
        finished.append(name)

    threads = {}
    for name, depth in (("C", 2), ("D", 3)):
        threads[name] = threading.Thread(target=client, args=(name,), daemon=True)
        threads[name].start()
        eventually(lambda d=depth: queued() == d)
    b.close()
    left = time.monotonic()
    eventually(lambda: queued() == 2, timeout=5)
    gone_s = time.monotonic() - left
    assert slot_busy(gemma), "A still holds the slot: B left the queue, it was not served"
    a.close()
    for thread in threads.values():
        thread.join(120)
    assert finished == ["C", "D"], answers
    assert queued() == 0
    print(f"\nqueued client left: the queue was one shorter {gone_s:.2f} s after its close")
    # The router watches a waiting client from 0.25 s on (router.streaming); with
    # the metrics scrape, well under a second.
    assert gone_s < 1.0, gone_s


@pytest.fixture(scope="module")
def activating(parts: Parts) -> Iterator[tuple[Router, PlannerStub]]:
    """A router with on-demand activation against a scripted planner (the planner is
    not what is tested here; tests/integration/test_on_demand.py runs the real one),
    its loading heartbeat every 0.5 s."""
    planner = PlannerStub()
    router = None
    try:
        router = Router(
            parts.consul, parts.workdir, "activating",
            "--activation", "--planner-url", planner.url, "--planner-token", PLANNER_TOKEN,
            "--activation-window", "4", "--loading-heartbeat", "0.5",
        )  # fmt: skip
        yield router, planner
    finally:
        if router is not None:
            router.stop()
        planner.stop()


def test_a_stream_waiting_for_its_model_gets_comments_then_the_replica_stream(
    parts: Parts, activating: tuple[Router, PlannerStub]
) -> None:
    router, planner = activating
    planner.answers["cold-stream"] = LOADING
    parts.consul.define("cold-stream", replicas=1)
    eventually(lambda: router.metric("llmgw_router_endpoints", model="cold-stream") == 0)
    conn = http.client.HTTPConnection("127.0.0.1", router.port, timeout=10)
    body = {"model": "cold-stream", "prompt": "hi", "max_tokens": 4, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200
    assert response.getheader("Content-Type") == "text/event-stream"
    received = b""
    while received.count(b": loading model cold-stream\n\n") < 3:
        received += response.read1(65536)
    parts.consul.register("cold-stream", "tiny", parts.tiny.port)
    while chunk := response.read1(65536):
        received += chunk
    conn.close()
    events = [e for e in received.split(b"\n\n") if e.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]", received
    assert all(b'"choices"' in e for e in events[:-1]), received


def test_the_openai_client_waits_through_the_load_and_gets_the_refusal_as_an_error(
    parts: Parts, activating: tuple[Router, PlannerStub]
) -> None:
    """Its read timeout (1.5 s) is shorter than the wait (the 4 s window): the comments
    keep it reading, and the refusal at the end is raised as the SDK's APIError."""
    router, planner = activating
    planner.answers["never"] = LOADING
    parts.consul.define("never", replicas=1)
    eventually(lambda: router.metric("llmgw_router_endpoints", model="never") == 0)
    client = openai.OpenAI(
        base_url=f"{router.url}/v1", api_key="unused", max_retries=0,
        timeout=openai.Timeout(30.0, read=1.5),
    )  # fmt: skip
    stream = client.completions.create(model="never", prompt="hi", max_tokens=4, stream=True)
    with pytest.raises(openai.APIError) as caught:
        for _ in stream:
            pass
    assert not isinstance(caught.value, openai.APITimeoutError)
    assert caught.value.code == "model_loading", caught.value
