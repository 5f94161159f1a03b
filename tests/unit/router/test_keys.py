"""Router API keys: the keys file, authentication, allowed models, and the
Authorization header the replicas see (router.keys, router.proxy, router.app)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from aiohttp import web
from starlette.testclient import TestClient

from router import errors
from router.keys import ApiKeys, ConsulKeys, KeysFile, digest
from router.settings import RouterSettings
from tests.support.router_harness import (
    LocalServer,
    asgi_post,
    in_process_router,
    router_app,
    run,
)

TEAM_KEY = "sk-team-a-0123456789abcdef"
OPS_KEY = "sk-ops-fedcba9876543210"


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    path.write_text(
        "keys:\n"
        f"  - name: team-a\n    sha256: {digest(TEAM_KEY)}\n    models: [m, 'team-a-*']\n"
        f"  - name: ops\n    sha256: {digest(OPS_KEY).upper()}\n"
    )
    return path


def test_load_authenticate_and_allow(tmp_path: Path) -> None:
    keys = ApiKeys.load(str(keys_file(tmp_path)))
    assert len(keys) == 2
    team = keys.authenticate(f"Bearer {TEAM_KEY}".encode())
    assert team.name == "team-a"
    assert team.allows("m") and team.allows("team-a-chat") and not team.allows("other")
    ops = keys.authenticate(f"bearer  {OPS_KEY}".encode())  # the scheme is case-blind
    assert ops.allows("anything")
    for bad in (None, b"Basic abc", f"Bearer {TEAM_KEY}x".encode(), b"Bearer "):
        with pytest.raises(errors.InvalidApiKey):
            keys.authenticate(bad)
    with pytest.raises(errors.InvalidApiKey) as wrong:
        keys.authenticate(b"Bearer sk-wrong-but-long-enough")
    assert TEAM_KEY not in wrong.value.message and "sk-...ough" in wrong.value.message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("keys:\n  - name: a\n    sha256: sk-plain-key\n", "keys.0.sha256: Value error, expected"),
        (
            "keys:\n  - name: a\n    sha256: " + "a" * 64 + "\n    model: [m]\n",
            "keys.0.model: Extra inputs",
        ),
        ("keys:\n  - sha256: " + "a" * 64 + "\n", "keys.0.name: Field required"),
        (
            "keys:\n  - {name: a, sha256: "
            + "a" * 64
            + "}\n  - {name: b, sha256: "
            + "A" * 64
            + "}\n",
            "keys.1.sha256: the same key is listed twice",
        ),
        (
            "keys:\n  - {name: a, sha256: "
            + "a" * 64
            + "}\n  - {name: a, sha256: "
            + "b" * 64
            + "}\n",
            "keys.1.name: 'a' is used twice",
        ),
        ("keys: [\n", "not YAML"),
        ("[]\n", "(top): Input should be a valid dictionary"),
    ],
)
def test_a_bad_keys_file_names_the_file_and_the_field(
    tmp_path: Path, text: str, expected: str
) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match="LLMGW_API_KEYS_FILE=") as info:
        ApiKeys.load(str(path))
    assert str(path) in str(info.value) and expected in str(info.value)
    with pytest.raises(ValueError, match="cannot be read"):
        ApiKeys.load(str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match=expected.split(":")[0]):
        RouterSettings(api_keys_file=str(path)).validate()


def test_models_list_needs_a_key_and_shows_only_its_models(tmp_path: Path) -> None:
    settings = RouterSettings(activation=False, api_keys_file=str(keys_file(tmp_path)))
    client = TestClient(router_app(settings, models=("m", "other", "team-a-chat")))
    response = client.get("/v1/models")
    assert response.status_code == 401
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert response.headers["www-authenticate"].startswith("Bearer")
    listed = client.get("/v1/models", headers={"Authorization": f"Bearer {TEAM_KEY}"}).json()
    assert [m["id"] for m in listed["data"]] == ["m", "team-a-chat"]
    every = client.get("/v1/models", headers={"Authorization": f"Bearer {OPS_KEY}"}).json()
    assert len(every["data"]) == 3
    assert client.get("/health").status_code == 200  # probes need no key
    assert client.get("/metrics").status_code == 200


class EchoReplica(LocalServer):
    """A real aiohttp replica that records the Authorization header it was sent."""

    def __init__(self) -> None:
        self.authorization: list[str | None] = []
        super().__init__(web.post("/v1/completions", self._handle))

    async def _handle(self, request: web.Request) -> web.Response:
        self.authorization.append(request.headers.get("Authorization"))
        return web.json_response({"object": "text_completion"})


@pytest.mark.parametrize("forward", [False, True])
def test_keys_gate_requests_and_the_replica_never_sees_the_key(
    tmp_path: Path, forward: bool
) -> None:
    async def scenario() -> None:
        replica = EchoReplica()
        address = await replica.start()
        settings = RouterSettings(
            activation=False,
            replica_concurrency=4,
            api_keys_file=str(keys_file(tmp_path)),
            forward_authorization=forward,
        )
        try:
            async with in_process_router(settings, models=("m", "other")) as app:
                app.state.table.set_endpoints("m", [address])
                app.state.table.set_endpoints("other", [address])
                body = {"model": "m", "prompt": "hi"}
                status, headers, answer = await asgi_post(app, body)
                assert headers["www-authenticate"].startswith("Bearer")
                assert status == 401 and answer["error"]["code"] == "invalid_api_key"
                team = [(b"authorization", f"Bearer {TEAM_KEY}".encode())]
                status, _, answer = await asgi_post(app, {**body, "model": "other"}, headers=team)
                assert status == 404 and answer["error"]["code"] == "model_not_found"
                assert "do not have access" in answer["error"]["message"]
                status, _, _ = await asgi_post(app, body, headers=team)
                assert status == 200
                metrics = app.state.metrics.registry
                assert (
                    metrics.get_sample_value(
                        "llmgw_router_refusals_total", {"model": "", "reason": "unauthorized"}
                    )
                    == 1
                )
                assert (
                    metrics.get_sample_value(
                        "llmgw_router_refusals_total", {"model": "", "reason": "not_allowed"}
                    )
                    == 1
                )
        finally:
            await replica.stop()
        assert replica.authorization == [f"Bearer {TEAM_KEY}" if forward else None]

    run(scenario())


def test_without_keys_the_clients_authorization_is_still_not_forwarded() -> None:
    async def scenario() -> None:
        replica = EchoReplica()
        address = await replica.start()
        try:
            settings = RouterSettings(activation=False, replica_concurrency=4)
            async with in_process_router(settings) as app:
                app.state.table.set_endpoints("m", [address])
                status, _, _ = await asgi_post(
                    app,
                    {"model": "m", "prompt": "hi"},
                    headers=[(b"authorization", b"Bearer sk-x")],
                )
                assert status == 200
        finally:
            await replica.stop()
        assert replica.authorization == [None]

    run(scenario())


def test_a_changed_keys_file_is_read_again_and_a_broken_one_ignored(tmp_path: Path) -> None:
    path = keys_file(tmp_path)
    followed = KeysFile(str(path))
    team = f"Bearer {TEAM_KEY}".encode()
    assert followed.authenticate(team).name == "team-a"
    assert not followed.reload_if_changed()  # unchanged: not even read

    path.write_text(f"keys:\n  - name: ops-only\n    sha256: {digest(OPS_KEY)}\n")
    assert followed.reload_if_changed()
    with pytest.raises(errors.InvalidApiKey):
        followed.authenticate(team)
    assert followed.authenticate(f"Bearer {OPS_KEY}".encode()).name == "ops-only"

    path.write_text("keys:\n  - name: typo\n    sha256: not-a-digest-at-all\n")
    assert not followed.reload_if_changed()  # logged; the keys read before stay
    assert followed.authenticate(f"Bearer {OPS_KEY}".encode()).name == "ops-only"


def test_a_same_size_rewrite_in_the_same_timestamp_is_seen(tmp_path: Path) -> None:
    # Issue 18: reload was keyed on (mtime, size); now on the content's SHA-256.
    first, second = "team-a", "team-b"
    path = tmp_path / "keys.yaml"
    path.write_text(f"keys:\n  - name: {first}\n    sha256: {digest(TEAM_KEY)}\n")
    followed = KeysFile(str(path))
    stamp = path.stat()
    path.write_text(f"keys:\n  - name: {second}\n    sha256: {digest(OPS_KEY)}\n")
    os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    assert path.stat().st_size == stamp.st_size
    assert path.stat().st_mtime_ns == stamp.st_mtime_ns
    assert followed.reload_if_changed()
    assert followed.authenticate(f"Bearer {OPS_KEY}".encode()).name == second
    with pytest.raises(errors.InvalidApiKey):
        followed.authenticate(f"Bearer {TEAM_KEY}".encode())
    # A file that vanishes is logged once, and the keys read before stay.
    path.unlink()
    assert not followed.reload_if_changed()
    assert not followed.reload_if_changed()
    assert followed.authenticate(f"Bearer {OPS_KEY}".encode()).name == second


def test_consul_keys_fail_closed_until_read_and_when_absent() -> None:
    keys = ConsulKeys()
    ops = f"Bearer {OPS_KEY}".encode()
    with pytest.raises(errors.RouterStarting):
        keys.authenticate(ops)
    keys.set_document(b"keys:\n  - name: typo\n    sha256: nope\n")  # never valid: none
    with pytest.raises(errors.InvalidApiKey):
        keys.authenticate(ops)
    keys.set_document(f"keys:\n  - name: ops\n    sha256: {digest(OPS_KEY)}\n".encode())
    assert keys.authenticate(ops).name == "ops"
    keys.set_document(b"keys: [")  # broken: the keys before stay
    assert keys.authenticate(ops).name == "ops"
    keys.set_document(None)  # deleted: no key is valid
    with pytest.raises(errors.InvalidApiKey):
        keys.authenticate(ops)


def test_keys_from_a_file_or_consul_not_both(tmp_path: Path) -> None:
    settings = RouterSettings(api_keys_file=str(keys_file(tmp_path)), api_keys_consul=True)
    with pytest.raises(ValueError, match="not both"):
        settings.validate()
    assert RouterSettings.from_env({"LLMGW_API_KEYS_CONSUL": "1"}).api_keys_consul


def test_model_patterns_take_whole_classes() -> None:
    for pattern in ("*", "gemma-?", "gemma-[0-9]*", "[!x]*", "a[bc]d"):
        entry = f"keys:\n  - name: k\n    sha256: {digest('x')}\n    models: ['{pattern}']\n"
        assert ApiKeys.parse(entry.encode(), "t"), pattern
