"""The planner's half of the planner-router contract: everything the planner's own code
produces, the router reads and acts on (tests/unit/contract/test_router_reads.py proves the
router handles every value the contract allows)."""

from __future__ import annotations

import base64
from datetime import UTC, datetime

from llmgw_contract import (
    ActivationAnswer,
    ActivationStatus,
    KVPrefix,
    StateDocument,
    Unplaceable,
    decode,
    encode,
    kv_key,
    routing_of,
)
from planner.daemon.activation import answers_for_every_status
from planner.model.failures import AllocInfo, Rules, decide_parking, for_definition, judge, track
from planner.model.failures import start_failures as failures_of
from planner.model.parking import set_parked
from planner.model.unplaceable import with_unplaceable
from planner.spec.definitions import ModelDefinition
from router.catalog import parse_models, parse_states
from tests.support.nomad_mock import alloc, run
from tests.unit.contract.test_router_reads import ACTIVATION_OUTCOMES

T0 = datetime(2026, 11, 30, tzinfo=UTC)


def test_the_planner_gives_every_activation_status_and_only_those() -> None:
    produced = answers_for_every_status()
    assert {a.status for a in produced} == set(ActivationStatus)
    for answer in produced:
        read = decode(ActivationAnswer, encode(answer))
        assert read == answer and read.status in ACTIVATION_OUTCOMES


def kv_entry(state: StateDocument) -> dict:
    """The routing document the planner writes beside `state`, as Consul lists it."""
    return {
        "Key": kv_key(KVPrefix.ROUTING, state.name),
        "Value": base64.b64encode(encode(routing_of(state)).encode()).decode(),
    }


def planner_states() -> list[StateDocument]:
    """State documents as the planner's functions write them."""
    info = AllocInfo("a1", "m.server[0]", "node-a", "d1", "failed", "run")
    state = track(for_definition(StateDocument(name="m"), "d1"), info)
    for failure in failures_of(alloc("a1", *[e for i in range(5) for e in run(i, i + 0.5)])):
        state = judge(state, failure, "0.00.000.001 E unknown model architecture: 'kev'", Rules())
    parked = decide_parking(state, {"a1": info}, frozenset(), T0, Rules())
    room = Unplaceable(reason="waiting for room", since=T0.isoformat(), provisional=True)
    short = Unplaceable(reason="memory exhausted on 1 of 1 node", since=T0.isoformat())
    part = Unplaceable(
        reason="1 of 2 replicas placed; memory exhausted on 1 of 1 node",
        since=T0.isoformat(),
        placed=1,
        desired=2,
    )
    return [
        parked,
        set_parked(parked, parked.parked, 42),
        with_unplaceable(state, room),
        with_unplaceable(state, short),
        with_unplaceable(state, part),
    ]


def test_the_router_reads_every_state_document_the_planner_writes() -> None:
    for state in planner_states():
        [(name, read)] = parse_states([kv_entry(state)]).items()
        assert name == "m"
        assert read.parked == state.parked
        assert read.unplaceable == state.unplaceable


def test_the_router_reads_the_record_of_a_split_source() -> None:
    """A split source's sha256 is a list, one per shard (planner/spec/sources.py)."""
    definition = ModelDefinition.model_validate(
        {
            "name": "m",
            "source": "https://h/m-00001-of-00002.gguf",
            "sha256": ["a" * 64, "b" * 64],
            "profile": {},
        }
    )
    record = definition.record()
    entry = {
        "Key": kv_key(KVPrefix.MODELS, "m"),
        "Value": base64.b64encode(encode(record).encode()).decode(),
    }
    assert parse_models([entry]) == {"m": record}
    assert record.sha256 == ["a" * 64, "b" * 64]
