"""Body parsing and the refusals the proxy answers itself (router.proxy, router.app)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from router import errors
from router.app import create_app
from router.catalog import ModelDefinition
from router.proxy import extract_model
from router.settings import RouterSettings


def test_extract_model() -> None:
    assert extract_model(b'{"model": "m", "prompt": "x"}') == "m"
    for bad in (b"{", b"[]", b"{}", b'{"model": 3}', b'{"model": ""}'):
        with pytest.raises(errors.InvalidRequest):
            extract_model(bad)


@pytest.fixture
def client() -> TestClient:
    # No lifespan: no Consul and no upstream pool, the table is filled by hand.
    # Activation off: it needs the planner client the lifespan opens
    # (test_router_activation covers it).
    app = create_app(RouterSettings(activation=False))
    app.state.table.set_models({"ready-later": ModelDefinition("ready-later", replicas=1)})
    app.state.table.set_states({})
    return TestClient(app, raise_server_exceptions=False)


def error_of(response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_unknown_model_is_404(client: TestClient) -> None:
    response = client.post("/v1/chat/completions", json={"model": "nope"})
    assert response.status_code == 404
    assert error_of(response)["code"] == "model_not_found"


def test_model_without_endpoint_is_503(client: TestClient) -> None:
    response = client.post("/v1/embeddings", json={"model": "ready-later"})
    assert response.status_code == 503
    assert response.headers["retry-after"] == "5"
    assert error_of(response)["code"] == "model_not_ready"


def test_bad_body_method_and_route(client: TestClient) -> None:
    assert client.post("/v1/completions", content=b"nope").status_code == 400
    response = client.get("/v1/completions")
    assert response.status_code == 405 and response.headers["allow"] == "POST"
    assert error_of(response)["code"] == "method_not_allowed"
    response = client.get("/v2/whatever")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


def test_models_health_and_metrics(client: TestClient) -> None:
    models = client.get("/v1/models").json()
    assert models == {
        "object": "list",
        "data": [{"id": "ready-later", "object": "model", "created": 0, "owned_by": "llmgw"}],
    }
    assert client.get("/health").json()["status"] == "ok"
    client.post("/v1/completions", json={"model": "nope"})
    text = client.get("/metrics").text
    assert 'llmgw_router_endpoints{model="ready-later"} 0.0' in text
    assert 'llmgw_router_requests_total{code="404",model=""} 1.0' in text


def test_health_is_503_until_models_were_read() -> None:
    client = TestClient(create_app(RouterSettings()))
    assert client.get("/health").status_code == 503


def test_no_endpoint_policy_is_pluggable() -> None:
    async def parked(entry) -> None:
        raise errors.ModelUnavailable(f"{entry.name} is parked", retry_after_s=None)

    app = create_app(RouterSettings(), no_endpoint=parked)
    app.state.table.set_models({"p": ModelDefinition("p")})
    response = TestClient(app).post("/v1/completions", json={"model": "p"})
    assert response.status_code == 503
    assert error_of(response)["message"] == "p is parked"
