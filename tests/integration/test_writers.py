"""The commands' Nomad writes through the one applier, on real agents (issue 19): apply
is whole per model (a refused registration puts the record back), apply re-reads a job
that changed under it (a park is never undone), and retry never re-registers a parked
definition over one an apply just registered.

The interleavings are made, not waited for: the second writer runs between the first
one's reads and its write (in process, through the same functions the CLI calls), so
each case happens every run. Models have `replicas: 0`: nothing starts."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from devcluster.cluster import Cluster
from llmgw_contract import JobMeta, ModelRecord, Parked
from planner.agents.consul import ConsulClient
from planner.agents.nomad import NomadClient
from planner.cli import apply
from planner.daemon.applier import Applier
from planner.daemon.observe import Observer
from planner.daemon.retry import retry as retry_model
from planner.errors import NomadRejected, PlannerError
from planner.model.effects import Park, Reason
from planner.model.parking import parked_from_job
from planner.spec.settings import Settings
from tests.conftest import forget_models
from tests.integration.test_parking import write_model
from tests.support.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.integration

MODELS = ("w-refused", "w-foreign", "w-parked", "w-retry")
PARKED = Parked(
    reason="5 consecutive start failures", last_error="test", since="2026-12-02T00:00:00+00:00"
)


@pytest.fixture(scope="module", autouse=True)
def _forget_this_modules_models(cluster: Cluster) -> Iterator[None]:
    forget_models(cluster, *MODELS)
    yield
    forget_models(cluster, *MODELS)


@pytest.fixture(scope="module")
def agents(planner_env: dict[str, str]) -> tuple[Settings, NomadClient, ConsulClient]:
    settings = Settings.from_env(planner_env)
    return (
        settings,
        NomadClient(settings.nomad_addr, settings.nomad_token),
        ConsulClient(settings.consul_url, settings.consul_token),
    )


Agents = tuple[Settings, NomadClient, ConsulClient]


def prepared(agents: Agents, folder: Path) -> tuple[dict, list[apply.Change]]:
    settings, nomad, consul = agents
    definitions, changes, _ = apply.prepare([folder], settings, nomad, consul, prune=False)
    return definitions, changes


def applied(agents: Agents, folder: Path) -> list[apply.Outcome]:
    _, nomad, consul = agents
    definitions, changes = prepared(agents, folder)
    return apply.execute(definitions, changes, nomad, consul, dry_run=False)


def only(changes: list[apply.Change], name: str) -> list[apply.Change]:
    return [c for c in changes if c.model == name]


def record(consul: ConsulClient, name: str) -> ModelRecord | None:
    return consul.model_records().get(name)


def test_a_registration_nomad_refuses_puts_the_record_back(
    agents: Agents, tiny_model: Path, tmp_path: Path
) -> None:
    """Issue 19, item 7: the record and the registration happen together, or the record
    is rolled back (a changed one to the old one; a new model's removed, with its state
    document)."""
    _, nomad, consul = agents
    folder = write_model(tmp_path / "m", "w-refused", tiny_model, replicas=0)
    applied(agents, folder)
    old = record(consul, "w-refused")
    assert old is not None
    other = write_tiny_gguf(tmp_path / "other.gguf")
    write_model(folder, "w-refused", other, replicas=0)  # a new source: a new record
    definitions, changes = prepared(agents, folder)
    [change] = only(changes, "w-refused")
    assert change.action is apply.Action.UPDATE
    assert definitions["w-refused"].record() != old
    # A job Nomad's parse accepts and its register refuses (a negative count; Nomad 1.6
    # answers that validation with a 500, so it reads as NomadUnavailable).
    groups = [{**tg, "Count": -1} for tg in change.job["TaskGroups"]]
    refused = replace(change, job={**change.job, "TaskGroups": groups})
    with pytest.raises(PlannerError, match="count can't be negative"):
        apply.execute(definitions, [refused], nomad, consul, dry_run=False)
    assert record(consul, "w-refused") == old
    # The job registered is still the old definition's: record and job agree.
    assert nomad.job("w-refused")["Meta"][JobMeta.DEFINITION_HASH] == old.definition_hash


def test_a_new_model_refused_leaves_no_record_and_no_state(
    agents: Agents, tiny_model: Path, tmp_path: Path
) -> None:
    """A job of the same name, not llmgw's, appears between apply's reads and its
    registration: EnforceIndex 0 refuses it, the model is read again and refused, and
    the new model's record and state are removed."""
    _, nomad, consul = agents
    folder = write_model(tmp_path / "m", "w-foreign", tiny_model, replicas=0)
    definitions, changes = prepared(agents, folder)
    [change] = only(changes, "w-foreign")
    assert change.action is apply.Action.CREATE and change.job_index == 0
    foreign = {**change.job, "Meta": {}}  # someone else's job of that name
    nomad.register(foreign)
    with pytest.raises(NomadRejected, match="llmgw does not manage"):
        apply.execute(definitions, [change], nomad, consul, dry_run=False)
    assert record(consul, "w-foreign") is None
    assert consul.get_indexed("llmgw/state/w-foreign") == (0, None)
    assert nomad.job("w-foreign")["Meta"] in ({}, None)  # theirs, untouched


def test_apply_never_unparks_a_job_parked_after_it_read_it(
    agents: Agents, tiny_model: Path, tmp_path: Path
) -> None:
    """Issue 19, "Writers race": apply read the job, the leader parked it, apply
    registers. EnforceIndex refuses the stale registration; apply reads the model again,
    finds it parked under the same definition, leaves it parked and says so."""
    _, nomad, consul = agents
    folder = write_model(tmp_path / "m", "w-parked", tiny_model, replicas=0)
    applied(agents, folder)
    write_model(folder, "w-parked", tiny_model, replicas=1)  # the same definition
    definitions, changes = prepared(agents, folder)
    [change] = only(changes, "w-parked")
    assert change.action is apply.Action.UPDATE
    job = nomad.job("w-parked")
    assert change.job_index == job["JobModifyIndex"]
    # The leader parks it meanwhile (its Park effect, through the applier).
    Applier(nomad).write_job(
        "w-parked", [Park(Reason.START_FAILURES, "parked", PARKED)], job["JobModifyIndex"], job
    )
    parked_index = nomad.job("w-parked")["JobModifyIndex"]

    [outcome] = apply.execute(definitions, [change], nomad, consul, dry_run=False)

    assert outcome.change.action is apply.Action.PARKED
    assert apply.CHANGED_MEANWHILE in outcome.change.reason
    after = nomad.job("w-parked")
    assert after["Stop"] and parked_from_job(after) is not None
    assert after["JobModifyIndex"] == parked_index  # nothing registered over the park
    assert record(consul, "w-parked") == definitions["w-parked"].record()


def park_now(nomad: NomadClient, name: str) -> int:
    """Park `name` as the leader's pass would (its Park effect through the applier, at
    the job's index); the job's index after."""
    job = nomad.job(name)
    Applier(nomad).write_job(
        name, [Park(Reason.START_FAILURES, "parked", PARKED)], job["JobModifyIndex"], job
    )
    return nomad.job(name)["JobModifyIndex"]


def test_retry_never_registers_a_parked_definition_over_one_apply_just_registered(
    agents: Agents, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 19, "Writers race": retry read the parked job (definition A); an apply of
    definition B (which lifts the parking) registers before retry writes. Retry's Unpark
    of A is refused by its index, it reads again, and finds nothing to retry: B stays."""
    _, nomad, consul = agents
    folder = write_model(tmp_path / "m", "w-retry", tiny_model, replicas=0)
    applied(agents, folder)
    park_now(nomad, "w-retry")
    write_model(folder, "w-retry", write_tiny_gguf(tmp_path / "b.gguf"), replicas=0)
    observe, observed = Observer.observe, []

    registered_b: list[int] = []

    def apply_between(self: Observer, name: str, *args: object) -> object:
        seen = observe(self, name, *args)  # type: ignore[arg-type]
        observed.append(seen[1].job)
        if len(observed) == 1:
            [outcome] = only_outcomes(applied(agents, folder), "w-retry")
            assert outcome.change.unpark  # B lifts the parking
            registered_b.append(nomad.job("w-retry")["JobModifyIndex"])
        return seen

    monkeypatch.setattr(Observer, "observe", apply_between)
    state, done = retry("w-retry", nomad, consul)

    assert parked_from_job(observed[0]) is not None  # retry decided first on parked A
    # Refused once by the job's index, then decided on B. How many times it observed B
    # is not this test's business: the session's leading daemon (a `planner_daemon`
    # started by an earlier module) writes the state document after B's registration
    # too, and a retry that read the document before that write is refused once more
    # (found by CI: 3 observations).
    assert len(observed) >= 2
    assert all(parked_from_job(job) is None for job in observed[1:])  # each one B
    assert done == "not parked, unplaceable or stopped; nothing to retry"
    job = nomad.job("w-retry")
    assert job["Meta"][JobMeta.DEFINITION_HASH] == record(consul, "w-retry").definition_hash
    assert not job["Stop"] and parked_from_job(job) is None
    assert job["JobModifyIndex"] == registered_b[0]  # nothing registered over B
    assert state.parked is None


def test_apply_after_a_retry_it_did_not_see_registers_its_definition(
    agents: Agents, tiny_model: Path, tmp_path: Path
) -> None:
    """The other order: apply read the parked job, a retry lifted the parking before
    apply wrote. Apply's registration is refused by its index, it reads again (a job no
    longer parked, the definition still changed) and registers its definition."""
    _, nomad, consul = agents
    folder = write_model(tmp_path / "m", "w-retry", tiny_model, replicas=0)
    applied(agents, folder)
    park_now(nomad, "w-retry")
    write_model(folder, "w-retry", write_tiny_gguf(tmp_path / "c.gguf"), replicas=0)
    definitions, changes = prepared(agents, folder)
    [change] = only(changes, "w-retry")
    assert change.unpark

    _, done = retry("w-retry", nomad, consul)
    assert done == "parking lifted; the job is starting again"
    [outcome] = apply.execute(definitions, [change], nomad, consul, dry_run=False)

    assert outcome.change.action is apply.Action.UPDATE
    assert apply.CHANGED_MEANWHILE in outcome.change.reason
    job = nomad.job("w-retry")
    assert job["Meta"][JobMeta.DEFINITION_HASH] == definitions["w-retry"].record().definition_hash
    assert not job["Stop"] and parked_from_job(job) is None


def retry(name: str, nomad: NomadClient, consul: ConsulClient) -> tuple:
    """`planner retry`'s pass, as the CLI runs it."""
    return retry_model(nomad, consul, name)


def only_outcomes(outcomes: list[apply.Outcome], name: str) -> list[apply.Outcome]:
    return [o for o in outcomes if o.change.model == name]
