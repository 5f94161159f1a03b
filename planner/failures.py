"""Count start failures and decide parking: pure functions over Nomad allocations.

Called by the watcher for every Allocation it sees (from the event stream or
from a reconcile listing; the same allocation may come many times) and for
every allocation Consul reports passing.

A start failure is a llama-server start that ended before its allocation was
ever healthy (ARCHITECTURE.md, "Decisions worth keeping"): a task event
`Terminated`, `Driver Failure`, `Failed Artifact Download`, `Setup Failure`
or `Failed Validation`, not caused by a stop (no `Killing` since the last
start), in an allocation that never passed its Consul check. Each is counted
once, keyed by allocation, task and event time, so replayed events and
planner restarts change nothing. A passing allocation resets the count.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from planner.state import ModelState, Parked

PARK_AFTER = 5  # consecutive start failures; `planner serve --park-after` overrides

ENDS_A_START = frozenset({"Terminated", "Driver Failure", "Failed Artifact Download",
                          "Setup Failure", "Failed Validation"})
STOP_REQUESTED = frozenset({"Killing", "Killed", "Sibling Task Failed"})
NEW_START = frozenset({"Started", "Restarting", "Received"})


@dataclass(frozen=True)
class StartFailure:
    key: str  # "<alloc id>/<task>/<event time ns>"
    alloc_id: str
    task: str
    message: str  # "Terminated: Exit Code: 1"
    at_ns: int


def iso(nanos: int) -> str:
    return datetime.fromtimestamp(nanos / 1e9, tz=UTC).isoformat(timespec="seconds")


def start_failures(alloc: dict[str, Any]) -> Iterator[StartFailure]:
    """Every start that ended in this allocation's task events, oldest first."""
    for task, task_state in sorted((alloc.get("TaskStates") or {}).items()):
        stopping = False
        for event in sorted(task_state.get("Events") or [], key=lambda e: e.get("Time", 0)):
            kind = event.get("Type", "")
            if kind in NEW_START:
                stopping = False
            elif kind in STOP_REQUESTED:
                stopping = True
            elif kind in ENDS_A_START and not stopping:
                message = event.get("DisplayMessage") or event.get("Message") or kind
                yield StartFailure(f"{alloc['ID']}/{task}/{event.get('Time', 0)}", alloc["ID"],
                                   task, f"{kind}: {message}", int(event.get("Time", 0)))


def new_failures(state: ModelState, alloc: dict[str, Any]) -> list[StartFailure]:
    """Uncounted failures in `alloc`: a never-healthy allocation, after the last reset."""
    if alloc["ID"] in state.healthy_allocs:
        return []
    return [f for f in start_failures(alloc)
            if f.key not in state.counted and f.at_ns > state.healthy_at_ns]


# llama.cpp's log prefix: elapsed time and level, "0.00.008.710 E ".
LOG_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ ([A-Z]) +")
_TROUBLE = re.compile(r"error|fail|unknown|invalid|cannot|unable|no such|out of memory", re.I)


def stderr_summary(tail: str, keep_errors: int = 8, keep_last: int = 2) -> str:
    """What of a task's stderr tail an operator needs: its error lines (llama.cpp's
    level E, or words of trouble), each once and in order, since llama.cpp names
    the cause first ("failed to open GGUF file", "unknown model architecture"),
    then its last lines. Time prefixes are dropped, so repeats collapse."""
    lines, errors = [], []
    for raw in tail.splitlines():
        match = LOG_PREFIX.match(raw)
        line = (raw[match.end():] if match else raw).strip()
        if not line or line in lines:
            continue
        lines.append(line)
        if (match and match.group(1) == "E") or _TROUBLE.search(line):
            errors.append(line)
    last = [line for line in lines[-keep_last:] if line not in errors[:keep_errors]]
    return "\n".join(errors[:keep_errors] + last)


def count_failure(state: ModelState, failure: StartFailure, stderr_tail: str) -> ModelState:
    """Count one failure; the last error is the task event plus a summary of its stderr."""
    detail = stderr_summary(stderr_tail)
    last_error = failure.message + (f"\n{detail}" if detail else "")
    return state.model_copy(update={
        "consecutive_failures": state.consecutive_failures + 1,
        "last_error": last_error,
        "last_error_at": iso(failure.at_ns),
        "counted": state.remember("counted", failure.key),
    })


def mark_healthy(state: ModelState, alloc_id: str, now_ns: int) -> ModelState:
    """An allocation passed its check: it is healthy for good, and the count starts over."""
    if alloc_id in state.healthy_allocs:
        return state
    return state.model_copy(update={
        "consecutive_failures": 0,
        "healthy_allocs": state.remember("healthy_allocs", alloc_id),
        "healthy_at_ns": now_ns,
        "unplaceable": None,
    })


def decide_parking(state: ModelState, definition_hash: str, now: datetime,
                   park_after: int = PARK_AFTER) -> ModelState:
    """Park once the count reaches `park_after`; an already parked model stays as it is."""
    if state.parked is not None or state.consecutive_failures < park_after:
        return state
    parked = Parked(reason=f"{state.consecutive_failures} consecutive start failures",
                    last_error=state.last_error, since=now.isoformat(timespec="seconds"),
                    definition_hash=definition_hash)
    return state.model_copy(update={"parked": parked})


def retried(state: ModelState) -> ModelState:
    """Lift parking (a changed definition or `planner retry`): a fresh count."""
    return state.model_copy(update={"parked": None, "consecutive_failures": 0})
