"""Per-model failure, parking and placement state: a frozen value, stored in Consul KV.

Called by the watcher (which computes new values), `apply` and `retry`
(which read and clear parking), and `status` / the admin API (which read).
Stored at `llmgw/state/<name>` as JSON so it survives planner restarts and
is readable by the router, which refuses parked and unplaceable models.
`StateStore.save` writes only when the value changed.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from planner.consul_client import ConsulClient

STATE_PREFIX = "llmgw/state/"
# Dedupe memory: enough to cover every start of every allocation a model can
# have before it is parked, with room for restarts of the planner mid-way.
MAX_REMEMBERED = 64


class Parked(BaseModel):
    model_config = ConfigDict(frozen=True)

    reason: str
    last_error: str | None
    since: str  # ISO 8601, UTC
    definition_hash: str  # a different hash at apply time lifts parking


class Unplaceable(BaseModel):
    model_config = ConfigDict(frozen=True)

    reason: str
    since: str
    eval_id: str | None = None


class ModelState(BaseModel):
    """What the planner knows about one model beyond what Nomad and Consul show."""

    model_config = ConfigDict(frozen=True)

    name: str
    consecutive_failures: int = 0
    last_error: str | None = None
    last_error_at: str | None = None
    counted: tuple[str, ...] = ()  # failure keys already counted: "alloc/task/time"
    healthy_allocs: tuple[str, ...] = ()  # allocations seen passing their check
    healthy_at_ns: int = 0  # when one last did: older failures no longer count
    parked: Parked | None = None
    unplaceable: Unplaceable | None = None
    last_used_at: str | None = None  # last activation or router usage report (on-demand)

    def remember(self, field: str, key: str) -> tuple[str, ...]:
        """`field`'s keys with `key` appended, oldest dropped past MAX_REMEMBERED."""
        keys: tuple[str, ...] = getattr(self, field)
        return (*keys, key)[-MAX_REMEMBERED:]


class StateStore:
    """Loads and saves ModelState in Consul KV; keeps the last saved value to skip no-op writes."""

    def __init__(self, consul: ConsulClient) -> None:
        self._consul = consul
        self._saved: dict[str, ModelState] = {}

    def load(self, name: str) -> ModelState:
        raw = self._consul.get_json(STATE_PREFIX + name)
        state = ModelState.model_validate(raw) if raw else ModelState(name=name)
        self._saved[name] = state
        return state

    def load_all(self) -> dict[str, ModelState]:
        states = {}
        for raw in self._consul.get_json_prefix(STATE_PREFIX).values():
            state = ModelState.model_validate(raw)
            states[state.name] = self._saved[state.name] = state
        return states

    def save(self, state: ModelState) -> bool:
        """Write `state` if it differs from what was last loaded or saved; True if written."""
        if self._saved.get(state.name) == state:
            return False
        self._consul.put_json(STATE_PREFIX + state.name, state.model_dump(mode="json"))
        self._saved[state.name] = state
        return True

    def delete(self, name: str) -> None:
        self._consul.delete_key(STATE_PREFIX + name)
        self._saved.pop(name, None)


def as_json(state: ModelState) -> dict[str, Any]:
    return state.model_dump(mode="json")
