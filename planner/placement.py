"""Why Nomad could not place a model, in one sentence, and when to say so again.

Called by the event watcher for every Evaluation of an llmgw job. Pure: an
evaluation's FailedTGAllocs (one AllocMetric per task group, as
/v1/evaluation/:id returns it) becomes one readable reason, e.g.

    no node has an nvidia/gpu device: 1 of 1 nodes filtered ("missing devices")
    memory exhausted on 2 of 3 nodes

The placement warning is logged when the reason changes, or every
`REPEAT_WARNING` while it persists: the cluster this project comes from logged
"no placement" 250 times in two days, once per evaluation, and nobody read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

REPEAT_WARNING = timedelta(minutes=10)

# Nomad's own words for device filtering (scheduler/feasible.go), made specific.
_CONSTRAINT_WORDS = {
    "missing devices": "no node has an nvidia/gpu device",
    "missing drivers": "no node has the task driver",
    "computed class ineligible": "no node class is eligible",
}


def _nodes(count: int, total: int) -> str:
    return f"{count} of {total} node{'s' if total != 1 else ''}"


def metric_reason(metric: dict[str, Any]) -> str:
    """One AllocMetric -> the reasons it gives, most specific first, joined by '; '."""
    total = int(metric.get("NodesEvaluated") or 0)
    if total == 0:
        pools = ", ".join(sorted(metric.get("NodesAvailable") or {})) or "none"
        return f"no ready node to evaluate (datacenters with nodes: {pools})"
    parts = []
    for constraint, count in sorted((metric.get("ConstraintFiltered") or {}).items()):
        lead = _CONSTRAINT_WORDS.get(constraint, f"constraint {constraint} not met")
        parts.append(f'{lead}: {_nodes(count, total)} filtered ("{constraint}")')
    for node_class, count in sorted((metric.get("ClassFiltered") or {}).items()):
        parts.append(f"node class {node_class!r} filtered: {_nodes(count, total)}")
    for dimension, count in sorted((metric.get("DimensionExhausted") or {}).items()):
        parts.append(f"{dimension} exhausted on {_nodes(count, total)}")
    if not parts and metric.get("NodesExhausted"):
        parts.append(f"resources exhausted on {_nodes(metric['NodesExhausted'], total)}")
    if not parts:
        parts.append(f"no node fits ({_nodes(metric.get('NodesFiltered', 0), total)} filtered)")
    return "; ".join(parts)


def evaluation_reason(evaluation: dict[str, Any]) -> str | None:
    """The reason an evaluation left allocations unplaced, or None if it placed them all."""
    failed = evaluation.get("FailedTGAllocs") or {}
    if not failed:
        return None
    reasons = [metric_reason(metric) for _, metric in sorted(failed.items())]
    return "; ".join(dict.fromkeys(reasons))


@dataclass(frozen=True)
class WarningLog:
    """When the placement warning was last logged, and with which reason."""

    reason: str | None = None
    at: datetime | None = None


def should_warn(last: WarningLog, reason: str, now: datetime) -> bool:
    """Log when the reason is new or changed, or REPEAT_WARNING after the last time."""
    return last.reason != reason or last.at is None or now - last.at >= REPEAT_WARNING
