"""Install engines on nodes that become schedulable after their install job ran.

Run by the leader's watcher (`planner.daemon.watcher`): every Node event of the event stream
(a node registered, or turned eligible, or back from down), every Job event of an
engine's install job, and every reconcile. Nomad runs a sysbatch job on a node once per
job version and evaluates sysbatch jobs for nothing but job changes
(nomad/node_endpoint.go `createNodeEvals` evaluates system jobs only;
scheduler/system_util.go places a node's allocation when the node has none), so a node
that joins after `planner engines apply` would never get the engine. An evaluation of
the engine's job places it there.

The engines followed are the defined ones (`planner.daemon.engine_records`: their KV
records, which outlive the install jobs). Nomad's GC deletes an install job once it is
`dead` (issue 20); a node that then lacks the engine gets the install job registered
again, as its record keeps it (which runs it on every node: one that has the engine
checks and records it again). An install job an operator stopped (`nomad job stop`,
without -purge) is left stopped.

Each (node, engine job version) is evaluated once: a node whose install failed keeps
its failed allocation (`planner engines apply` runs it again), and the node's own
re-registration when its metadata changes must not evaluate again and again. Every
write goes through the applier (`planner.daemon.applier`), the planner's one writer of
Nomad.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from llmgw_contract import EngineRecord
from planner.agents.consul import ConsulClient
from planner.agents.nomad import Job, NomadClient
from planner.daemon.applier import Applier
from planner.daemon.engine_install import META_VERSION, registered
from planner.daemon.engine_records import is_engine_job, merged
from planner.errors import PlannerError
from planner.model.effects import Evaluate, Reason, Register
from planner.model.placement import schedulable
from planner.spec.engine_definitions import JOB_PREFIX, meta_key

log = logging.getLogger("planner.engines")


def missing(node: Mapping[str, Any], records: Mapping[str, EngineRecord]) -> list[str]:
    """The engines (by name) whose version `node`'s metadata does not record (pure)."""
    meta = node.get("Meta") or {}
    return sorted(name for name, r in records.items() if meta.get(meta_key(name)) != r.version)


class EngineFollower:
    """Keeps the defined engines in view and installs them on new nodes."""

    def __init__(
        self,
        nomad: NomadClient,
        datacenters: Sequence[str] = ("*",),
        applier: Applier | None = None,
        consul: ConsulClient | None = None,
    ) -> None:
        """`applier` writes the evaluations and registrations (the leader's, fenced by
        its store); None: an unfenced one over `nomad`. `consul` holds the engines'
        records; None: only the install jobs Nomad has are followed."""
        self.nomad, self.consul, self.datacenters = nomad, consul, datacenters
        self.applier = applier or Applier(nomad)
        self._records: dict[str, EngineRecord] = {}
        self._evaluated: set[tuple[str, str, int]] = set()  # (node, job, JobModifyIndex)

    def on_job(self, job: Job) -> None:
        """An engine's install job changed, was stopped or was deleted (purged, or
        garbage-collected): read the engines defined afresh."""
        if is_engine_job(job):
            self._refresh()

    def on_node(self, node: Mapping[str, Any]) -> list[str]:
        """A node changed: for each engine it lacks, evaluate the install job (once per
        job version), or register it again when Nomad no longer has it. Returns the job
        IDs written (Nomad errors are logged, not raised: the next event or reconcile
        tries again)."""
        if not self._records or not schedulable(node, self.datacenters):
            return []
        lacking = missing(node, self._records)
        if lacking and self.consul is not None:
            # Before writing, the records as they are now: one deleted since (an engine
            # withdrawn) must not be installed again.
            try:
                self._refresh()
            except PlannerError as exc:
                log.warning("engines: cannot read the engines defined: %s", exc)
                return []
            lacking = missing(node, self._records)
        written = []
        for name in lacking:
            try:
                if self._install(name, self._records[name], node):
                    written.append(f"{JOB_PREFIX}{name}")
            except PlannerError as exc:
                log.warning(
                    "engine %s: cannot install it on node %s: %s", name, node.get("Name"), exc
                )
        return written

    def _install(self, name: str, record: EngineRecord, node: Mapping[str, Any]) -> bool:
        """Whether it wrote: evaluated the install job for `node`, or registered it."""
        job_id = f"{JOB_PREFIX}{name}"
        job = self.nomad.job(job_id)
        if job is None:
            return self._register_again(name, record, node)
        if job.get("Stop") or (job.get("Meta") or {}).get(META_VERSION) != record.version:
            # Stopped by an operator; or `engines apply` is between its job and its record.
            return False
        key = (str(node.get("ID")), job_id, int(job.get("JobModifyIndex") or 0))
        if key in self._evaluated:
            return False
        self.applier.write_job(
            job_id, [Evaluate(Reason.ENGINE, f"node {node.get('Name')} lacks it")], key[2], job
        )
        self._evaluated.add(key)
        log.info(
            "engine %s: node %s lacks it; evaluated %s to install it there",
            name,
            node.get("Name"),
            job_id,
        )
        return True

    def _register_again(self, name: str, record: EngineRecord, node: Mapping[str, Any]) -> bool:
        if not record.install_job:
            log.warning(
                "engine %s: node %s lacks it, and neither Nomad nor its record has its "
                "install job: run `planner engines apply`",
                name,
                node.get("Name"),
            )
            return False
        # EnforceIndex 0: only while Nomad still has no such job (`engines apply` may
        # be registering it right now).
        self.applier.write_job(
            f"{JOB_PREFIX}{name}",
            [
                Register(
                    Reason.ENGINE,
                    f"node {node.get('Name')} lacks it and its install job is gone",
                    record.install_job,
                )
            ],
            0,
        )
        log.warning(
            "engine %s: node %s lacks it and Nomad no longer has its install job "
            "(garbage-collected); registered it again from its record",
            name,
            node.get("Name"),
        )
        return True

    def _refresh(self) -> None:
        records = self.consul.engine_records() if self.consul is not None else {}
        self._records = merged(records, registered(self.nomad))

    def reconcile(self) -> None:
        """Read the engines defined and every schedulable node afresh (after a reconnect:
        Node events may have been lost)."""
        try:
            self._refresh()
            if not self._records:
                return
            for stub in self.nomad.nodes():
                if schedulable(stub, self.datacenters):
                    node = self.nomad.node(stub["ID"])
                    if node is not None:
                        self.on_node(node)
        except PlannerError as exc:
            log.warning("engines: cannot read the engines or the nodes: %s", exc)
