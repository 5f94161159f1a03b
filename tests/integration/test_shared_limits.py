"""Per-key limits shared by two routers (router.limits, router.sharedlimits), on a
real Consul dev agent, two real routers and a real llama-server on the tiny model:
a key limited to N requests a minute under 10 N gets about N across both routers
and 429 for the rest; a budget spent by one router's answer refuses the next request
on the other with insufficient_quota; Consul stopped while limiting fails open on
each router's own limit, counted, and shares again once Consul is back.

Nothing here is faked. The minute is the UTC minute: the load starts early in a
minute (waiting for the next one when less than 40 s remain), and the bound on
what passes is computed from the minutes the load actually touched.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from devcluster.bootstrap import BIN
from router.limits import REQUEST_LEASE_FRACTION
from router.sharedlimits import limits_key
from router.windows import lease_size
from tests.integration.test_router_consul import Consul, Router, consul_binary, eventually, request
from tests.integration.test_router_path import LlamaServer
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration

MODEL = "tiny"
# Keys of the keys file: name -> (secret, limits).
KEYS = {
    "rpm": ("sk-rpm-0123456789abcdef", "{requests_per_minute: 40}"),
    "budget": ("sk-budget-0123456789abcdef", "{tokens_per_day: 5}"),
    # A name with a space, a slash and a non-ASCII letter: its KV key is escaped.
    "ops tëam/down": ("sk-down-0123456789abcdef", "{requests_per_minute: 5}"),
    "tpm": ("sk-tpm-0123456789abcdef", "{tokens_per_minute: 5}"),
}


def keys_file(path: Path) -> Path:
    lines = ["keys:"]
    for name, (secret, limits) in KEYS.items():
        digest = hashlib.sha256(secret.encode()).hexdigest()
        lines += [f"  - name: {name}", f"    sha256: {digest}", f"    limits: {limits}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def post(router: Router, key: str, timeout: float = 30) -> tuple[int, dict, dict]:
    """A 4-token completion with ``key``'s secret: (status, headers, JSON body)."""
    body = json.dumps(
        {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}
    ).encode()
    req = urllib.request.Request(
        f"{router.url}/v1/completions",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEYS[key][0]}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def tally(consul: Consul, name: str, kind: str) -> dict | None:
    key = urllib.parse.quote(limits_key(name, kind), safe="/")
    status, _, data = request("GET", f"{consul.url}/v1/kv/{key}")
    if status == 404:
        return None
    return json.loads(base64.b64decode(json.loads(data)[0]["Value"]))


def serve(consul: Consul, llama: LlamaServer, *routers: Router) -> None:
    consul.define(MODEL)
    consul.register(MODEL, "a", llama.port)
    for router in routers:
        eventually(lambda r=router: r.metric("llmgw_router_endpoints", model=MODEL) == 1, 15)


class Parts:
    def __init__(self, consul: Consul, llama: LlamaServer, a: Router, b: Router) -> None:
        self.consul, self.llama, self.a, self.b = consul, llama, a, b


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parts]:
    binary = consul_binary()
    if binary is None or not (BIN / "llama-server").exists():
        pytest.skip("no consul or llama-server binary (run the bootstrap)")
    workdir = tmp_path_factory.mktemp("shared-limits")
    keys = keys_file(workdir / "keys.yaml")
    consul = Consul(binary, workdir)
    llama = a = b = None
    try:
        llama = LlamaServer(write_tiny_gguf(workdir / "tiny.gguf"), workdir)
        a = Router(consul, workdir, "router-a", "--api-keys-file", str(keys))
        b = Router(consul, workdir, "router-b", "--api-keys-file", str(keys))
        serve(consul, llama, a, b)
        yield Parts(consul, llama, a, b)
    finally:
        for router in (a, b):
            if router is not None:
                router.stop()
        if llama is not None:
            llama.stop()
        consul.stop()


def minute() -> int:
    return int(time.time() // 60)


def test_a_key_limited_to_n_a_minute_gets_n_across_two_routers_under_10n(parts: Parts) -> None:
    n = 40
    lease = lease_size(n, REQUEST_LEASE_FRACTION)
    if 60 - time.time() % 60 < 40:
        eventually(lambda: time.time() % 60 < 20, timeout=45, interval=0.2)
    first = minute()
    routers = [parts.a, parts.b]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: post(routers[i % 2], "rpm"), range(10 * n)))
    minutes = minute() - first + 1
    statuses = [status for status, _, _ in results]
    ok, limited = statuses.count(200), statuses.count(429)
    assert ok + limited == 10 * n, statuses
    # Never more than N a minute; at most one lease per router less (the slack).
    assert n - 2 * (lease - 1) <= ok <= n * minutes, (ok, minutes)
    refused = next(r for r in results if r[0] == 429)
    assert refused[2]["error"]["code"] == "rate_limit_exceeded"
    assert refused[1]["x-ratelimit-limit-requests"] == str(n)
    assert 1 <= int(refused[1]["retry-after"]) <= 60
    for router in routers:
        assert router.metric("llmgw_router_limits_shared") == 1
        assert router.metric("llmgw_router_limits_fail_open_total") == 0
    writes = sum(
        r.metric("llmgw_router_limits_consul_calls_total", outcome="written") or 0 for r in routers
    )
    # One write per lease, and each router's one ask that found the minute spent
    # may write nothing; a minute boundary adds a few.
    assert writes <= minutes * (n // lease + 2), writes
    assert tally(parts.consul, "rpm", "requests")["used"] <= n
    # One document per key and kind, whatever the minutes: old windows never accumulate.
    status, _, listed = request("GET", f"{parts.consul.url}/v1/kv/llmgw-router/limits/rpm/?keys")
    assert status == 200 and json.loads(listed) == ["llmgw-router/limits/rpm/requests"]


def test_a_budget_spent_on_one_router_refuses_the_next_request_on_the_other(
    parts: Parts,
) -> None:
    status, _, answer = post(parts.a, "budget")
    assert status == 200
    used = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    assert used > 5  # the budget of 5 tokens is spent by this one answer
    # Router a writes what the answer used right after it (off the request path).
    eventually(lambda: (tally(parts.consul, "budget", "tokens-day") or {}).get("used", 0) >= 5)
    assert tally(parts.consul, "budget", "tokens-day")["used"] == used
    for router in (parts.b, parts.a):
        status, headers, body = post(router, "budget")
        assert status == 429, body
        assert body["error"]["type"] == "insufficient_quota"
        assert body["error"]["code"] == "insufficient_quota"
        assert headers["x-should-retry"] == "false"
        assert int(headers["retry-after"]) >= 1
    assert parts.b.metric("llmgw_router_refusals_total", model="", reason="over_budget") == 1


def test_tokens_per_minute_spent_on_one_router_refuse_the_other_until_the_minute_ends(
    parts: Parts,
) -> None:
    if 60 - time.time() % 60 < 40:
        eventually(lambda: time.time() % 60 < 20, timeout=45, interval=0.2)
    status, _, answer = post(parts.a, "tpm")
    assert status == 200
    used = answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
    assert used > 5
    # What was leased and what was owed (the estimate corrected by the usage) is
    # written right after the answer.
    eventually(lambda: (tally(parts.consul, "tpm", "tokens-minute") or {}).get("used", 0) >= 5)
    status, headers, body = post(parts.b, "tpm")
    assert status == 429, body
    assert body["error"]["code"] == "rate_limit_exceeded"
    assert headers["x-ratelimit-limit-tokens"] == "5"
    assert headers["x-ratelimit-remaining-tokens"] == "0"
    assert 1 <= int(headers["retry-after"]) <= 60


def test_consul_down_while_limiting_fails_open_on_each_routers_own_limit(
    tmp_path: Path,
) -> None:
    binary = consul_binary()
    if binary is None or not (BIN / "llama-server").exists():
        pytest.skip("no consul or llama-server binary (run the bootstrap)")
    keys = keys_file(tmp_path / "keys.yaml")
    consul = Consul(binary, tmp_path)
    llama = router = None
    try:
        llama = LlamaServer(write_tiny_gguf(tmp_path / "tiny.gguf"), tmp_path)
        router = Router(consul, tmp_path, "router", "--api-keys-file", str(keys))
        serve(consul, llama, router)
        assert post(router, "ops tëam/down")[0] == 200  # shared: one lease taken in Consul
        consul.stop()
        # Consul gone: the router keeps its replicas and admits on its own bucket
        # (5 at once) what the lease it held does not cover, then 429.
        statuses = [post(router, "ops tëam/down")[0] for _ in range(10)]
        assert statuses.count(200) == 5 and statuses.count(429) == 5, statuses
        assert router.metric("llmgw_router_limits_shared") == 0
        assert router.metric("llmgw_router_limits_fail_open_total") == 5
        assert "failing open" in router.log_path.read_text()
        # Consul back (a dev agent, so empty): the model is registered again, and the
        # next ask after the fail-open period takes a lease in Consul again.
        consul = Consul(binary, tmp_path, port=consul.port)
        serve(consul, llama, router)
        eventually(lambda: post(router, "ops tëam/down")[0] == 200, timeout=30, interval=0.5)
        assert router.metric("llmgw_router_limits_shared") == 1
        assert tally(consul, "ops tëam/down", "requests") is not None
        assert "limits are shared again" in router.log_path.read_text()
    finally:
        if router is not None:
            router.stop()
        if llama is not None:
            llama.stop()
        consul.stop()
