"""Idle scale-down: which models are idle, and the scaler's hand-off to the worker."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from datetime import UTC, datetime, timedelta
from typing import Any

from llmgw_contract import ModelRecord
from planner.daemon.idle import IdleScaler, idle_models
from planner.daemon.workers import Skipped
from planner.model.transition import Event

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_idle_models_after_idle_after_without_use() -> None:
    od = {"on_demand": {"idle_after": 60}}
    records = {
        "od": ModelRecord(name="od", definition_hash="h", replicas=1, **od),
        "always": ModelRecord(name="always", definition_hash="h", replicas=1),
        "fresh": ModelRecord(name="fresh", definition_hash="h", replicas=1, **od),
        "unknown": ModelRecord(name="unknown", definition_hash="h", replicas=1, **od),
    }
    counts = {"od": 1, "always": 1, "fresh": 1, "unknown": 1}
    last = {"od": T0 - timedelta(seconds=61), "fresh": T0, "unknown": None}
    assert idle_models(records, counts, last, T0) == ["od"]
    assert idle_models(records, {**counts, "od": 0}, last, T0) == []


class _Book:
    def __init__(self, last: datetime) -> None:
        self.last = last

    def last_used(self, name: str) -> datetime:
        return self.last


class _Records:
    def __init__(self, records: dict[str, ModelRecord]) -> None:
        self.records = records

    def model_records(self) -> dict[str, ModelRecord]:
        return self.records


def test_the_idle_pass_asks_again_before_writing_and_a_use_meanwhile_wins() -> None:
    """The scaler hands the model to its worker with a guard; a request recorded after
    the scaler's choice (an activation's use) makes the guard refuse (planner.daemon.idle)."""
    record = ModelRecord(name="od", definition_hash="h", replicas=1, on_demand={"idle_after": 60})
    book = _Book(T0 - timedelta(seconds=61))
    guards: list[Callable[[], bool]] = []

    def submit(name: str, event: Event, guard: Callable[[], bool] | None) -> Future[Any]:
        assert (name, event) == ("od", Event.IDLE) and guard is not None
        guards.append(guard)
        done: Future[Any] = Future()
        done.set_exception(Skipped("asked for meanwhile"))
        return done

    scaler = IdleScaler(
        _Nomad(),
        _Records({"od": record}),
        book,  # type: ignore[arg-type]
        clock=lambda: T0,
        submit=submit,
    )
    assert scaler.check() == []
    assert guards[0]() is True  # still idle when the pass starts...
    book.last = T0  # ...then an activation records its use
    assert guards[0]() is False


class _Nomad:
    def job(self, name: str) -> dict[str, Any]:
        return {"TaskGroups": [{"Name": "server", "Count": 1}]}
