"""A real Prometheus on 127.0.0.1 for the tests: scrapes the planner and routers given,
every second, with the repo's alert rules loaded, and answers PromQL through its own
HTTP API (/api/v1/query)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from devcluster.bootstrap import BIN
from tests.support.ports import free_port

RULES = Path(__file__).resolve().parents[2] / "monitoring" / "llmgw.rules.yml"


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector `promql` evaluates to now: [{"metric": {...}, "value": [t, v]}]."""
        query = urllib.parse.urlencode({"query": promql})
        with urllib.request.urlopen(f"{self.url}/api/v1/query?{query}", timeout=10) as answer:
            body = json.load(answer)
        if body.get("status") != "success":
            raise AssertionError(f"Prometheus refused {promql!r}: {body}")
        return body["data"]["result"]

    def up(self) -> dict[str, float]:
        """{job: up} of every target scraped."""
        return {r["metric"]["job"]: float(r["value"][1]) for r in self.query("up")}


def _target(url: str) -> str:
    return url.removeprefix("http://").removeprefix("https://").rstrip("/")


@contextlib.contextmanager
def prometheus(folder: Path, planners: list[str], routers: list[str]) -> Iterator[Prometheus]:
    """Run Prometheus scraping `planners` (job llmgw-planner) and `routers` (job
    llmgw-router), base URLs, every second; stopped at the end of the block."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "llmgw-planner",
                "static_configs": [{"targets": [_target(u) for u in planners]}],
            },
            {
                "job_name": "llmgw-router",
                "static_configs": [{"targets": [_target(u) for u in routers]}],
            },
        ],
    }
    (folder / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    with (folder / "prometheus.log").open("ab") as log:
        proc = subprocess.Popen(
            [
                str(BIN / "prometheus"),
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        yield Prometheus(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
