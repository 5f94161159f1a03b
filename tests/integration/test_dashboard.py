"""The Grafana dashboard (monitoring/grafana/llmgw.json) against the real Prometheus
of the tests: every panel's every query parses and returns series for a test
cluster with a model serving, a router that served it (a whole answer, a stream, an
unknown model) and a configured certificate file.

No Grafana server runs here (none can be installed from the registries this project
reaches: docs/operations.md); Grafana's own variables are substituted the way
Grafana would for a 1 s scrape interval and "All" models."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from devcluster.cluster import Cluster
from tests.conftest import (
    PlannerDaemon,
    forget_models,
    http_json,
    passing_endpoints,
    run_router,
    wait_for,
)
from tests.integration.test_parking import write_model
from tests.support.prometheus import Prometheus, prometheus
from tests.support.tiny_gguf import write_tiny_gguf
from tests.support.tls import make_ca

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[2] / "monitoring" / "grafana" / "llmgw.json"
PROVISIONING = DASHBOARD.parent / "provisioning" / "llmgw-dashboards.yml"
# What Grafana puts in place of its variables: "All" models, a rate window of four
# 1 s scrapes (Grafana's $__rate_interval floor), the dashboard's range.
VARIABLES = {"$__rate_interval": "1m", "$__range": "10m", "$model": ".*"}
# Panels whose series need what the test cluster does not have, and where they are tested.
NEEDS: dict[str, str] = {
    "Engines per node": "an engine definition (tests/integration/test_engines.py reads the series)",
}


def queries(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, PromQL with Grafana's variables substituted) of every target."""
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], expr))
    return out


def test_the_dashboard_is_provisioning_ready() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard.get("id") is None
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    names = {v["name"] for v in dashboard["templating"]["list"]}
    assert names == {"datasource", "model"}
    for panel in dashboard["panels"]:
        assert set(panel["gridPos"]) == {"h", "w", "x", "y"}
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            # Every query goes to the data source the operator picks, none by name.
            assert target["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
    for _, expr in queries(dashboard):
        assert "$" not in expr, expr
    [provider] = yaml.safe_load(PROVISIONING.read_text())["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_every_panel_query_returns_series(
    cluster: Cluster, planner: Callable, planner_daemon: PlannerDaemon, tmp_path: Path
) -> None:
    model = write_tiny_gguf(tmp_path / "tiny.gguf")
    folder = write_model(tmp_path / "m", "dash-tiny", model)
    (tmp_path / "tls").mkdir()
    ca = make_ca(tmp_path / "tls")
    dashboard = json.loads(DASHBOARD.read_text())
    try:
        applied = planner("apply", str(folder), "--wait", "--timeout", "120")
        assert applied.returncode == 0, applied.stdout + applied.stderr
        assert passing_endpoints(cluster, "llmgw-dash-tiny")
        # The CA file is only read for its expiry here (the planner URL is http://).
        env = {"LLMGW_PLANNER_CACERT": str(ca.ca_cert)}
        with (
            run_router(cluster, planner_daemon.url, **env) as router,
            prometheus(tmp_path / "prometheus", [planner_daemon.url], [router]) as prom,
        ):
            chat = {
                "model": "dash-tiny",
                "max_tokens": 4,
                "messages": [{"role": "user", "content": "hi"}],
            }
            wait_for(lambda: _answered(router, chat), 30, "the router to serve dash-tiny")
            _stream(router, {**chat, "stream": True})
            with pytest.raises(urllib.error.HTTPError):
                http_json(f"{router}/v1/completions", {"model": "no-such-model", "prompt": "a"})
            wait_for(
                lambda: prom.up() == {"llmgw-planner": 1, "llmgw-router": 1},
                30,
                "Prometheus scraping the planner and the router",
            )
            empty = []
            for title, expr in queries(dashboard):
                # Prometheus refuses (AssertionError) a query that does not parse.
                if title not in NEEDS and not _series(prom, expr, 20):
                    empty.append(f"{title}: {expr}")
            assert not empty, "queries without series:\n" + "\n".join(empty)
    finally:
        forget_models(cluster, "dash-tiny")


def _series(prom: Prometheus, expr: str, timeout: float) -> list[dict[str, Any]]:
    """The series `expr` returns, once it returns any within `timeout` s (a rate
    needs two scrapes), else []."""
    deadline = time.monotonic() + timeout
    while not (result := prom.query(expr)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return result


def _answered(router: str, chat: dict) -> bool:
    try:
        return bool(http_json(f"{router}/v1/chat/completions", chat)["usage"])
    except urllib.error.HTTPError as exc:
        if exc.code == 503:
            return False
        raise


def _stream(router: str, body: dict) -> None:
    request = urllib.request.Request(
        f"{router}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.read().rstrip().endswith(b"data: [DONE]")
