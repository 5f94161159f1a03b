"""``router keys --consul`` (router.keyscli, router.keystore) against a real Consul dev
agent, a real router reading its keys from Consul KV and a real llama-server on the
tiny model: a key added by the CLI is accepted by the running router as soon as it
logs the new document (the event, not a sleep), its answers carry x-ratelimit-*
headers, ``usage`` shows what the requests used of the shared tallies, a stopping
router gives its unused lease back, ``rotate`` retires the old secret, and a write at
a stale ModifyIndex is refused (the compare-and-set two operators rely on).

Nothing here is faked. The minute is the UTC minute: the requests start early in one
(waiting for the next when less than 40 s remain), so the lease given back is of the
minute the usage was read in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from devcluster.bootstrap import BIN
from llmgw_contract import ROUTER_API_KEYS_KEY
from router.keys import ApiKeys
from router.keystore import ConsulStore, consul_client
from router.limits import REQUEST_LEASE_FRACTION
from router.windows import lease_size
from tests.integration.test_router_consul import REPO, Consul, Router, consul_binary, eventually
from tests.integration.test_router_path import LlamaServer
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration

MODEL = "tiny"
RPM = 100  # leases of 5 requests
BUDGET = 100_000  # tokens a day: leases of 1,000


def router_keys(consul: Consul, *args: str) -> tuple[int, dict | list, str]:
    """``router keys ARGS --consul -o json``: (exit code, the JSON, stderr)."""
    done = subprocess.run(
        [sys.executable, "-m", "router", "keys", *args, "--consul", "-o", "json"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "CONSUL_HTTP_ADDR": f"127.0.0.1:{consul.port}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done.returncode, json.loads(done.stdout or "null"), done.stderr


def post(router: Router, secret: str) -> tuple[int, dict[str, str], dict]:
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 4}).encode()
    req = urllib.request.Request(
        f"{router.url}/v1/completions",
        data=body,
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {secret}"},
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers), json.loads(err.read())


def keys_read(router: Router) -> int:
    """How many times the router logged taking a keys document from Consul."""
    return router.log_path.read_text().count(f"API keys read from Consul KV {ROUTER_API_KEYS_KEY}")


class Parts:
    def __init__(self, consul: Consul, llama: LlamaServer, router: Router) -> None:
        self.consul, self.llama, self.router = consul, llama, router


@pytest.fixture(scope="module")
def parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Parts]:
    binary = consul_binary()
    if binary is None or not (BIN / "llama-server").exists():
        pytest.skip("no consul or llama-server binary (run the bootstrap)")
    workdir = tmp_path_factory.mktemp("keys-cli")
    consul = Consul(binary, workdir)
    llama = router = None
    try:
        llama = LlamaServer(write_tiny_gguf(workdir / "tiny.gguf"), workdir)
        router = Router(consul, workdir, "router", "--api-keys-consul")
        consul.define(MODEL)
        consul.register(MODEL, "a", llama.port)
        eventually(lambda: router.metric("llmgw_router_endpoints", model=MODEL) == 1, 15)
        yield Parts(consul, llama, router)
    finally:
        if router is not None:
            router.stop()
        if llama is not None:
            llama.stop()
        consul.stop()


def test_a_key_added_in_consul_is_accepted_by_the_running_router_and_its_usage_shown(
    parts: Parts,
) -> None:
    consul, router = parts.consul, parts.router
    if 60 - time.time() % 60 < 40:
        eventually(lambda: time.time() % 60 < 20, timeout=45, interval=0.2)
    minute = int(time.time() // 60)
    read_before = keys_read(router)
    code, added, err = router_keys(
        consul,
        "add",
        "team",
        "--models",
        "tiny",
        "--requests-per-minute",
        str(RPM),
        "--tokens-per-day",
        str(BUDGET),
    )
    assert code == 0, err
    assert isinstance(added, dict)
    secret = added["key"]
    # The router logs the document it took: from then on the key is valid.
    eventually(lambda: keys_read(router) > read_before, timeout=10)
    used_tokens = 0
    for i in range(3):
        status, headers, answer = post(router, secret)
        assert status == 200, answer
        used_tokens += answer["usage"]["prompt_tokens"] + answer["usage"]["completion_tokens"]
        assert headers["x-ratelimit-limit-requests"] == str(RPM)
        # 95 nobody holds, and what is left of this router's lease of 5.
        assert headers["x-ratelimit-remaining-requests"] == str(RPM - 1 - i)

    lease = lease_size(RPM, REQUEST_LEASE_FRACTION)

    def usage() -> dict[str, dict]:
        code, report, err = router_keys(consul, "usage", "team")
        assert code == 0, err
        assert isinstance(report, list) and [k["name"] for k in report] == ["team"]
        return {row["limit"]: row for row in report[0]["limits"]}

    rows = usage()
    requests = rows["requests_per_minute"]
    assert requests["window"] == str(minute), "the minute changed: see the module docstring"
    # Counted in Consul: the router's one lease, of which 3 were used.
    assert (requests["used"], requests["value"], requests["shared"]) == (lease, RPM, True)
    assert rows["tokens_per_day"]["shared"] and rows["tokens_per_day"]["used"] >= used_tokens
    # The usage of a key that does not exist: exit 1, named.
    code, error, _ = router_keys(consul, "usage", "nobody")
    assert code == 1 and isinstance(error, dict) and "nobody" in error["error"]["message"]

    # A stopping router gives back what its leases hold and were not used: 2 requests,
    # and the budget's lease less the tokens the 3 answers used.
    assert router.stop() == 0
    assert "unused leases given back to Consul" in router.log_path.read_text()
    rows = usage()
    assert rows["requests_per_minute"]["used"] == 3
    assert rows["tokens_per_day"]["used"] == used_tokens


def test_rotate_retires_the_old_secret_and_a_stale_write_is_refused(parts: Parts) -> None:
    consul = parts.consul
    router = Router(consul, parts.router.log_path.parent, "router-2", "--api-keys-consul")
    try:
        eventually(lambda: router.metric("llmgw_router_endpoints", model=MODEL) == 1, 15)
        eventually(lambda: keys_read(router) > 0, 10)  # the document as it was at start
        read_before = keys_read(router)
        code, added, err = router_keys(consul, "add", "on")  # a YAML 1.1 boolean
        assert code == 0, err
        assert isinstance(added, dict)
        old = added["key"]
        eventually(lambda: keys_read(router) > read_before, timeout=10)
        assert post(router, old)[0] == 200
        read_before = keys_read(router)
        code, rotated, err = router_keys(consul, "rotate", "on")
        assert code == 0, err
        assert isinstance(rotated, dict)
        eventually(lambda: keys_read(router) > read_before, timeout=10)
        assert post(router, rotated["key"])[0] == 200
        assert post(router, old)[0] == 401
        code, listed, _ = router_keys(consul, "list")
        assert code == 0 and isinstance(listed, list)
        assert "on" in [k["name"] for k in listed]
        assert old not in json.dumps(listed) and rotated["key"] not in json.dumps(listed)

        # Two operators: one read, the other wrote meanwhile; the first's write at the
        # ModifyIndex it read is refused (the CLI then reads again and re-applies).
        store = ConsulStore(consul_client("127.0.0.1", consul.port, "http", None))
        stale = store.read()
        assert router_keys(consul, "add", "other")[0] == 0
        assert stale.document is not None
        assert store.write(stale.document, stale.version) is False
        fresh = store.read()
        assert "other" in ApiKeys.parse(fresh.document or b"", "kv").by_name()
    finally:
        router.stop()


def test_a_key_added_to_a_running_routers_file_is_accepted_at_its_next_read(
    parts: Parts, tmp_path: Path
) -> None:
    path = tmp_path / "keys.yaml"
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def add(name: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "router", "keys", "add", name, "--file", str(path)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    first = add("first")
    router = Router(parts.consul, tmp_path, "router-file", "--api-keys-file", str(path))
    try:
        eventually(lambda: router.metric("llmgw_router_endpoints", model=MODEL) == 1, 15)
        assert post(router, first)[0] == 200
        second = add("off")  # a YAML 1.1 boolean, quoted by the CLI
        # The router logs each changed document it takes (the file is read every 5 s;
        # the one it started with is not logged as a reload): the event.
        eventually(lambda: "API keys reloaded from" in router.log_path.read_text(), 10)
        assert post(router, second)[0] == 200 and post(router, first)[0] == 200
    finally:
        router.stop()


def test_consul_unreachable_is_exit_3(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "CONSUL_HTTP_ADDR": "127.0.0.1:1"}
    done = subprocess.run(
        [sys.executable, "-m", "router", "keys", "list", "--consul"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 3 and "did not answer" in done.stderr
