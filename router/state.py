"""The planner's per-model state, as much of it as the router acts on.

The planner writes one JSON document per model at ``llmgw/state/<name>``
(``planner.state.ModelState``: failure counts, dedupe keys, ``parked``,
``unplaceable``). The router needs only whether a model is parked or
unplaceable, why, and the last start error, so :func:`parse_states` keeps
those and ignores every other key; a key that is absent means "no state".

Called by :meth:`router.catalog.ConsulCatalog.states` (the parse) and read by
:mod:`router.endpoints` (which hangs each model's state on its entry) and
:mod:`router.refusals` (which words the refusal). The router never imports the
planner, so this is its own reading of the shape, not a shared model.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)

STATE_PREFIX = "llmgw/state/"


@dataclass(frozen=True, slots=True)
class Parked:
    """The planner gave up starting the model; only an operator lifts it."""

    reason: str
    last_error: str = ""
    since: str = ""


@dataclass(frozen=True, slots=True)
class Unplaceable:
    """Nomad found no node the model fits on (its last placement attempt failed)."""

    reason: str
    since: str = ""


@dataclass(frozen=True, slots=True)
class ModelState:
    """What the router acts on for one model; both ``None`` means "serve normally"."""

    parked: Parked | None = None
    unplaceable: Unplaceable | None = None


NO_STATE = ModelState()


def parse_states(entries: list[dict[str, Any]] | None) -> dict[str, ModelState]:
    """Turn a recursive KV read of :data:`STATE_PREFIX` into ``{name: state}``.

    ``entries`` is Consul's JSON list (``Key``, base64 ``Value``), or ``None``
    for a 404. Only models that are parked or unplaceable are returned, so the
    table holds nothing for healthy models. A value that does not decode is
    skipped with a warning (one bad key must not hide the others).
    """
    states: dict[str, ModelState] = {}
    for entry in entries or ():
        key = entry.get("Key", "")
        name = key[len(STATE_PREFIX) :]
        if not name or "/" in name:
            continue
        try:
            doc = json.loads(base64.b64decode(entry.get("Value") or ""))
            state = state_from_doc(doc)
        except (binascii.Error, ValueError, TypeError) as exc:
            log.warning("skipping Consul KV key %s: not a model state (%s)", key, exc)
            continue
        if state != NO_STATE:
            states[name] = state
    return states


def state_from_doc(doc: Any) -> ModelState:
    """Read the ``parked`` and ``unplaceable`` members of one state document.

    Raises ``TypeError`` when ``doc`` or a present member is not a JSON object.
    A parked record without its own ``last_error`` borrows the document's.
    """
    if not isinstance(doc, dict):
        raise TypeError("value is not a JSON object")
    parked = _member(doc, "parked")
    unplaceable = _member(doc, "unplaceable")
    return ModelState(
        parked=None
        if parked is None
        else Parked(
            reason=_text(parked.get("reason")) or "parked by the planner",
            last_error=_text(parked.get("last_error")) or _text(doc.get("last_error")),
            since=_text(parked.get("since")),
        ),
        unplaceable=None
        if unplaceable is None
        else Unplaceable(
            reason=_text(unplaceable.get("reason")) or "no node fits it",
            since=_text(unplaceable.get("since")),
        ),
    )


def _member(doc: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = doc.get(key)
    if value is None:
        return None
    if not isinstance(value, dict):
        raise TypeError(f"{key!r} is not a JSON object")
    return value


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""
