"""Install engines on nodes that become schedulable after their install job ran.

Run by the leader's watcher (`planner.daemon.watcher`): every Node event of the event stream
(a node registered, or turned eligible, or back from down) and every reconcile. Nomad
runs a sysbatch job on a node once per job version and evaluates sysbatch jobs for
nothing but job changes (nomad/node_endpoint.go `createNodeEvals` evaluates system
jobs only; scheduler/system_util.go places a node's allocation when the node has
none), so a node that joins after `planner engines apply` would never get the engine.
An evaluation of the engine's job places it there.

Each (node, engine job version) is evaluated once: a node whose install failed keeps
its failed allocation (`planner engines apply` runs it again), and the node's own
re-registration when its metadata changes must not evaluate again and again. The
evaluation goes through the applier (`planner.daemon.applier`), the planner's one
writer of Nomad.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from planner.agents.nomad import Job, NomadClient
from planner.daemon.applier import Applier
from planner.daemon.engine_install import META_ENGINE, META_VERSION, definitions_of, registered
from planner.errors import PlannerError
from planner.model.effects import Evaluate, Reason
from planner.model.placement import schedulable

log = logging.getLogger("planner.engines")


def missing(node: Mapping[str, Any], jobs: Mapping[str, Job]) -> list[str]:
    """The engines (by name) whose version `node`'s metadata does not record (pure)."""
    meta = node.get("Meta") or {}
    return sorted(
        name for name, d in definitions_of(jobs).items() if meta.get(d.meta_key) != d.version
    )


class EngineFollower:
    """Keeps the engines' install jobs in view and evaluates them for new nodes."""

    def __init__(
        self,
        nomad: NomadClient,
        datacenters: Sequence[str] = ("*",),
        applier: Applier | None = None,
    ) -> None:
        """`applier` writes the evaluations (the leader's, fenced by its store); None: an
        unfenced one over `nomad`."""
        self.nomad, self.datacenters = nomad, datacenters
        self.applier = applier or Applier(nomad)
        self._jobs: dict[str, Job] = {}
        self._evaluated: set[tuple[str, str, int]] = set()  # (node, job, JobModifyIndex)

    def on_job(self, job: Job) -> None:
        """An engine's install job changed (or was stopped)."""
        name = (job.get("Meta") or {}).get(META_ENGINE)
        if not name or META_VERSION not in job.get("Meta", {}):
            return
        if job.get("Stop"):
            self._jobs.pop(name, None)
        else:
            self._jobs[name] = job

    def on_node(self, node: Mapping[str, Any]) -> list[str]:
        """A node changed: evaluate each engine job it lacks, once per job version.
        Returns the job IDs evaluated (Nomad errors are logged, not raised: the next
        event or reconcile tries again)."""
        if not self._jobs or not schedulable(node, self.datacenters):
            return []
        evaluated = []
        for name in missing(node, self._jobs):
            job = self._jobs[name]
            key = (str(node.get("ID")), job["ID"], int(job.get("JobModifyIndex") or 0))
            if key in self._evaluated:
                continue
            try:
                self.applier.write_job(
                    job["ID"],
                    [Evaluate(Reason.ENGINE, f"node {node.get('Name')} lacks it")],
                    key[2],
                    job,
                )
            except PlannerError as exc:
                log.warning(
                    "engine %s: cannot evaluate %s for node %s: %s",
                    name,
                    job["ID"],
                    node.get("Name"),
                    exc,
                )
                continue
            self._evaluated.add(key)
            evaluated.append(job["ID"])
            log.info(
                "engine %s: node %s lacks it; evaluated %s to install it there",
                name,
                node.get("Name"),
                job["ID"],
            )
        return evaluated

    def reconcile(self) -> None:
        """Read the install jobs and every schedulable node afresh (after a reconnect:
        Node events may have been lost)."""
        try:
            self._jobs = registered(self.nomad)
            if not self._jobs:
                return
            for stub in self.nomad.nodes():
                if schedulable(stub, self.datacenters):
                    node = self.nomad.node(stub["ID"])
                    if node is not None:
                        self.on_node(node)
        except PlannerError as exc:
            log.warning("engines: cannot read install jobs or nodes: %s", exc)
