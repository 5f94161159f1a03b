"""The usage report's bounds (llmgw_contract.UsageReport): the planner sums what any
holder of its token sends into scaling decisions (issue 22), so a report out of bounds
is refused whole, never clipped or believed (found in review)."""

from __future__ import annotations

import pytest

from llmgw_contract import decode
from llmgw_contract.documents import (
    MAX_LOAD,
    MAX_NAME_CHARS,
    MAX_REPORTED_MODELS,
    MAX_USAGE_INTERVAL_S,
    UsageReport,
)


@pytest.mark.parametrize(
    "report",
    [
        {"models": [], "load": {"m": {"inflight": -1}}},  # cancelled other routers' load
        {"models": [], "load": {"m": {"waiting": MAX_LOAD + 1}}},  # a surge to max
        {"models": [], "load": {"m": {"replicas": MAX_LOAD + 1}}},
        {"models": [], "load": {"m": {"replicas": -1}}},
        {"models": [], "interval_s": float("nan")},  # never expired
        {"models": [], "interval_s": float("inf")},
        {"models": [], "interval_s": MAX_USAGE_INTERVAL_S + 1},  # hours-old load
        {"models": [], "interval_s": 0},
        {"models": ["x" * (MAX_NAME_CHARS + 1)]},
        {"models": [], "router": "r" * (MAX_NAME_CHARS + 1)},
        {"models": [f"m{i}" for i in range(MAX_REPORTED_MODELS + 1)]},
        {"models": [], "load": {f"m{i}": {} for i in range(MAX_REPORTED_MODELS + 1)}},
    ],
)
def test_a_report_out_of_bounds_is_refused(report: dict) -> None:
    with pytest.raises(ValueError, match="not a UsageReport"):
        decode(UsageReport, report)


def test_a_report_within_bounds_is_taken_and_an_old_routers_too() -> None:
    report = decode(
        UsageReport,
        {
            "models": ["m"],
            "router": "r-1",
            "interval_s": MAX_USAGE_INTERVAL_S,
            "load": {"m": {"inflight": MAX_LOAD, "waiting": 0, "replicas": MAX_LOAD}},
        },
    )
    assert report.load["m"].inflight == MAX_LOAD == report.load["m"].replicas
    # A router older than the replicas' figure sends none: 0, the routers' sum stands.
    assert (
        decode(UsageReport, {"models": [], "load": {"m": {"inflight": 1}}}).load["m"].replicas == 0
    )
    assert decode(UsageReport, {"models": ["m"]}).interval_s == 10.0
