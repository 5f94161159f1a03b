"""The watcher only says which models need a decision (planner.daemon.watcher): events map to
their JobID, health changes and stability ticks to their model, a reset to every model.
Its workers are replaced by a recorder; Nomad and Consul by stand-ins that answer the
few reads these paths make."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

from llmgw_contract import StateDocument, Unplaceable
from planner.agents.nomad import RERUN_WITHIN_S
from planner.daemon.watcher import PassingBook, Watcher
from planner.model.transition import Event

S = 10**9
NOW = datetime(2026, 12, 1, tzinfo=UTC)


class Marks:
    def __init__(self) -> None:
        self.marked: list[tuple[str, Event]] = []

    def mark(self, name: str, event: Event = Event.OBSERVED) -> None:
        self.marked.append((name, event))

    def mark_all(self, names: set[str]) -> None:
        for name in sorted(names):
            self.mark(name)

    def stop(self) -> None:
        pass


class Stand:
    """Nomad and Consul: whatever a test sets as `answers`."""

    def __init__(self, **answers: Any) -> None:
        self.answers = answers

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: self.answers[name]


def watcher(**nomad: Any) -> tuple[Watcher, Marks]:
    consul = Stand(model_records={"m": object(), "n": object()}, get_texts={}, get_indexed_texts={})
    w = Watcher(Stand(**nomad), consul, clock=lambda: NOW)  # type: ignore[arg-type]
    w.workers = Marks()  # type: ignore[assignment]
    w._models = {"m", "n"}
    return w, w.workers  # type: ignore[return-value]


def test_events_mark_their_model_and_nothing_else() -> None:
    w, marks = watcher()
    for event in (
        {"Topic": "Allocation", "Payload": {"Allocation": {"JobID": "m"}}},
        {"Topic": "Evaluation", "Payload": {"Evaluation": {"JobID": "n"}}},
        {"Topic": "Deployment", "Payload": {"Deployment": {"JobID": "m"}}},
        {"Topic": "Allocation", "Payload": {"Allocation": {"JobID": "other"}}},
        {"Topic": "Job", "Payload": {"Job": {"ID": "new", "Meta": {"llmgw_model": "new"}}}},
    ):
        asyncio.run(w.handle_event(event))
    assert [name for name, _ in marks.marked] == ["m", "n", "m", "new"]


def test_health_changes_mark_the_models_whose_passing_set_changed() -> None:
    w, marks = watcher()
    check = {
        "ServiceName": "llmgw-m",
        "ServiceID": "_nomad-task-aaaa1111-bbbb-cccc-dddd-eeeeffff0000-group-server-llmgw-m-http",
    }
    w.handle_passing([check])
    w.handle_passing([check])  # nothing changed
    w.handle_passing([])
    assert marks.marked == [("m", Event.OBSERVED), ("m", Event.OBSERVED)]


def test_a_replica_passing_for_the_window_is_ticked_until_a_tick_pass_judged_it() -> None:
    book = PassingBook()
    book.update({("m", "a1"), ("n", "b1")}, at_ns=0)
    assert book.due(10 * S, 20 * S) == set()
    assert book.due(20 * S, 20 * S) == {"m", "n"}
    book.settle({"a1": 0}, 20 * S, 20 * S)  # m's TICK pass done; n's failed
    assert book.due(21 * S, 20 * S) == {"n"}
    book.settle({"b1": 0}, 21 * S, 20 * S)
    assert book.due(40 * S, 20 * S) == set()
    book.update({("n", "b1")}, at_ns=41 * S)  # a1 stopped passing
    book.update({("m", "a1"), ("n", "b1")}, at_ns=42 * S)  # a new healthy run
    assert book.due(62 * S, 20 * S) == {"m"}
    assert book.of("m") == {"a1": 42 * S}


def test_an_index_below_the_one_seen_is_a_reset_that_reads_every_model_again() -> None:
    w, marks = watcher(latest_index=50, jobs=[])
    w.index = 900
    assert w._check_reset(40).value == "new"
    assert w.resets == 1 and w.index == 50
    assert {name for name, _ in marks.marked} == {"m", "n"}
    w2, marks2 = watcher(latest_index=950)
    w2.index = 900
    assert w2._check_reset(899).value == "seen" and marks2.marked == []


def test_a_provisional_placement_answer_is_looked_at_again_once() -> None:
    """Room being made may end with no event of the model's, and Nomad's re-run of its
    blocked evaluation leaves none when it still cannot place: the watcher looks again
    RERUN_WITHIN_S later (found by CI: a shortfall told "waiting for room" for good)."""
    w, marks = watcher()
    waiting = StateDocument(
        name="m", unplaceable=Unplaceable(reason="waiting for room", provisional=True)
    )
    settled = StateDocument(
        name="n", unplaceable=Unplaceable(reason="memory exhausted on 1 of 1 node")
    )
    start = time.monotonic()
    w._look_again("m", waiting)
    w._look_again("n", waiting.model_copy(update={"name": "n"}))
    w._look_again("n", settled)
    w.check_rechecks(start)
    assert marks.marked == []
    w.check_rechecks(start + RERUN_WITHIN_S + 1)
    w.check_rechecks(start + 2 * RERUN_WITHIN_S + 2)
    assert marks.marked == [("m", Event.OBSERVED)]


def test_passes_that_keep_a_provisional_answer_neither_call_off_nor_delay_the_look() -> None:
    """Issue 22's fourth QA: a scaling model's TICK passes (every 2 s) observe the model
    but keep the document's answer; judged by what they observed (settled) they called off
    the look that would have settled the document, and it said "waiting for room" for
    minutes. Judged by what they wrote, and without pushing the first due time on."""
    w, marks = watcher()
    waiting = StateDocument(
        name="m", unplaceable=Unplaceable(reason="waiting for room", provisional=True)
    )
    start = time.monotonic()
    w._look_again("m", waiting)
    for _ in range(3):
        w._look_again("m", waiting)  # a TICK pass: the document's answer, unchanged
    w.check_rechecks(start + RERUN_WITHIN_S + 0.5)
    assert marks.marked == [("m", Event.OBSERVED)]
