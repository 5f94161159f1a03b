"""Render a model definition into a Nomad job through Nomad's own HCL2 parser.

Called by `apply` for every model before anything is registered, so a
template or variable that Nomad refuses stops the whole run. The template is
`planner/jobspecs/model.nomad.hcl` (operators can run it by hand with `-var`); this
module only writes its variable file and stamps the planner's hashes into
the job meta:

  llmgw_model            the model name
  llmgw_definition_hash  source + profile (set through the template's variables)
  llmgw_record           the model's KV record (JSON), to restore llmgw/models/<name>
                         from Nomad if Consul's copy is lost
  llmgw_spec_hash        the whole rendered job, replicas included: what `apply`
                         compares to decide whether to register again
  llmgw_engine_kind      the engine kind when it is not llama.cpp (`planner.engines`)

The engine (`planner.spec.engine_definitions.EngineRef`) gives the command, the server
arguments and health path of its kind, and, for an engine defined in engines/*.yaml,
the version the job constrains on (`${meta.llmgw_engine_<name>} = <version>`: only
nodes that installed it).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Protocol

from llmgw_contract import JobMeta, ModelRecord, ScalingBounds, decode
from planner.engines import DEFAULT_KIND, engine
from planner.spec.definitions import ModelDefinition, resolve_source
from planner.spec.engine_definitions import EngineRef
from planner.spec.settings import Settings
from planner.vocab import Job

SPEC_HASH_KEY = JobMeta.SPEC_HASH


DOWNLOAD_ALLOWANCE_S = 1800
# Job meta key naming the engine kind (planner.engines) of a model not run by llama.cpp;
# the watcher reads its error lines with that engine.
ENGINE_KIND_META = "llmgw_engine_kind"
# Service meta keys for the defined replicas and scaling bounds (see the job template):
# out of the job's meta, so changing them is not a rollout.
REPLICAS_META = "llmgw_replicas"
SCALING_META = "llmgw_scaling"
COUNT_META = (REPLICAS_META, SCALING_META)
# The task's drain (the definition's shutdown_delay, and the template's kill_timeout):
# Nomad updates both in place, so the spec hash (job meta, compared by Nomad) leaves them
# out and `drain_of` compares them. Hashed as the template fixed them before the drain
# was a field (3 s, and Nomad's default kill_timeout 5 s), so a job registered then keeps
# its hash and takes the new drain in place, not in a rollout of every model.
NOMAD_KILL_TIMEOUT_NS = 5_000_000_000  # a task's kill_timeout when none is given
DRAIN_HASHED_AS = {"ShutdownDelay": 3_000_000_000, "KillTimeout": NOMAD_KILL_TIMEOUT_NS}


class ParsesJobs(Protocol):
    """What rendering asks of Nomad (`NomadClient.parse`, POST /v1/jobs/parse): HCL and
    its variables in, the job as JSON out (a protocol: definitions import no client)."""

    def parse(self, hcl: str, variables: str) -> Job: ...


def _hcl_value(value: Any) -> str:
    """A Python value as an HCL2 literal. JSON literals are valid HCL2 expressions;
    `${` and `%{` would start a template, so they are doubled to stay literal."""
    if isinstance(value, bool | int | float):
        return json.dumps(value)
    return json.dumps(value).replace("${", "$${").replace("%{", "%%{")


def variables(
    definition: ModelDefinition, settings: Settings, ref: EngineRef | None = None
) -> dict[str, Any]:
    """The template's variables for one model, run by engine `ref` (default: the
    profile's engine in LLMGW_ENGINES). Raises KeyError for an unknown engine."""
    profile = definition.profile
    source = resolve_source(definition.source)
    if ref is None:
        ref = EngineRef(profile.engine, DEFAULT_KIND, settings.engines[profile.engine])
    server = engine(ref.kind)
    return {
        "model": definition.name,
        "definition_hash": definition.definition_hash,
        "engine_command": ref.command,
        # What differs per engine (planner.engines): its arguments and readiness path.
        "engine_args": server.server_args(
            definition.name, profile.context, profile.gpus, profile.args
        ),
        "health_path": server.health_path,
        # Run only where the node's metadata records this version (an engine defined in
        # engines/*.yaml); none for an LLMGW_ENGINES engine.
        "engine_meta_key": ref.meta_key,
        "engine_version": ref.version or "",
        "driver": settings.task_driver,
        "user": settings.task_user,
        "source_path": source.local_path or "",
        # Every shard of a split source under its own name (planner/spec/sources.py).
        "artifacts": [
            {"url": shard.url, "sha256": shard.sha256 or "", "file": shard.file}
            for shard in definition.shards
            if shard.url
        ],
        "context": profile.context,
        "gpus": profile.gpus,
        # Nomad compares device memory with units: "${device.attr.memory} >= 24 GiB".
        "gpu_memory": f"{profile.gpu_memory // 2**20} MiB" if profile.gpu_memory else "",
        "cpu": profile.cpu,
        "memory_mb": max(1, profile.memory // 2**20),
        "args": list(profile.args),
        # An on-demand model is registered idle; activation scales it up.
        "replicas": 0 if definition.on_demand else definition.replicas,
        "on_demand": definition.on_demand is not None,
        "defined_replicas": definition.replicas,
        "scaling": definition.record().scaling.model_dump_json() if definition.scaling else "",
        "load_grace": f"{profile.load_timeout}s",
        # One canary per replica: the whole new version proves itself beside the old.
        "canaries": 0 if definition.on_demand else definition.replicas,
        # A new replica's deadline covers a download (not in load_timeout, which runs
        # from the task's start) of up to 30 min, then its load.
        "healthy_deadline": f"{profile.load_timeout + DOWNLOAD_ALLOWANCE_S}s",
        "shutdown_delay": f"{definition.shutdown_delay}s",
        "restart_delay": f"{definition.restart_delay}s",
        "datacenters": list(settings.datacenters),
    }


def variable_file(values: dict[str, Any]) -> str:
    return "".join(f"{name} = {_hcl_value(value)}\n" for name, value in values.items())


def spec_hash(job: Job) -> str:
    """16 hex chars of sha256 over the rendered job, without what the replica count sets
    (the groups' Count, their canaries, the services' llmgw_replicas and llmgw_scaling:
    `replicas_of` and `scaling_of` compare those), the tasks' drain (`DRAIN_HASHED_AS`;
    `drain_of` compares it) or the hash's own meta key. It lives in the job's meta,
    which Nomad compares: a hash that changed with the count or the drain would replace
    every allocation."""
    meta = {k: v for k, v in (job.get("Meta") or {}).items() if k != SPEC_HASH_KEY}
    groups = [_without_count(tg) for tg in job.get("TaskGroups") or []]
    canonical = json.dumps(
        {**job, "Meta": meta, "TaskGroups": groups}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _without_count(group: dict[str, Any]) -> dict[str, Any]:
    update = {
        k: v for k, v in (group.get("Update") or {}).items() if k not in ("Canary", "AutoPromote")
    }
    tasks = [
        {
            **task,
            **DRAIN_HASHED_AS,
            "Services": [
                {
                    **service,
                    "Meta": {
                        k: v for k, v in (service.get("Meta") or {}).items() if k not in COUNT_META
                    },
                }
                for service in task.get("Services") or []
            ],
        }
        for task in group.get("Tasks") or []
    ]
    return {**{k: v for k, v in group.items() if k != "Count"}, "Update": update, "Tasks": tasks}


def drain_of(job: Job) -> dict[str, int]:
    """The drain a job was rendered with: {"ShutdownDelay": ns, "KillTimeout": ns} of its
    task (a model's job has one), Nomad's defaults (0 and 5 s) where unset."""
    tasks = [task for group in job.get("TaskGroups") or [] for task in group.get("Tasks") or []]
    task = tasks[0] if tasks else {}
    return {
        "ShutdownDelay": int(task.get("ShutdownDelay") or 0),
        "KillTimeout": int(task.get("KillTimeout") or NOMAD_KILL_TIMEOUT_NS),
    }


def restart_delay_of(job: Job) -> int:
    """The pause (ns) of the job's restart policy between a failed start and the next
    (the definition's restart_delay), from its group (a model's job has one); 0 unset."""
    groups = job.get("TaskGroups") or []
    policy = (groups[0].get("RestartPolicy") or {}) if groups else {}
    return int(policy.get("Delay") or 0)


def replicas_of(job: Job) -> int:
    """The model's replicas as defined when `job` was rendered: its service meta (jobs
    rendered before it was kept there: the record in the job's meta)."""
    for group in job.get("TaskGroups") or []:
        for task in group.get("Tasks") or []:
            for service in task.get("Services") or []:
                value = (service.get("Meta") or {}).get(REPLICAS_META)
                if value is not None:
                    return int(value)
    old = json.loads((job.get("Meta") or {}).get(JobMeta.RECORD) or "{}")
    return int(old.get("replicas", 0))


def scaling_of(job: Job) -> ScalingBounds | None:
    """The model's scaling bounds as defined when `job` was rendered (its service meta);
    None for a fixed count. Raises ValueError when the meta cannot be read."""
    for group in job.get("TaskGroups") or []:
        for task in group.get("Tasks") or []:
            for service in task.get("Services") or []:
                value = (service.get("Meta") or {}).get(SCALING_META)
                if value:
                    return decode(ScalingBounds, value)
    return None


def record_of(job: Job) -> ModelRecord:
    """The model record a job carries (its meta, replicas from `replicas_of`, scaling from
    `scaling_of`). Raises ValueError when the meta cannot be read."""
    data = json.loads((job.get("Meta") or {})[JobMeta.RECORD])
    return ModelRecord.model_validate(
        {**data, "replicas": replicas_of(job), "scaling": scaling_of(job)}
    )


def render(
    definition: ModelDefinition,
    settings: Settings,
    nomad: ParsesJobs,
    template: str | None = None,
    ref: EngineRef | None = None,
) -> Job:
    """The Nomad job for one model run by engine `ref` (see `variables`), parsed and
    canonicalized by Nomad, hashes in its meta.

    Raises NomadRejected when Nomad refuses the template or its variables,
    NomadUnavailable when it cannot be reached.
    """
    hcl = template if template is not None else settings.jobspec.read_text()
    job = nomad.parse(hcl, variable_file(variables(definition, settings, ref)))
    record = definition.record().model_dump_json(exclude={"replicas", "scaling"})
    job["Meta"] = {**(job.get("Meta") or {}), JobMeta.RECORD: record}
    if ref is not None and ref.kind != DEFAULT_KIND:
        # Only another kind is named: the jobs of llama.cpp models stay as they were.
        job["Meta"][ENGINE_KIND_META] = ref.kind
    job["Meta"][SPEC_HASH_KEY] = spec_hash(job)
    return job
