"""Canonical Nomad objects for unit tests (after Nomad's nomad/mock/alloc.go): a test
says only what differs. Shapes follow Nomad 1.6's API (api/allocations.go, api/jobs.go,
api/tasks.go): times are Unix nanoseconds.
"""

from __future__ import annotations

from typing import Any

S = 10**9
TASK = "llama-server"


def event(kind: str, at: float, **extra: Any) -> dict[str, Any]:
    """A task event at `at` seconds; `msg` becomes its DisplayMessage."""
    return {"Type": kind, "Time": int(at * S), "DisplayMessage": extra.pop("msg", kind), **extra}


def run(started: float, ended: float | None = None, exit_code: int = 1) -> list[dict[str, Any]]:
    """The events of one start: Started, and Terminated with `exit_code` if it ended."""
    events = [event("Started", started)]
    if ended is not None:
        events.append(event("Terminated", ended, msg=f"Exit Code: {exit_code}", ExitCode=exit_code))
    return events


def alloc(
    alloc_id: str = "a1",
    *events: dict[str, Any],
    job: str = "m",
    index: int = 0,
    node: str = "node-a",
    version: int = 0,
    client: str = "running",
    desired: str = "run",
    **extra: Any,
) -> dict[str, Any]:
    return {
        "ID": alloc_id,
        "JobID": job,
        "Name": f"{job}.server[{index}]",
        "NodeName": node,
        "NodeID": f"{node}-id",
        "JobVersion": version,
        "ClientStatus": client,
        "DesiredStatus": desired,
        "TaskStates": {TASK: {"Events": list(events), "State": "running"}},
        **extra,
    }


def job(
    name: str = "m",
    count: int = 1,
    stop: bool = False,
    definition_hash: str = "d1",
    meta: dict[str, str] | None = None,
    **extra: Any,
) -> dict[str, Any]:
    return {
        "ID": name,
        "Stop": stop,
        "Version": 0,
        "JobModifyIndex": 10,
        "TaskGroups": [{"Name": "server", "Count": count}],
        "Meta": {
            "llmgw_model": name,
            "llmgw_definition_hash": definition_hash,
            "llmgw_spec_hash": "s1",
            **(meta or {}),
        },
        **extra,
    }
