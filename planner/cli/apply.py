"""`planner apply`: make Nomad and Consul hold exactly the models in git.

Called by the CLI. Three steps, in this order, so bad input changes nothing:
  1. load and validate every file (`definitions.load_definitions`), judge each
     model's fit from its GGUF header (`fit.check_models`), and render every job
     through Nomad's parser (`jobspec.render`);
  2. decide, in a pure function, what each model needs (`decide`);
  3. carry that out, model by model, through the applier
     (`planner.daemon.applier`): write its record, then register its job
     checked against the job as step 1 read it (EnforceIndex), or deregister it.
A model whose rendered job hash matches the registered job's
`llmgw_spec_hash`, with the same replicas, bounds and drain (compared apart: Nomad
updates them in place), is left alone, so a second run registers nothing.

Each model is applied whole or not at all (issue 19, item 7): when its
registration fails, its record is put back as it was, so the leader never
judges the running job's replicas by a definition that is not registered.
When Nomad refuses the index (the job changed since step 1 read it: the
leader parked it, another apply ran), the model is read and decided again,
at most MAX_DECISIONS times, and its reason says so; a job parked meanwhile
is never started again by a definition that does not lift its parking.

A model whose registered job constrains on an engine version
(`${meta.llmgw_engine_<name>} = <version>`) is refused, never rolled out, when
the job rendered now would drop that constraint while the model still names the
engine: the engine is not defined right now (its record and install job are
gone), and the rollout would run it on nodes that never installed it (issue 20).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

from llmgw_contract import (
    JobMeta,
    KVPrefix,
    ModelRecord,
    Parked,
    ScalingBounds,
    UpdateFailed,
    kv_key,
    service_name,
)
from llmgw_contract.acl import Permission
from planner.agents import access
from planner.agents.consul import ConsulClient
from planner.agents.nomad import Job, NomadClient
from planner.agents.state import StateStore
from planner.daemon.applier import Applier, Stale
from planner.daemon.engine_install import engine_refs
from planner.daemon.observe import own_definitions
from planner.errors import DefinitionError, InvalidDefinitions, NomadRejected
from planner.model import rollout
from planner.model.effects import Deregister, Effect, Evaluate, Reason, Register
from planner.model.parking import parked_from_job, parked_job, set_parked
from planner.model.placement import EngineNeed
from planner.model.resurrect import failed_elsewhere, held_places, renewal_kept, renewed
from planner.model.unplaceable import engine_need
from planner.spec.definitions import ModelDefinition, load_definitions
from planner.spec.fit import Fit, check_models
from planner.spec.jobspec import (
    SPEC_HASH_KEY,
    drain_of,
    record_of,
    render,
    replicas_of,
    restart_delay_of,
    scaling_of,
)
from planner.spec.settings import Settings


class Action(StrEnum):
    CREATE = "create"
    UPDATE = "update"
    UNCHANGED = "unchanged"
    DEREGISTER = "deregister"
    ORPHANED = "orphaned"  # in Nomad, not in git, and --prune not given
    PARKED = "parked"  # same definition as when parked: left stopped
    ROLLED_BACK = "rolled-back"  # Nomad rolled this definition back: not tried again
    ENGINE_UNKNOWN = "engine-unknown"  # would drop its engine constraint: refused


MUTATIONS = frozenset({Action.CREATE, Action.UPDATE, Action.DEREGISTER})
# What apply refuses for one model (exit 1), the others applied.
REFUSALS = frozenset({Action.ROLLED_BACK, Action.ENGINE_UNKNOWN})
REGISTRATIONS = frozenset({Action.CREATE, Action.UPDATE})
STOPPED_REASON = "job was stopped"
# How often one model is read and decided again when Nomad refuses the index its
# registration was checked against: each refusal means another writer changed the job
# in the moment between a read and a write; three in a row is a writer in a loop.
MAX_DECISIONS = 3
CHANGED_MEANWHILE = "its job changed while apply ran; read again"


@dataclass(frozen=True)
class Change:
    """What one model needs, and why, in words an operator can read."""

    model: str
    action: Action
    reason: str
    job: Job | None = None
    unpark: bool = False  # the definition changed since the model was parked
    # A stopped job registered again with another definition than the one it stopped with.
    restarted_changed: bool = False
    # Deregister with purge: a pruned job left stopped in Nomad would read as one an
    # operator stopped, whose record the leader restores after a wiped KV
    # (`planner.daemon.repair`); False when Nomad has no job left to deregister.
    purge: bool = False
    # The registered job's JobModifyIndex as it was read (0: Nomad had none): the
    # registration is checked against it (EnforceIndex).
    job_index: int = 0
    # The job rendered from git (None for a model no longer defined): what a model is
    # decided again from when its job changed meanwhile.
    rendered: Job | None = field(default=None, compare=False, repr=False)

    @property
    def restart(self) -> bool:
        """Registering starts a job that was stopped (or parked): its old replicas must
        be replaced, not kept."""
        return self.unpark or self.reason == STOPPED_REASON


@dataclass
class Outcome:
    """What a run did: one entry per model, with Nomad's evaluation when it registered."""

    change: Change
    eval_id: str | None = None
    job_version: int | None = None
    plan: dict[str, Any] | None = field(default=None, repr=False)

    def as_dict(self) -> dict[str, Any]:
        return {
            "model": self.change.model,
            "action": str(self.change.action),
            "reason": self.change.reason,
            "eval_id": self.eval_id,
            "job_version": self.job_version,
        }


def is_managed(job: Job) -> bool:
    return JobMeta.MODEL in (job.get("Meta") or {})


def _update_reason(new: Job, old: Job) -> str:
    new_meta, old_meta = new.get("Meta") or {}, old.get("Meta") or {}
    if old.get("Stop"):
        return STOPPED_REASON
    if new_meta.get(JobMeta.DEFINITION_HASH) != old_meta.get(JobMeta.DEFINITION_HASH):
        return "source or profile changed"
    named = [why for why in (_restarts(new, old), _counts(new, old), _drain(new, old)) if why]
    return "; ".join(named) or "job template or settings changed"


def _restarts(new: Job, old: Job) -> str | None:
    """How the pause between failed starts differs, or None. Unlike the drain it is in
    the spec hash: a change rolls out (a Nomad client keeps a running task's restart
    policy as the task started)."""
    before, after = restart_delay_of(old), restart_delay_of(new)
    return f"restart_delay {before / 1e9:g}s -> {after / 1e9:g}s" if before != after else None


def _counts(new: Job, old: Job) -> str | None:
    """How the replicas differ (the spec hash leaves them out), or None. An on-demand
    job's count is activation's, not the definition's: only its replicas compare."""
    if replicas_of(new) != replicas_of(old):
        return f"replicas {replicas_of(old)} -> {replicas_of(new)}"
    bounds = scaling_of(new)
    if bounds != scaling_of(old):
        return _bounds_change(scaling_of(old), bounds)
    if bounds is not None:
        # The scaler's count: changed only when it leaves the bounds (`_keep_count`).
        old_count = sum(tg.get("Count", 0) for tg in old.get("TaskGroups") or [])
        kept = _within(old_count, bounds, new)
        return f"replicas {old_count} -> {kept}" if kept != old_count else None
    if (new.get("Meta") or {}).get(JobMeta.ON_DEMAND) == "true":
        return None
    old_count = sum(tg.get("Count", 0) for tg in old.get("TaskGroups") or [])
    new_count = sum(tg.get("Count", 0) for tg in new.get("TaskGroups") or [])
    return f"replicas {old_count} -> {new_count}" if old_count != new_count else None


def _drain(new: Job, old: Job) -> str | None:
    """How the tasks' drain differs (the spec hash leaves it out: Nomad updates it in
    place), or None."""
    before, after = drain_of(old), drain_of(new)
    changed = [
        f"{word} {before[key] / 1e9:g}s -> {after[key] / 1e9:g}s"
        for key, word in (("ShutdownDelay", "shutdown_delay"), ("KillTimeout", "kill_timeout"))
        if before[key] != after[key]
    ]
    return ", ".join(changed) or None


def _parked_change(name: str, job: Job, old: Job | None, parked: Parked) -> Change:
    """A parked model stays parked under the same definition (docs/architecture.md,
    "Parking": lifted only by a new source or profile, or `planner retry`); a new one
    lifts it."""
    if job["Meta"][JobMeta.DEFINITION_HASH] != parked.definition_hash:
        if old is None:
            return Change(name, Action.CREATE, "source or profile changed; lifts parking", job)
        return Change(
            name, Action.UPDATE, "source or profile changed; lifts parking", job, unpark=True
        )
    if old is None:
        # Parked, then its job purged (`nomad job stop -purge`): the KV copy is the only
        # record left. The same definition is registered stopped, still parked, so that
        # `planner retry` (which needs a job) can lift it; never five more starts.
        return Change(
            name,
            Action.CREATE,
            f"its job was purged while parked ({parked.reason}); registered again, still "
            f"parked: run `planner retry {name}` to start it",
            parked_job(job, parked),
        )
    if old is not None and (old.get("Meta") or {}).get(SPEC_HASH_KEY) == job["Meta"][SPEC_HASH_KEY]:
        return Change(
            name,
            Action.PARKED,
            f"parked: {parked.reason}; change its source or profile, or run `planner retry {name}`",
        )
    return Change(
        name,
        Action.UPDATE,
        "job changed; stays parked (same source and profile)",
        parked_job(job, parked),
    )


def dropped_engine(job: Job, old: Job | None) -> EngineNeed | None:
    """Pure: the engine version `old` (the registered job) constrains on that `job` (the
    one rendered now) would drop while its model still names that engine; None when
    nothing is dropped (no constraint before, the same engine at any version now, or the
    model moved to another engine). An engine is rendered without its constraint only
    when it is not defined right now (LLMGW_ENGINES names it, unchecked)."""
    need = engine_need(old)
    if need is None:
        return None
    now = engine_need(job)
    if now is not None and now.name == need.name:
        return None
    try:
        named = str(record_of(job).profile.get("engine") or "")
    except (KeyError, ValueError):
        return None
    return need if named == need.name else None


def _engine_refused(name: str, need: EngineNeed) -> Change:
    return Change(
        name,
        Action.ENGINE_UNKNOWN,
        (
            f"its job runs engine {need.name} {need.version} (constraint {need.constraint}), "
            f"which is not defined now (no record in Consul KV, no install job in Nomad); "
            f"applying would drop that constraint: run `planner engines apply` with "
            f"{need.name}'s file first"
        ),
    )


def _bounds(bounds: ScalingBounds | None) -> str:
    return f"{bounds.min}..{bounds.max} (target {bounds.target:g})" if bounds else "none"


def _bounds_change(old: ScalingBounds | None, new: ScalingBounds | None) -> str:
    """ "scaling max 4 -> 8, down_after 60s -> 61s": the fields that differ, each named
    (a change of a window alone read "1..2 (target 1) -> 1..2 (target 1)": issue 22's
    fourth QA); "scaling none -> 1..3 (target 2)" when scaling starts or ends."""
    if old is None or new is None:
        return f"scaling {_bounds(old)} -> {_bounds(new)}"
    changed = [
        f"{field} {_bound(field, getattr(old, field))} -> {_bound(field, getattr(new, field))}"
        for field in ScalingBounds.model_fields
        if getattr(old, field) != getattr(new, field)
    ]
    return f"scaling {', '.join(changed)}"


def _bound(field: str, value: float) -> str:
    return f"{value:g}" if field in ("min", "max", "target") else f"{value:g}s"


def _within(count: int, bounds: ScalingBounds, job: Job) -> int:
    """A scaling model's registered count kept within its (new) bounds; an idle on-demand
    model (count 0) stays idle."""
    if count == 0 and (job.get("Meta") or {}).get(JobMeta.ON_DEMAND) == "true":
        return 0
    return min(max(count, bounds.min, 1), bounds.max)


def _keep_activation(job: Job, old: Job) -> Job:
    """An on-demand job is rendered with count 0; an update must not stop a model that
    is active now, so it keeps the registered count (the idle scaler lowers it). A
    scaling model's job keeps the count the scaler set, within its bounds: a change of
    bounds (or of anything but the definition) is not a reset of the count."""
    bounds = scaling_of(job)
    on_demand = (job.get("Meta") or {}).get(JobMeta.ON_DEMAND) == "true"
    if (not on_demand and bounds is None) or old.get("Stop"):
        return job
    counts = {tg["Name"]: tg.get("Count", 0) for tg in old.get("TaskGroups") or []}
    groups = []
    for tg in job.get("TaskGroups") or []:
        count = counts.get(tg["Name"], tg.get("Count", 0))
        if bounds is not None:
            count = _within(count, bounds, job)
        # An active model rolls out beside itself like any other (one canary per
        # replica); an idle one takes the new definition at once (nothing serves).
        update = {**(tg.get("Update") or {}), "Canary": count, "AutoPromote": count > 0}
        groups.append({**tg, "Count": count, "Update": update})
    return {**job, "TaskGroups": groups}


def _gone(name: str, old: Job | None, parked: bool, prune: bool) -> Change:
    """A model applied before and no longer in the files: its job running, stopped (by
    an operator, or parked), or gone from Nomad with its KV record left. Pruning purges
    the job, so a stopped llmgw job in Nomad is never a pruned one (`planner.daemon.repair`
    restores the records of the others)."""
    if old is None:
        how = "no Nomad job; "
    elif parked:
        how = "parked; "
    else:
        how = "stopped; " if old.get("Stop") else ""
    if prune:
        return Change(
            name, Action.DEREGISTER, f"{how}no longer defined in git", purge=old is not None
        )
    verb = "stop" if old is not None and not old.get("Stop") else "remove"
    return Change(
        name, Action.ORPHANED, f"{how}no longer defined in git; run with --prune to {verb} it"
    )


def decide(
    rendered: dict[str, Job],
    registered: dict[str, Job],
    prune: bool,
    parked: dict[str, Parked] | None = None,
    rolled_back: dict[str, UpdateFailed] | None = None,
    records: Iterable[str] = (),
) -> list[Change]:
    """Pure: compare rendered jobs with registered llmgw jobs; one Change per model.

    `registered` holds only jobs llmgw manages (meta llmgw_model), keyed by ID;
    `parked` the parked models' parking records; `rolled_back` the updates Nomad
    rolled back whose definition is the one rendered now; `records` the models with a
    KV record (applied before, whether or not Nomad still has their job). Each Change
    carries the registered job's JobModifyIndex (`job_index`) and the rendered job; the
    job it registers keeps the registered one's renewal marker while the definition is
    the same (`planner.model.resurrect.renewal_kept`).
    """
    changes = [
        replace(
            change,
            job=None
            if change.job is None
            else renewal_kept(change.job, registered.get(change.model)),
            job_index=_job_index(registered.get(change.model)),
            rendered=rendered.get(change.model),
        )
        for change in _changes(
            rendered, registered, prune, parked or {}, rolled_back or {}, records
        )
    ]
    return changes


def _job_index(job: Job | None) -> int:
    return int((job or {}).get("JobModifyIndex") or 0)


def _changes(
    rendered: dict[str, Job],
    registered: dict[str, Job],
    prune: bool,
    parked: dict[str, Parked],
    rolled_back: dict[str, UpdateFailed],
    records: Iterable[str],
) -> list[Change]:
    changes = []
    for name, job in sorted(rendered.items()):
        old = registered.get(name)
        if (need := dropped_engine(job, old)) is not None:
            # Before parking: a stopped job re-registered without it would start so.
            changes.append(_engine_refused(name, need))
        elif name in parked:
            changes.append(_parked_change(name, job, old, parked[name]))
        elif name in rolled_back:
            failed = rolled_back[name]
            changes.append(
                Change(
                    name,
                    Action.ROLLED_BACK,
                    (
                        f"this definition was rolled back ({failed.reason}); it is not tried "
                        f"again: change it, or run `planner retry {name}`"
                    ),
                )
            )
        elif old is None:
            changes.append(Change(name, Action.CREATE, "new model", job))

        elif (
            old.get("Stop")
            or (old.get("Meta") or {}).get(SPEC_HASH_KEY) != job["Meta"][SPEC_HASH_KEY]
            or _counts(job, old) is not None
            or _drain(job, old) is not None
        ):
            changes.append(
                Change(
                    name,
                    Action.UPDATE,
                    _update_reason(job, old),
                    _keep_activation(job, old),
                    restarted_changed=bool(old.get("Stop"))
                    and rollout.definition_of(old) != rollout.definition_of(job),
                )
            )
        else:
            changes.append(Change(name, Action.UNCHANGED, "no changes"))
    for name in sorted((set(registered) | set(records or ())) - set(rendered)):
        changes.append(_gone(name, registered.get(name), name in parked, prune))
    return changes


def _registered_llmgw_jobs(nomad: NomadClient) -> dict[str, Job]:
    jobs = {}
    for stub in nomad.jobs():
        job = nomad.job(stub["ID"])
        if job is not None and is_managed(job):
            jobs[job["ID"]] = job
    return jobs


def _check_foreign(
    rendered: dict[str, Job],
    nomad: NomadClient,
    models: dict[str, tuple[Path, ModelDefinition]],
    registered: dict[str, Job],
) -> None:
    """Refuse to overwrite a Nomad job of the same ID that llmgw does not manage, and to
    start a second copy of a model that an llmgw job already runs in another namespace
    (`_elsewhere`)."""
    errors = _elsewhere(rendered, nomad, models)
    for name in rendered:
        if name not in registered and nomad.job(name) is not None:
            errors.append(
                DefinitionError(
                    models[name][0],
                    "name",
                    (
                        f"Nomad already has a job {name!r} that llmgw does not manage "
                        "(no llmgw_model meta); rename the model or remove that job"
                    ),
                )
            )
    if errors:
        raise InvalidDefinitions(errors)


def _elsewhere(
    rendered: dict[str, Job],
    nomad: NomadClient,
    models: dict[str, tuple[Path, ModelDefinition]],
) -> list[DefinitionError]:
    """A model whose name an llmgw job has in another Nomad namespace than
    NOMAD_NAMESPACE: the planner manages one namespace (docs/definitions.md,
    "Namespace"), and the two jobs would register one Consul service, `llmgw-<name>`,
    whose replicas the router and `planner status` count as one model's. Seen as far as
    the token may list jobs in the other namespaces."""
    errors = []
    for stub in nomad.llmgw_jobs_elsewhere(set(rendered)):
        name, there = stub["ID"], stub.get("Namespace", "default")
        state = "stopped" if stub.get("Stop") else str(stub.get("Status", ""))
        errors.append(
            DefinitionError(
                models[name][0],
                "name",
                (
                    f"model {name!r} already has an llmgw job in Nomad namespace {there!r} "
                    f"({state}), and this planner manages namespace {nomad.namespace!r} "
                    "(NOMAD_NAMESPACE); two copies would share the Consul service "
                    f"{service_name(name)} and be counted as one. Remove it there "
                    f"(NOMAD_NAMESPACE={there} planner apply --prune without it, or nomad "
                    f"job stop -purge -namespace {there} {name}), or set "
                    f"NOMAD_NAMESPACE={there} to manage it where it runs"
                ),
            )
        )
    return errors


def prepare(
    paths: list[Path],
    settings: Settings,
    nomad: NomadClient,
    consul: ConsulClient,
    prune: bool,
    needs: tuple[Permission, ...] = (),
) -> tuple[dict[str, ModelDefinition], list[Change], dict[str, Fit]]:
    """Validate everything and decide; changes nothing. The files are validated before
    anything else is judged (invalid files exit 2 whatever the agents); then the tokens
    must allow `needs` (`planner.agents.access`). Also returns each model's fit (`planner.spec.fit`:
    its memory estimate from the GGUF header). Raises InvalidDefinitions (a bad file, or
    a model its header says cannot fit), PermissionDenied, NomadRejected (a template
    Nomad refuses) or Unavailable."""
    # The engines a model may name: defined ones (their install jobs in Nomad) and
    # LLMGW_ENGINES'; a defined engine's version is what the model's job constrains on.
    # The files alone first (bad files are exit 2 whatever the agents), then the tokens
    # (one message naming every permission lacking), then the files against the engines.
    load_definitions(paths, models_root=settings.models_root)
    access.check(nomad, consul, needs)
    engines = engine_refs(nomad, consul, settings)
    models = load_definitions(paths, engines, settings.models_root)
    fits = check_models(models)
    template = settings.jobspec.read_text()
    rendered = {
        name: render(d, settings, nomad, template, engines[d.profile.engine])
        for name, (_, d) in models.items()
    }
    registered = _registered_llmgw_jobs(nomad)
    _check_foreign(rendered, nomad, models, registered)
    definitions = {name: d for name, (_, d) in models.items()}
    # The stopped job's meta is the durable record of parking (docs/architecture.md):
    # a wiped or stale KV cache must never un-park a model on re-apply.
    parked = {
        name: p for name, job in registered.items() if (p := parked_from_job(job)) is not None
    }
    states = StateStore(consul).load_all()
    # A parked model whose job was purged: its KV copy is all that is left of its
    # parking, and re-applying the same definition keeps it (docs/cli.md, "retry").
    parked |= {
        name: p
        if p.definition_hash
        else p.model_copy(update={"definition_hash": state.definition_hash})
        for name, state in states.items()
        if name in rendered and name not in registered and (p := state.parked) is not None
    }
    recorded = {n: s.update_failed for n, s in states.items() if s.update_failed is not None}
    return (
        definitions,
        decide(
            rendered,
            registered,
            prune,
            parked,
            _rolled_back(rendered, registered, nomad, recorded),
            _own_records(consul.model_records(), registered, rendered, nomad),
        ),
        fits,
    )


def _own_records(
    records: dict[str, ModelRecord],
    registered: dict[str, Job],
    rendered: dict[str, Job],
    nomad: NomadClient,
) -> set[str]:
    """The model records this planner's namespace answers for: a record whose model has
    no job here but an llmgw job in another namespace is that namespace's planner's (one
    Consul holds both), never pruned from here (found by a new user: `--prune` in `llm`
    deleted the records of every model serving in `default`)."""
    candidates = set(records) - set(registered) - set(rendered)
    if not candidates:
        return set(records)
    elsewhere = {stub["ID"] for stub in nomad.llmgw_jobs_elsewhere(candidates)}
    return set(records) - elsewhere


def _rolled_back(
    rendered: dict[str, Job],
    registered: dict[str, Job],
    nomad: NomadClient,
    recorded: dict[str, UpdateFailed],
) -> dict[str, UpdateFailed]:
    """The models whose rendered definition Nomad rolled back: read from Nomad (job
    versions and deployments; `planner.model.rollout.rolled_back`), so a wiped KV cannot
    retry it, or else from the state documents' records (`recorded`: model ->
    `update_failed`; `rollout.recorded_rollback`), so the versions a scaling model makes
    cannot push it out of Nomad's last 6 and retry it either."""
    found = {}
    for name, job in rendered.items():
        old = registered.get(name)
        wanted = rollout.definition_of(job)
        if old is None or old.get("Stop") or rollout.definition_of(old) == wanted:
            continue
        failed = rollout.rolled_back(
            nomad.versions(name), nomad.deployments(name), wanted
        ) or rollout.recorded_rollback(recorded.get(name), rollout.definition_of(old), wanted)
        if failed is not None:
            found[name] = failed
    return found


def execute(
    definitions: dict[str, ModelDefinition],
    changes: list[Change],
    nomad: NomadClient,
    consul: ConsulClient,
    dry_run: bool,
) -> list[Outcome]:
    """Carry out `changes` (or, with dry_run, ask Nomad for each plan instead), one
    model after the other, each whole or not at all (`_apply_model`).

    A model's record goes to Consul before its job: the watcher and the router learn a
    model from its record, and must know it before Nomad's first evaluation of it
    arrives (C08 wants the unplaceable answer within 2 s of apply). A pruned model's
    record goes after its job is stopped, so the leader never sees a running job
    without a record (which it would restore). Raises what the agents raise
    (NomadRejected, also when a model's job kept changing, MAX_DECISIONS times, under
    the registration; Unavailable), after putting that model's record back."""
    if dry_run:
        return [_planned(change, nomad) for change in changes]
    applier = Applier(nomad, StateStore(consul))
    existing = consul.model_records()
    outcomes = []
    for change in changes:
        definition = definitions.get(change.model)
        if change.action is Action.DEREGISTER:
            outcomes.append(_deregister(change, applier, consul))
        elif definition is None:
            outcomes.append(Outcome(change))
        else:
            outcomes.append(
                _apply_model(
                    change, definition.record(), existing.get(change.model), applier, consul
                )
            )
    return outcomes


def _planned(change: Change, nomad: NomadClient) -> Outcome:
    outcome = Outcome(change)
    if change.action in REGISTRATIONS and change.job is not None:
        outcome.plan = nomad.plan(change.job)
    return outcome


def _apply_model(
    change: Change,
    record: ModelRecord,
    old: ModelRecord | None,
    applier: Applier,
    consul: ConsulClient,
) -> Outcome:
    """One model whole or not at all: its record written (only where it differs; a new
    model's state document too), then its job registered; when that fails, whatever
    the reason, the record is put back as it was (`old`; None: removed, with the state
    document made for it) and the error raised."""
    if old != record:
        consul.put_model_record(record)
    # Failures count from now, even if the planner is down when they happen.
    created = old is None and StateStore(consul).create(change.model)
    try:
        return _register(change, applier)
    except BaseException:
        _restore(change.model, record, old, created, consul)
        raise


def _restore(
    name: str, record: ModelRecord, old: ModelRecord | None, created: bool, consul: ConsulClient
) -> None:
    if old is None:
        consul.delete_model_record(name)
    elif old != record:
        consul.put_model_record(old)
    if created:
        StateStore(consul).delete(name)


def _register(change: Change, applier: Applier) -> Outcome:
    """Register `change`'s job checked against the index it was decided on; when Nomad
    refuses that index, read the model again, decide again, and carry that out (at
    most MAX_DECISIONS decisions). Raises NomadRejected when the job kept changing."""
    for attempt in range(MAX_DECISIONS):
        if attempt:
            change = _noted(_decide_again(change, applier), CHANGED_MEANWHILE)
        if change.action not in REGISTRATIONS or change.job is None:
            return Outcome(change)
        try:
            return _registered(change, applier)
        except Stale:
            continue
    raise NomadRejected(
        f"model {change.model}: its job changed {MAX_DECISIONS} times "
        "while apply registered it (another writer); run apply again"
    )


def _noted(change: Change, note: str) -> Change:
    return replace(change, reason=f"{change.reason} ({note})")


def registration(
    change: Change, stale: tuple[str, ...] = (), held: tuple[str, ...] = ()
) -> list[Effect]:
    """The effects that register `change.job`: the registration, and for a job that was
    stopped, a forced reschedule of the replicas Nomad stopped after their restart
    attempts (they keep their place in the count across a job stop: no reschedule).
    `stale`: those of them whose job version is not of `change.job`'s definition
    (`planner.model.resurrect.failed_elsewhere`, read by `_registered`).

    Not when the job starts again with a new definition (parking lifted by it, or a
    stopped job) that rolls out with canaries: Nomad places the replacement of a failed
    allocation of the old version at that old version until the canaries are promoted,
    so a forced reschedule starts the definition git no longer has, five more times
    (found by a new user: issue 19's QA, "D1"; `planner.model.resurrect`). The canaries
    replace the old allocations on promotion, and a canary that never passes parks the
    model as any failing definition does.

    Never while one of those replicas is `stale` (the job stopped during a rollout
    kept one of the definition before): the forced reschedule would place it again at
    its own version. Nor while any failed replica holds its place (`held`, of any
    version: `planner.model.resurrect.held_places`): a registration equal to its job
    (A, then B, then A again) does not update it, and Nomad places nothing. The job is
    then registered renewed (`planner.model.resurrect.renewed`), a version whose meta
    no allocation has, which replaces them all."""
    assert change.job is not None
    new_definition = change.unpark or change.restarted_changed
    job = change.job
    if change.restart and (stale or held):
        job = renewed(job, change.job_index)
    effects: list[Effect] = [Register(Reason.APPLY, change.reason, job)]
    if change.restart and not (stale or held) and not (new_definition and _canaries(change.job)):
        effects.append(
            Evaluate(Reason.APPLY, "the stopped job is starting again", force_reschedule=True)
        )
    return effects


def _canaries(job: Job) -> int:
    return sum(int((g.get("Update") or {}).get("Canary") or 0) for g in job.get("TaskGroups") or [])


def _registered(change: Change, applier: Applier) -> Outcome:
    """Register the job (EnforceIndex: `change.job_index`), start the replicas of a
    stopped or parked job again, and clear the KV cache of a lifted parking."""
    assert change.job is not None
    stale: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    if change.restart and change.job_index:
        nomad = applier.nomad
        versions, allocations = nomad.versions(change.model), nomad.allocations(change.model)
        stale = failed_elsewhere(
            rollout.definition_of(change.job),
            versions,
            allocations,
            own_definitions(nomad, versions, allocations),
        )
        held = held_places(allocations)
    answers = applier.write_job(change.model, registration(change, stale, held), change.job_index)
    index = _job_index(answers[0])
    if change.unpark:
        applier.update(change.model, lambda s: set_parked(s, None, index))
    return Outcome(
        change,
        eval_id=answers[0].get("EvalID") or None,
        job_version=_version_after(applier.nomad, change.model),
    )


def _decide_again(change: Change, applier: Applier) -> Change:
    """`change`'s model decided anew from its rendered job, Nomad's job now and its
    state document's record of a rollback."""
    name, rendered, nomad = change.model, change.rendered, applier.nomad
    if rendered is None:
        raise TypeError(f"model {name}: a change without its rendered job")
    job = nomad.job(name)
    if job is not None and not is_managed(job):
        raise NomadRejected(
            f"model {name}: Nomad now has a job {name!r} that llmgw does "
            "not manage (no llmgw_model meta)"
        )
    registered = {name: job} if job is not None else {}
    parked = {name: p} if (p := parked_from_job(job)) is not None else {}
    [again] = decide(
        {name: rendered},
        registered,
        False,
        parked,
        _rolled_back({name: rendered}, registered, nomad, _recorded(name, applier.store)),
    )
    return again


def _recorded(name: str, store: StateStore | None) -> dict[str, UpdateFailed]:
    failed = store.read(name)[1].update_failed if store is not None else None
    return {name: failed} if failed is not None else {}


def _deregister(change: Change, applier: Applier, consul: ConsulClient) -> Outcome:
    outcome = Outcome(change)
    if change.purge:
        [answer] = applier.write_job(
            change.model, [Deregister(Reason.PRUNE, change.reason, purge=True)], change.job_index
        )
        outcome.eval_id = answer.get("EvalID") or None
    _forget(change.model, consul)
    return outcome


def _version_after(nomad: NomadClient, job_id: str) -> int | None:
    job = nomad.job(job_id)
    return None if job is None else job.get("Version")


def _forget(name: str, consul: ConsulClient) -> None:
    """Drop a pruned model's record, state (failures, parking) and last use, so a model
    defined again starts clean."""
    consul.delete_model_record(name)
    StateStore(consul).delete(name)
    consul.delete_key(kv_key(KVPrefix.USAGE, name))
