"""Read what `planner status`, the admin API and the metrics show: the agents' answers
for each model, judged by the pure `planner.model.status.observe`."""

from __future__ import annotations

from llmgw_contract import ModelRecord, StateDocument, service_name
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
