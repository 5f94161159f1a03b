"""NOMAD_NAMESPACE: read as the `nomad` CLI reads it, said in every ACL capability, and
carried by every request the Nomad client makes (issue 20 item 1: the event stream and
/v1/evaluation(s) went without it, so Nomad answered for `default`).

Every request is checked against a recording HTTP server, not a real Nomad: a recorder
is the only way to see the query string of each call, the point of this test; what a
real Nomad does with it is tests/integration/test_namespaces.py's."""

from __future__ import annotations

import asyncio
import inspect
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import parse_qs, urlsplit

import aiohttp
import pytest

from llmgw_contract.acl import CONSUL_KV_WRITE
from planner.agents import access
from planner.agents.nomad import NomadClient
from planner.errors import InvalidSettings, NomadUnavailable, PermissionDenied
from planner.spec.settings import Settings

# Paths whose answer is a list (the rest answer one object).
_LISTS = ("/v1/jobs", "/v1/allocations", "/v1/evaluations", "/v1/deployments", "/v1/nodes")
_LIST_SUFFIXES = ("/allocations", "/evaluations", "/deployments")


class _Recorder(BaseHTTPRequestHandler):
    """Answers every call with a body of the right shape and records (method, path,
    query); `denied` paths answer 403, `missing` ones 404."""

    calls: ClassVar[list[tuple[str, str, dict[str, list[str]]]]] = []
    denied: tuple[str, ...] = ()
    missing: tuple[str, ...] = ()

    def _answer(self) -> None:
        url = urlsplit(self.path)
        type(self).calls.append((self.command, url.path, parse_qs(url.query)))
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        if url.path.startswith(self.denied):
            self._send(403, b"Permission denied")
        elif url.path.startswith(self.missing):
            self._send(404, b"namespace not found")
        elif url.path == "/v1/event/stream":
            self._send(200, json.dumps({"Index": 7, "Events": [{"Index": 7}]}).encode() + b"\n")
        elif url.path in _LISTS or url.path.endswith(_LIST_SUFFIXES):
            self._send(200, b"[]")
        else:
            self._send(200, json.dumps({"ID": "x", "Versions": [], "EvalID": "e"}).encode())

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Nomad-Index", "7")
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def recorder() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Handler", (_Recorder,), {"calls": [], "denied": (), "missing": ()})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_nomad_namespace_is_read_as_the_nomad_cli_reads_it() -> None:
    assert Settings.from_env({}).nomad_namespace == "default"
    assert Settings.from_env({"NOMAD_NAMESPACE": ""}).nomad_namespace == "default"
    assert Settings.from_env({"NOMAD_NAMESPACE": "llm-prod"}).nomad_namespace == "llm-prod"
    with pytest.raises(ValueError, match=r"NOMAD_NAMESPACE='\*': the planner manages exactly one"):
        Settings.from_env({"NOMAD_NAMESPACE": "*"})
    with pytest.raises(ValueError, match="NOMAD_NAMESPACE='llm prod' is not a Nomad namespace"):
        Settings.from_env({"NOMAD_NAMESPACE": "llm prod"})
    with pytest.raises(ValueError, match="not a Nomad namespace"):
        Settings.from_env({"NOMAD_NAMESPACE": "x" * 129})


def test_capabilities_name_the_namespace_they_are_asked_in() -> None:
    assert access.NOMAD_SUBMIT_JOB.rule == 'submit-job on namespace "default"'
    assert access.capability("read-job", "llm").rule == 'read-job on namespace "llm"'
    moved = access.in_namespace(access.NOMAD_LIST_JOBS, "llm")
    assert moved.rule == 'list-jobs on namespace "llm"'
    assert moved == access.capability("list-jobs", "llm")
    # Nodes have no namespace; Consul's rules are Consul's.
    assert access.in_namespace(access.NOMAD_NODE_READ, "llm") == access.NOMAD_NODE_READ
    assert access.in_namespace(CONSUL_KV_WRITE, "llm") == CONSUL_KV_WRITE


def _call_everything(nomad: NomadClient) -> set[str]:
    """Call every public method of `nomad` that talks to Nomad; returns their names."""
    calls = {
        "token_status": lambda: nomad.token_status(),
        "denied": lambda: nomad.denied(list(access.SERVE)),
        "require_namespace": lambda: nomad.require_namespace(),
        "parse": lambda: nomad.parse("job {}", ""),
        "job": lambda: nomad.job("x"),
        "jobs": lambda: nomad.jobs(),
        "llmgw_jobs_elsewhere": lambda: nomad.llmgw_jobs_elsewhere({"x"}),
        "register": lambda: nomad.register({"ID": "x"}, enforce_index=3),
        "plan": lambda: nomad.plan({"ID": "x"}),
        "scale": lambda: nomad.scale("x", "g", 1, "why"),
        "evaluate": lambda: nomad.evaluate("x"),
        "deregister": lambda: nomad.deregister("x"),
        "versions": lambda: nomad.versions("x"),
        "deployments": lambda: nomad.deployments("x"),
        "revert": lambda: nomad.revert("x", 1, 2),
        "allocations": lambda: nomad.allocations("x"),
        "allocation": lambda: nomad.allocation("a" * 36),
        "stopping_allocations": lambda: nomad.stopping_allocations(),
        "nodes": lambda: nomad.nodes(),
        "node": lambda: nomad.node("n" * 36),
        "evaluation": lambda: nomad.evaluation("e"),
        "evaluations": lambda: nomad.evaluations("x"),
        "current_index": lambda: nomad.current_index(),
        "latest_index": lambda: nomad.latest_index(),
        "task_stderr_tail": lambda: nomad.task_stderr_tail("a" * 36, "server"),
    }
    for call in calls.values():
        call()

    async def first_event() -> None:
        async with aiohttp.ClientSession() as session:
            with pytest.raises(NomadUnavailable, match="closed the connection"):
                async for _ in nomad.events(session, 7):
                    pass

    asyncio.run(first_event())
    return {*calls, "events"}


def test_every_request_carries_the_namespace(recorder: tuple[str, type[_Recorder]]) -> None:
    url, handler = recorder
    nomad = NomadClient(url, "00000000-0000-0000-0000-000000000000", namespace="llm")
    called = _call_everything(nomad)
    public = {
        name
        for name, member in inspect.getmembers(NomadClient, inspect.isfunction)
        if not name.startswith("_")
    }
    assert public == called, "a new NomadClient method: call it here"
    paths = {path for _, path, _ in handler.calls}
    assert {"/v1/event/stream", "/v1/evaluation/e", "/v1/evaluations", "/v1/jobs/parse"} <= paths
    # Only the look for a model's copies in other namespaces asks for all.
    namespaces = [query.get("namespace") for _, _, query in handler.calls]
    assert namespaces.count(["*"]) == 1
    assert all(n == ["llm"] for n in namespaces if n != ["*"]), handler.calls
    # The rendered job says the namespace it is registered in.
    assert nomad.parse("job {}", "")["Namespace"] == "llm"


def test_a_denied_capability_names_the_clients_namespace(
    recorder: tuple[str, type[_Recorder]],
) -> None:
    url, handler = recorder
    handler.denied = ("/v1/job/",)
    nomad = NomadClient(url, namespace="llm")
    with pytest.raises(PermissionDenied) as denied:
        nomad.register({"ID": "x"})
    assert denied.value.rules == ['submit-job on namespace "llm"']
    found = nomad.denied([access.NOMAD_READ_JOB, access.NOMAD_SUBMIT_JOB, access.NOMAD_NODE_READ])
    assert found is not None
    assert [p.rule for p in found[0]] == [
        'read-job on namespace "llm"',
        'submit-job on namespace "llm"',
    ]


def test_a_namespace_nomad_does_not_have_is_an_error_at_start(
    recorder: tuple[str, type[_Recorder]],
) -> None:
    url, handler = recorder
    handler.missing = ("/v1/namespace/",)
    with pytest.raises(InvalidSettings) as missing:
        NomadClient(url, namespace="lmm").denied([access.NOMAD_LIST_JOBS])
    assert missing.value.exit_code == 2
    assert str(missing.value) == (
        f"NOMAD_NAMESPACE=lmm: Nomad at {url} has no namespace 'lmm'; create it (nomad "
        "namespace apply lmm) or set NOMAD_NAMESPACE to the namespace the models run in "
        "(unset: default)"
    )
    # "default" always exists: not asked.
    assert NomadClient(url).denied([access.NOMAD_LIST_JOBS]) is None
    assert not [p for _, p, _ in handler.calls if p.startswith("/v1/namespace/")][1:]
