"""Read what `planner status`, the admin API and the metrics show: the agents' answers
for each model, judged by the pure `planner.model.status.observe`."""

from __future__ import annotations

from llmgw_contract import JobMeta, ModelRecord, StateDocument, service_name
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient
from planner.agents.state import StateStore
from planner.model.status import ModelStatus, Observed, observe


def observed(nomad: NomadClient, consul: ConsulClient, name: str) -> Observed:
    job = nomad.job(name)
    allocations = nomad.allocations(name) if job is not None else []
    return Observed(job, allocations, consul.service_health(service_name(name)))


def model_status(
    nomad: NomadClient,
    consul: ConsulClient,
    name: str,
    record: ModelRecord,
    state: StateDocument | None = None,
) -> ModelStatus:
    usage = consul.usage_records().get(name) if record.idle_after is not None else None
    state = state if state is not None else StateStore(consul).load(name)
    return observe(name, record, observed(nomad, consul, name), state, usage)


def gather(nomad: NomadClient, consul: ConsulClient) -> list[ModelStatus]:
    """Status of every applied model (the KV records), sorted by name."""
    states = StateStore(consul).load_all()
    usage = consul.usage_records()
    return [
        observe(name, record, observed(nomad, consul, name), states.get(name), usage.get(name))
        for name, record in sorted(consul.model_records().items())
    ]


def unrecorded_models(nomad: NomadClient, consul: ConsulClient) -> list[str]:
    """The model jobs Nomad has (llmgw meta) whose Consul KV record is missing, sorted:
    Consul lost them (a rebuilt or restarted Consul, a wiped `llmgw/`) and the leader has
    not restored them yet (`planner.daemon.repair`), or no planner leads."""
    records = set(consul.model_records())
    return sorted(
        name
        for job in nomad.jobs()
        if JobMeta.MODEL in (job.get("Meta") or {})
        and (name := job.get("ID", ""))
        and name not in records
    )
