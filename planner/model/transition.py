"""decide(document, observation, event, rules, now) -> Plan: the model's one transition.

Pure: everything it needs was read before (`Observation`), and what it wants
written comes back as values (`Plan`). The same inputs always give the same
plan, so tests drive it with `tests/support/nomad_mock.py` and a fixed `now`,
and the daemon may decide again, on fresh reads, whenever a write is refused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from llmgw_contract import ActivationAnswer, StateDocument
from planner.failures import Rules
from planner.model.effects import Effect
from planner.model.observation import Observation


class Event(StrEnum):
    """What asked for a decision."""

    OBSERVED = "observed"  # a Nomad event, a health change or a reconcile: re-read all
    TICK = "tick"  # time passed (stability windows)
    RETRY = "retry"  # `planner retry`
    ACTIVATE = "activate"  # a request for the model (the router, via the admin API)
    IDLE = "idle"  # the idle scaler found it unused for its idle_after


@dataclass(frozen=True)
class Note:
    """A line for the log (and `planner status`), at a `logging` level."""

    level: int
    text: str


@dataclass(frozen=True)
class Plan:
    """The next document, the Nomad writes that go with it (in order), notes, and for
    `Event.ACTIVATE` the answer when one can be given without a placement attempt."""

    state: StateDocument
    effects: tuple[Effect, ...] = ()
    notes: tuple[Note, ...] = ()
    answer: ActivationAnswer | None = None

    def note(self, text: str, level: int = logging.INFO) -> Plan:
        return Plan(self.state, self.effects, (*self.notes, Note(level, text)), self.answer)


def decide(document: StateDocument, observation: Observation, event: Event, rules: Rules,
           now: datetime) -> Plan:
    """The plan for one model after `event`, given `document` (as stored at
    `observation.state_index`) and what `observation` read."""
    raise NotImplementedError("issue 19: being written")
