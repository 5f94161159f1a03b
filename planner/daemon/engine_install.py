"""Engines on the nodes: a sysbatch job per engine installs it, node metadata records it.

Called by `planner engines apply` (`prepare_engines`, `execute_engines`), by
`planner apply` (`engine_refs`: which engine a model's job runs, and which version it
constrains on), and by `planner status --nodes`, the metrics and the placement reason
(`installs`, `progress`: what each node has).

The durable record of a definition is Consul KV `llmgw/engines/<name>`
(`planner.daemon.engine_records`): Nomad's GC removes an install job once it is `dead`.
Its job's meta carries the definition too (`llmgw_engine_record`), from which a wiped
record is restored. What a node has is its dynamic metadata `llmgw_engine_<name> = <version>`,
set by the install task itself once the engine checked out
(`planner/jobspecs/engine.nomad.hcl`); model jobs constrain on exactly that, so the
scheduler and every view here read the same fact.

Nomad places a sysbatch job's allocation on a node once per job version
(scheduler/system_util.go: a terminal allocation is placed again only when the job
changed). So `execute_engines` registers a changed definition (a new version runs on
every node), evaluates an unchanged one (a node that joined since gets its
allocation), and re-registers one whose install failed somewhere with the next
`llmgw_engine_round` (the only way to run it again there).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from llmgw_contract import EngineRecord, lasterror
from planner.agents.consul import ConsulClient
from planner.agents.nomad import Job, NomadClient
from planner.daemon.applier import Applier, Stale
from planner.daemon.engine_records import (
    META_COMMAND,
    META_ENGINE,
    META_RECORD,
    definitions,
    is_engine_job,
    merged,
    record,
)
from planner.engines import MODEL_FILE, engine
from planner.errors import DefinitionError, InvalidDefinitions, NomadRejected
from planner.model.effects import Effect, Evaluate, Reason, Register
from planner.model.placement import schedulable
from planner.spec.engine_definitions import (
    JOB_PREFIX,
    EngineDefinition,
    EngineRef,
    load_engines,
    meta_key,
    unmanaged,
)
from planner.spec.jobspec import variable_file
from planner.spec.settings import Settings

TEMPLATE = Path(__file__).resolve().parent.parent / "jobspecs" / "engine.nomad.hcl"

# Meta keys of an engine's install job (and META_ENGINE, META_RECORD, META_COMMAND:
# its record, `planner.daemon.engine_records`).
META_VERSION = "llmgw_engine_version"
META_ROUND = "llmgw_engine_round"  # raised to run the install again where it failed
META_SPEC_HASH = "llmgw_spec_hash"
# What makes a build: changed under a registered version, it is refused (`changed_builds`).
BUILD_FIELDS = ("artifact", "path", "sha256")
# The install task's memory (MiB): the script and `--version`; serving a check model
# needs room for the model (a tiny GGUF's weights and a 256-token context).
INSTALL_MEMORY_MB = 64
CHECK_MEMORY_MB = 1024
CHECK_CONTEXT = 256


class EngineAction(StrEnum):
    CREATE = "create"
    UPDATE = "update"
    RETRY = "retry"  # same definition; its install failed on some node
    UNCHANGED = "unchanged"


@dataclass(frozen=True)
class EngineChange:
    engine: str
    action: EngineAction
    reason: str
    job: Job | None = None
    # The install job's JobModifyIndex as it was read (0: Nomad had none): a
    # registration is checked against it (EnforceIndex).
    job_index: int = field(default=0, compare=False)
    # The engine's KV record to write (None: it holds this already), checked against
    # the ModifyIndex read (0: none yet).
    record: EngineRecord | None = field(default=None, compare=False)
    record_index: int = field(default=0, compare=False)


@dataclass(frozen=True)
class NodeInstall:
    """One engine on one schedulable node: the version the definition wants, the one the
    node's metadata records (None: none), and its install allocation's client status
    ("" when it has none) with the error of a failed one."""

    node: str
    engine: str
    wanted: str
    installed: str | None
    install: str = ""
    error: str = ""

    @property
    def crash(self) -> str:
        """How the engine died in its run-once check on this node ("SIGILL (exit 132):
        illegal instruction ..."); "" when it did not crash there."""
        return crash_of(self.error)

    @property
    def ok(self) -> bool:
        return self.installed == self.wanted

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "crash": self.crash, "ok": self.ok}


def variables(definition: EngineDefinition, settings: Settings) -> dict[str, Any]:
    """The install template's variables for one engine."""
    command = definition.command(settings.engine_root)
    artifact = definition.artifact or ""
    kind = engine(definition.kind)
    return {
        "engine": definition.name,
        "version": definition.version,
        "meta_key": definition.meta_key,
        "artifact_url": artifact,
        "artifact_sha256": definition.sha256 or "",
        "command_file": command.rsplit("/", 1)[-1],
        "install_dir": command.rsplit("/", 1)[0] if artifact else "",
        "path": definition.path or "",
        "check_args": " ".join(kind.check_args),
        "memory_mb": INSTALL_MEMORY_MB,
        **_check_model(definition),
        "nomad_addr": settings.engine_nomad_addr,
        "driver": settings.task_driver,
        "datacenters": list(settings.datacenters),
    }


def _check_model(definition: EngineDefinition) -> dict[str, Any]:
    """The template's variables of the one-token check (none without `check_model`)."""
    if definition.check_model is None:
        return {}
    kind = engine(definition.kind)
    args = kind.server_args("llmgw-check", CHECK_CONTEXT, gpus=0)
    path, body = kind.check_request
    return {
        "check_model": definition.check_model,
        "check_serve_args": " ".join(
            definition.check_model if arg == MODEL_FILE else arg for arg in args
        ),
        "check_health_path": kind.health_path,
        "check_request_path": path,
        "check_request_body": body,
        "memory_mb": CHECK_MEMORY_MB,
    }


def spec_hash(job: Job) -> str:
    """16 hex chars of sha256 over the rendered job without its round and the hash."""
    meta = {
        k: v for k, v in (job.get("Meta") or {}).items() if k not in (META_SPEC_HASH, META_ROUND)
    }
    canonical = json.dumps({**job, "Meta": meta}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def render(
    definition: EngineDefinition,
    settings: Settings,
    nomad: NomadClient,
    template: str | None = None,
) -> Job:
    """The install job of one engine, parsed by Nomad, its record and hash in the meta.
    Raises NomadRejected when Nomad refuses it, NomadUnavailable when unreachable."""
    hcl = template if template is not None else TEMPLATE.read_text()
    job = nomad.parse(hcl, variable_file(variables(definition, settings)))
    job["Meta"] = {
        **(job.get("Meta") or {}),
        META_RECORD: definition.model_dump_json(),
        META_ROUND: "0",
        META_COMMAND: definition.command(settings.engine_root),
    }
    job["Meta"][META_SPEC_HASH] = spec_hash(job)
    return job


def registered(nomad: NomadClient) -> dict[str, Job]:
    """The engines' install jobs Nomad runs (not stopped), by engine name."""
    jobs = {}
    for stub in nomad.jobs():
        if is_engine_job(stub) and not stub.get("Stop"):
            job = nomad.job(stub["ID"])
            if job is not None and not job.get("Stop"):
                jobs[job["Meta"][META_ENGINE]] = job
    return jobs


def defined(
    nomad: NomadClient,
    consul: ConsulClient,
    root: str,
    jobs: Mapping[str, Job] | None = None,
) -> dict[str, EngineRecord]:
    """The engines defined, by name: their KV records, and the record a registered
    install job carries for one without (`engine_records.merged`). `jobs`: the install
    jobs already read (`registered`)."""
    return merged(consul.engine_records(), registered(nomad) if jobs is None else jobs, root)


def refs_of(records: Mapping[str, EngineRecord]) -> dict[str, EngineRef]:
    """Pure: the defined engines as references, each running the command its install
    recorded (whatever LLMGW_ENGINE_ROOT the reader has), at its version."""
    return {
        name: EngineRef(name, d.kind, records[name].command or d.command(""), d.version)
        for name, d in definitions(records).items()
    }


def engine_refs(
    nomad: NomadClient, consul: ConsulClient, settings: Settings
) -> dict[str, EngineRef]:
    """Every engine a model may name: LLMGW_ENGINES' (unchecked), then the defined
    engines (`defined`: their records outlive the install jobs), which win over a name in
    both."""
    return {
        **unmanaged(settings.engines),
        **refs_of(defined(nomad, consul, settings.engine_root)),
    }


def changed_builds(
    engines: Mapping[str, tuple[Path, EngineDefinition]], installed: Mapping[str, EngineDefinition]
) -> list[DefinitionError]:
    """Pure: an engine whose artifact, path or sha256 changed while its version stayed.
    Nodes record only the version (node meta `llmgw_engine_<name>`) and model jobs
    constrain on it, so a new build under an old version would leave every model job as
    it was (Nomad sees no change), running a command the new install may not have."""
    problems = []
    for name, (file, new) in sorted(engines.items()):
        old = installed.get(name)
        if old is None or old.version != new.version:
            continue
        changed = [
            f"{field} {getattr(old, field)!r} -> {getattr(new, field)!r}"
            for field in BUILD_FIELDS
            if getattr(old, field) != getattr(new, field)
        ]
        if changed:
            problems.append(
                DefinitionError(
                    file,
                    "version",
                    (
                        f"a changed build needs a new version: {'; '.join(changed)}, but version "
                        f"{new.version!r} is already registered; give the build a new version"
                    ),
                )
            )
    return problems


def failed_nodes(job: Job, allocations: Sequence[Mapping[str, Any]]) -> list[str]:
    """Nodes whose latest install allocation of this job version failed."""
    return sorted(
        a.get("NodeName") or node
        for node, a in _latest_by_node(job, allocations).items()
        if a.get("ClientStatus") == "failed"
    )


def decide(
    rendered: Mapping[str, Job],
    jobs: Mapping[str, Job],
    failed: Mapping[str, Sequence[str]],
    stopped: Mapping[str, int] | None = None,
    recorded: Mapping[str, str] | None = None,
) -> list[EngineChange]:
    """What each engine needs (pure): `jobs` the registered install jobs, `failed` the
    nodes where the current version's install failed, by engine, `stopped` the
    JobModifyIndex of a stopped install job Nomad still keeps, by engine, `recorded` the
    version of each engine with a KV record. Each change carries the index its
    registration is checked against."""
    changes = []
    for name, job in sorted(rendered.items()):
        old = jobs.get(name)
        if old is None:
            version = (recorded or {}).get(name)
            if version is None:
                reason = "new engine"
            elif version == job["Meta"][META_VERSION]:
                reason = "its install job is gone from Nomad (garbage-collected); registered again"
            else:
                reason = f"version {version} -> {job['Meta'][META_VERSION]}"
            changes.append(
                EngineChange(name, EngineAction.CREATE, reason, job, (stopped or {}).get(name, 0))
            )
            continue
        index = int(old.get("JobModifyIndex") or 0)
        old_meta = old.get("Meta") or {}
        if old_meta.get(META_SPEC_HASH) != job["Meta"][META_SPEC_HASH]:
            reason = (
                f"version {old_meta.get(META_VERSION)} -> {job['Meta'][META_VERSION]}"
                if old_meta.get(META_VERSION) != job["Meta"][META_VERSION]
                else "definition changed"
            )
            changes.append(EngineChange(name, EngineAction.UPDATE, reason, job, index))
        elif failed.get(name):
            round_ = int(old_meta.get(META_ROUND) or 0) + 1
            again = {**job, "Meta": {**job["Meta"], META_ROUND: str(round_)}}
            changes.append(
                EngineChange(
                    name,
                    EngineAction.RETRY,
                    (
                        f"install failed on {', '.join(failed[name])}: running it again "
                        f"(round {round_})"
                    ),
                    again,
                    index,
                )
            )
        else:
            changes.append(
                EngineChange(name, EngineAction.UNCHANGED, "no changes", job_index=index)
            )
    return changes


def prepare_engines(
    paths: list[Path], settings: Settings, nomad: NomadClient, consul: ConsulClient
) -> list[EngineChange]:
    """Validate every file (and refuse a changed build under a defined version,
    `changed_builds`: against the KV records and the install jobs) and render every job,
    then decide, each change with the KV record to write; changes nothing. Raises
    InvalidDefinitions, NomadRejected or Unavailable."""
    engines = load_engines(paths)
    jobs = registered(nomad)
    records = {name: consul.engine_record(name) for name in engines}
    problems = changed_builds(
        engines, definitions(merged({n: r for n, (_, r) in records.items() if r}, jobs))
    )
    if problems:
        raise InvalidDefinitions(problems)
    template = TEMPLATE.read_text()
    rendered = {name: render(d, settings, nomad, template) for name, (_, d) in engines.items()}
    failed = {
        name: failed_nodes(job, nomad.allocations(job["ID"]))
        for name, job in jobs.items()
        if name in rendered
    }
    # A stopped install job (`registered` leaves it out) is still Nomad's: registering
    # the engine again updates it, at its index.
    stopped = {
        name: int(job.get("JobModifyIndex") or 0)
        for name in rendered
        if name not in jobs and (job := nomad.job(f"{JOB_PREFIX}{name}")) is not None
    }
    changes = decide(
        rendered, jobs, failed, stopped, {n: r.version for n, (_, r) in records.items() if r}
    )
    return [
        _with_record(c, engines[c.engine][1], rendered[c.engine], records[c.engine])
        for c in changes
    ]


def _with_record(
    change: EngineChange,
    definition: EngineDefinition,
    rendered: Job,
    stored: tuple[int, EngineRecord | None],
) -> EngineChange:
    """`change` with the KV record to write: the one its registration makes (or, for an
    unchanged engine, the rendered one), unless the stored record says the same."""
    index, old = stored
    new = record(definition, change.job or rendered)
    if old is not None and _same(old, new):
        return change
    return replace(change, record=new, record_index=index)


def _same(old: EngineRecord, new: EngineRecord) -> bool:
    """Whether a stored record says what a new one would (the job's install round may
    differ: a retry raises it)."""

    def spec(r: EngineRecord) -> tuple[object, ...]:
        meta = r.install_job.get("Meta") or {}
        return (r.version, r.definition, r.command, meta.get(META_SPEC_HASH))

    return spec(old) == spec(new)


def execute_engines(
    changes: Sequence[EngineChange],
    nomad: NomadClient,
    consul: ConsulClient | None = None,
    dry_run: bool = False,
) -> list[dict[str, Any]]:
    """Register what changed, evaluate what did not (a node that joined since gets the
    engine), then write each engine's KV record where it differs (check-and-set on the
    index `prepare_engines` read); with `dry_run`, Nomad's plan instead, writing nothing.
    The record goes after the job: an engine is recorded once Nomad took its install.
    One dict per engine: engine, action, reason, job_id, eval_id (and plan with
    dry_run). Raises NomadRejected (also when an install job or a record changed since
    `prepare_engines` read it: run again) or Unavailable."""
    applier = Applier(nomad)
    outcomes = []
    for change in changes:
        job_id = f"{JOB_PREFIX}{change.engine}"
        outcome: dict[str, Any] = {
            "engine": change.engine,
            "action": str(change.action),
            "reason": change.reason,
            "job_id": job_id,
            "eval_id": None,
        }
        if dry_run:
            if change.job is not None:
                outcome["plan"] = nomad.plan(change.job)
        else:
            effect: Effect = (
                Evaluate(Reason.ENGINE, "a node that joined since gets it")
                if change.job is None
                else Register(Reason.ENGINE, change.reason, change.job)
            )
            try:
                [answer] = applier.write_job(job_id, [effect], change.job_index)
            except Stale as exc:
                raise NomadRejected(
                    f"engine {change.engine}: its install job changed "
                    "while this ran (another writer); run it again"
                ) from exc
            outcome["eval_id"] = answer.get("EvalID") or None
            if change.record is not None and consul is not None:
                _write_record(consul, change)
        outcomes.append(outcome)
    return outcomes


def _write_record(consul: ConsulClient, change: EngineChange) -> None:
    assert change.record is not None
    if not consul.put_engine_record(change.record, change.record_index):
        raise NomadRejected(
            f"engine {change.engine}: its Consul KV record changed while this ran "
            "(another writer); run it again"
        )


def _nodes(nomad: NomadClient, datacenters: Sequence[str]) -> list[dict[str, Any]]:
    """Every schedulable node in full (its Meta), in Nomad's order."""
    full = []
    for stub in nomad.nodes():
        if schedulable(stub, datacenters):
            node = nomad.node(stub["ID"])
            if node is not None:
                full.append(node)
    return full


@dataclass(frozen=True)
class Progress:
    """One engine version across the schedulable nodes: how many record it in their
    metadata, how many there are, and how many are still on their way to it (their
    install allocation of the current job runs, or ended well and the node has not yet
    told the servers: a client sends a metadata change within about 5 s,
    client/client.go nodeUpdateRetryIntv)."""

    installed: int
    nodes: int
    installing: int
    crashed: tuple[tuple[str, str], ...] = ()  # (node, how the engine died there)


def progress(nomad: NomadClient, name: str, version: str, datacenters: Sequence[str]) -> Progress:
    """Where engine `name` at `version` stands on the schedulable nodes."""
    nodes = _nodes(nomad, datacenters)
    key = meta_key(name)
    have = {n["ID"] for n in nodes if (n.get("Meta") or {}).get(key) == version}
    job = nomad.job(f"{JOB_PREFIX}{name}")
    coming, crashed = 0, []
    if (
        job is not None
        and not job.get("Stop")
        and (job.get("Meta") or {}).get(META_VERSION) == version
    ):
        latest = _latest_by_node(job, nomad.allocations(job["ID"]))
        lacking = [(n, latest.get(n["ID"]) or {}) for n in nodes if n["ID"] not in have]
        coming = sum(
            1 for _, a in lacking if a.get("ClientStatus") in ("pending", "running", "complete")
        )
        crashed = [
            (n.get("Name", ""), crash)
            for n, a in lacking
            if a.get("ClientStatus") == "failed" and (crash := crash_of(_alloc_error(nomad, a)))
        ]
    return Progress(
        installed=len(have), nodes=len(nodes), installing=coming, crashed=tuple(crashed)
    )


def installs(
    nomad: NomadClient, consul: ConsulClient, datacenters: Sequence[str]
) -> list[NodeInstall]:
    """Each defined engine (`defined`: a KV record outlives its install job) on each
    schedulable node, by node then engine; an engine whose install job Nomad no longer
    has shows no install status."""
    jobs = registered(nomad)
    engines = definitions(defined(nomad, consul, "", jobs))
    if not engines:
        return []  # no engine defined: no node to read
    allocs = {
        name: _latest_by_node(jobs[name], nomad.allocations(jobs[name]["ID"]))
        for name in engines
        if name in jobs
    }
    rows = []
    for node in _nodes(nomad, datacenters):
        meta = node.get("Meta") or {}
        for name, definition in sorted(engines.items()):
            alloc = allocs.get(name, {}).get(node.get("ID", ""))
            status = (alloc or {}).get("ClientStatus", "")
            error = _alloc_error(nomad, alloc) if status == "failed" else ""
            rows.append(
                NodeInstall(
                    node=node.get("Name", ""),
                    engine=name,
                    wanted=definition.version,
                    installed=meta.get(definition.meta_key),
                    install=status,
                    error=error,
                )
            )
    return rows


def _latest_by_node(
    job: Job, allocations: Sequence[Mapping[str, Any]]
) -> dict[str, Mapping[str, Any]]:
    latest: dict[str, Mapping[str, Any]] = {}
    for alloc in allocations:
        if alloc.get("JobVersion") != job.get("Version"):
            continue
        node = alloc.get("NodeID", "")
        if node not in latest or alloc.get("CreateIndex", 0) > latest[node].get("CreateIndex", 0):
            latest[node] = alloc
    return latest


# Task events that say why a task could not start or ended (nomad/structs/structs.go).
_FAILURE_EVENTS = frozenset(
    {
        "Failed Validation",
        "Driver Failure",
        "Failed Artifact Download",
        "Setup Failure",
        "Terminated",
        "Task hook failed",
    }
)


# The install script's last line when the engine's run-once check failed
# (planner/jobspecs/engine.nomad.hcl), and the words this module puts instead.
_CHECK_EXITED = re.compile(r"^(?P<head>.*) exited with status (?P<status>\d+)$")
_CHECK_CRASHED = re.compile(r" crashed: (?P<how>.+)$")


def check_crash(line: str) -> str:
    """The install script's line, a death by a signal named
    (`llmgw_contract.lasterror.describe`): "... --version exited with status 132" ->
    "... --version crashed: SIGILL (exit 132): illegal instruction (...)"."""
    match = _CHECK_EXITED.match(line)
    if match is None:
        return line
    status = int(match["status"])
    signal = lasterror.crash_signal(status, 0)
    return f"{match['head']} crashed: {lasterror.describe(signal, status)}" if signal else line


def crash_of(error: str) -> str:
    """How the engine died in a failed install's run-once check, as `check_crash` named
    it ("SIGILL (exit 132): ..."); "" when the install failed otherwise."""
    match = _CHECK_CRASHED.search(error)
    return match["how"] if match else ""


def _alloc_error(nomad: NomadClient, alloc: Mapping[str, Any] | None) -> str:
    """A failed install's reason: the last line the task wrote to stderr (the install
    script says what failed, `check_crash` names a signal), else the last event that
    says why (a failed download, a config Nomad refused)."""
    if alloc is None:
        return ""
    for task, state in sorted((alloc.get("TaskStates") or {}).items()):
        tail = nomad.task_stderr_tail(alloc["ID"], task, size=2048)
        lines = [line.strip() for line in tail.splitlines() if line.strip()]
        if lines and "not started yet" not in lines[-1]:
            return check_crash(lines[-1])
        events = [e for e in state.get("Events") or [] if e.get("Type") in _FAILURE_EVENTS]
        if events:
            message = events[-1].get("DisplayMessage") or events[-1].get("Message", "")
            return f"{events[-1].get('Type')}: {' '.join(message.split())}"
    return alloc.get("ClientDescription") or "failed"
