"""Idle scale-down decision."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from llmgw_contract import ModelRecord
from planner.idle import idle_models

T0 = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def test_idle_models_after_idle_after_without_use() -> None:
    od = {"on_demand": {"idle_after": 60}}
    records = {"od": ModelRecord(name="od", definition_hash="h", replicas=1, **od),
               "always": ModelRecord(name="always", definition_hash="h", replicas=1),
               "fresh": ModelRecord(name="fresh", definition_hash="h", replicas=1, **od),
               "unknown": ModelRecord(name="unknown", definition_hash="h", replicas=1, **od)}
    counts = {"od": 1, "always": 1, "fresh": 1, "unknown": 1}
    last = {"od": T0 - timedelta(seconds=61), "fresh": T0, "unknown": None}
    assert idle_models(records, counts, last, T0) == ["od"]
    assert idle_models(records, {**counts, "od": 0}, last, T0) == []
