"""The planner's only door to Consul: model records in KV and service health.

Called by `apply` (model records) and `status` (health). Raises only
`planner.errors` types: ConsulUnavailable when Consul cannot be reached or
fails, Rejected when it refuses a request.

KV layout (read by the router, which never imports the planner):
  llmgw/models/<name>   JSON {"name", "definition_hash", "replicas", "source",
                        "sha256", "profile"}: the applied definition
  llmgw/state/<name>    JSON ModelState (planner.state): failures, parked, unplaceable
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import consul
import consul.exceptions
import requests

from planner.errors import ConsulUnavailable, Rejected

MODELS_PREFIX = "llmgw/models/"


@dataclass(frozen=True)
class ServiceHealth:
    """Instances of one Consul service: how many exist and how many pass every check."""

    total: int
    passing: int


@contextmanager
def _translated(action: str) -> Iterator[None]:
    try:
        yield
    except (consul.exceptions.ACLPermissionDenied, consul.exceptions.BadRequest) as exc:
        raise Rejected(f"{action}: Consul refused ({exc})") from exc
    except (consul.exceptions.ConsulException, requests.RequestException, OSError) as exc:
        raise ConsulUnavailable(f"{action}: Consul did not answer ({exc})") from exc


class ConsulClient:
    """Thin wrapper over py-consul for the planner's KV records and health reads."""

    def __init__(self, address: str, token: str | None = None) -> None:
        url = urlparse(address if "://" in address else f"http://{address}")
        self._api = consul.Consul(host=url.hostname or "127.0.0.1", port=url.port or 8500,
                                  scheme=url.scheme, token=token)

    def _call(self, action: str, fn: Callable[[], Any]) -> Any:
        with _translated(action):
            return fn()

    def get_json(self, key: str) -> Any:
        """The JSON value at `key`, or None when the key does not exist."""
        _, item = self._call(f"read {key}", lambda: self._api.kv.get(key))
        return json.loads(item["Value"]) if item and item["Value"] else None

    def get_json_prefix(self, prefix: str) -> dict[str, Any]:
        """Every JSON value under `prefix`: {key: value}."""
        _, items = self._call(f"read {prefix}", lambda: self._api.kv.get(prefix, recurse=True))
        return {item["Key"]: json.loads(item["Value"]) for item in items or [] if item["Value"]}

    def put_json(self, key: str, value: Any) -> None:
        text = json.dumps(value, sort_keys=True)
        self._call(f"write {key}", lambda: self._api.kv.put(key, text))

    def delete_key(self, key: str) -> None:
        self._call(f"delete {key}", lambda: self._api.kv.delete(key))

    def model_records(self) -> dict[str, dict[str, Any]]:
        """Every applied model record: {name: record}."""
        return {key.removeprefix(MODELS_PREFIX): record
                for key, record in self.get_json_prefix(MODELS_PREFIX).items()}

    def put_model_record(self, record: dict[str, Any]) -> None:
        self.put_json(MODELS_PREFIX + record["name"], record)

    def delete_model_record(self, name: str) -> None:
        self.delete_key(MODELS_PREFIX + name)

    def passing_checks(self, index: int | None, wait: str = "5s") -> tuple[int, list[Any]]:
        """Blocking query on every passing check: returns once the set changed after
        `index` (or after `wait`; short, so a shutdown never waits long on it)."""
        new_index, checks = self._call("watch passing checks", lambda: self._api.health.state(
            "passing", index=index, wait=wait))
        return int(new_index), checks or []

    def service_health(self, service: str) -> ServiceHealth:
        """Instances of `service` registered anywhere, and those whose checks all pass."""
        _, nodes = self._call(f"read health of {service}",
                              lambda: self._api.health.service(service))
        passing = sum(1 for node in nodes
                      if all(check["Status"] == "passing" for check in node["Checks"]))
        return ServiceHealth(total=len(nodes), passing=passing)
