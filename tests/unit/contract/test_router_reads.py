"""The router's half of the planner-router contract (llmgw_contract).

The planner writes what the router reads; this proves the router accepts
every value the contract lets the planner write, and acts on each:

- every :class:`ActivationStatus`, as an :class:`ActivationAnswer` encoded with
  :func:`llmgw_contract.encode` and served over HTTP by a stand-in for the
  planner's activator API, is parsed by the router's planner client and leads
  to a defined outcome: a refusal code at once, or a wait for an endpoint;
- :class:`StateDocument` values (parked; unplaceable, provisional or not),
  encoded and stored as Consul returns KV entries, are parsed by the router's
  catalog and change what its table and refusals answer;
- a :class:`ModelRecord` round-trips through the router's parsing.

The planner's half (it only writes what the contract allows) is tested on the
planner side. The stand-in planner is an aiohttp server on 127.0.0.1 that
answers with the encoded document and nothing else.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
from collections.abc import AsyncIterator

import pytest
from aiohttp import web

from llmgw_contract import (
    ActivationAnswer,
    ActivationStatus,
    KVPrefix,
    ModelRecord,
    Parked,
    ReplicaRecord,
    StateDocument,
    Unplaceable,
    decode,
    encode,
    kv_key,
    routing_of,
)
from router import errors
from router.catalog import ServiceAddress, parse_models, parse_states
from router.endpoints import EndpointTable
from router.metrics import RouterMetrics
from router.refusals import gate, when_no_endpoint
from router.settings import RouterSettings
from tests.support.router_harness import (
    LocalServer,
    asgi_post,
    count_activation_steps,
    in_process_router,
    run,
    until,
)

# What each answer leads to: a refusal code at once, or None for "wait for a
# passing endpoint, then serve".
ACTIVATION_OUTCOMES: dict[ActivationStatus, str | None] = {
    ActivationStatus.SERVING: None,
    ActivationStatus.LOADING: None,
    ActivationStatus.PARKED: "model_parked",
    ActivationStatus.UNPLACEABLE: "model_unplaceable",
    ActivationStatus.STOPPED: "model_stopped",
}
REASON = "the planner's reason, word for word"
LAST_ERROR = "Terminated: Exit Code: 1\nllama_model_load: error loading model: unknown model"


def answers(status: ActivationStatus) -> list[ActivationAnswer]:
    """The smallest answer the contract allows, and one with every field set."""
    return [
        ActivationAnswer(name="m", status=status),
        ActivationAnswer(
            name="m",
            status=status,
            reason=REASON,
            last_error=LAST_ERROR,
            since="2026-11-29T21:00:00+00:00",
            eval_id="0b7c5ef2",
        ),
    ]


class Planner(LocalServer):
    """Answers every activate call with ``answer`` encoded by the contract, and
    doubles as the model's replica once a test makes it pass."""

    def __init__(self, answer: ActivationAnswer) -> None:
        self.body = encode(answer)
        super().__init__(
            web.post("/v1/models/{name}/activate", self._activate),
            web.post("/v1/completions", self._complete),
        )

    async def _activate(self, request: web.Request) -> web.Response:
        return web.Response(text=self.body, content_type="application/json")

    async def _complete(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "text_completion"})


@contextlib.asynccontextmanager
async def activating_router(answer: ActivationAnswer, window_s: float = 5) -> AsyncIterator:
    planner = Planner(answer)
    await planner.start()
    settings = RouterSettings(
        planner_url=f"http://127.0.0.1:{planner.port}",
        activation_window_s=window_s,
        replica_concurrency=4,
    )
    try:
        async with in_process_router(settings) as app:
            yield app, planner
    finally:
        await planner.stop()


async def post(app) -> tuple[int | None, dict[str, str], dict]:
    return await asgi_post(app, {"model": "m"})


def test_every_activation_status_has_an_outcome() -> None:
    assert set(ACTIVATION_OUTCOMES) == set(ActivationStatus)


@pytest.mark.parametrize("status", list(ActivationStatus))
def test_every_activation_answer_is_understood_and_acted_on(
    status: ActivationStatus, monkeypatch: pytest.MonkeyPatch
) -> None:
    expected = ACTIVATION_OUTCOMES[status]
    _, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        for answer in answers(status):
            waits.clear()
            async with activating_router(answer, window_s=30) as (app, planner):
                # The router's client parses the planner's bytes into the same document.
                assert await app.state.activator.api.activate("m") == answer
                request = asyncio.ensure_future(post(app))
                if expected is None:  # held for an endpoint, then served
                    await until(lambda: waits["m"] == 1, what="the request waits for an endpoint")
                    assert not request.done()
                    app.state.table.set_endpoints("m", [ServiceAddress("127.0.0.1", planner.port)])
                    assert (await asyncio.wait_for(request, 10))[0] == 200
                else:  # refused at once (never waiting), in the planner's words when it gave any
                    code, headers, body = await asyncio.wait_for(request, 10)
                    assert waits["m"] == 0
                    assert code == 503 and body["error"]["code"] == expected
                    assert "retry-after" not in headers  # none of these ends by waiting
                    if answer.reason:
                        assert REASON in body["error"]["message"]
                metrics = app.state.metrics.registry
                outcome = {"model": "m", "outcome": str(status)}
                assert metrics.get_sample_value("llmgw_router_activations_total", outcome) == 1
                error = {"model": "m", "outcome": "error"}
                assert metrics.get_sample_value("llmgw_router_activations_total", error) == 0

    run(scenario())


# --- the documents in Consul KV -----------------------------------------------------


def kv_entry(prefix: KVPrefix, name: str, document: StateDocument | ModelRecord) -> dict:
    """One key as Consul's recursive KV read returns it; for a state document, the
    routing document the planner writes beside it (what the router reads)."""
    if isinstance(document, StateDocument):
        prefix, document = KVPrefix.ROUTING, routing_of(document)
    value = base64.b64encode(encode(document).encode()).decode()
    return {"Key": kv_key(prefix, name), "Value": value, "ModifyIndex": 7}


def full_state(name: str, **members: object) -> StateDocument:
    """A state document with every field the planner may fill."""
    replica = ReplicaRecord(
        alloc_id="5a0f2c4e-0000-4000-8000-000000000001",
        name=f"{name}.server[0]",
        node="node-1",
        definition_hash="h",
        consecutive_failures=2,
        last_error=LAST_ERROR,
        last_error_at="2026-11-29T21:00:00+00:00",
        healthy_entries=(1, 2),
        stable_entry=1,
    )
    return StateDocument(
        name=name,
        definition_hash="h",
        consecutive_failures=5,
        start_failures_total=9,
        last_error=LAST_ERROR,
        last_error_at="2026-11-29T21:00:00+00:00",
        counted=("a/server/1",),
        replicas=(replica,),
        **members,
    )


PARKED = Parked(
    reason="5 consecutive start failures",
    last_error=LAST_ERROR,
    since="2026-11-29T21:00:05+00:00",
    definition_hash="h",
)
NO_ROOM = Unplaceable(
    reason="memory exhausted on 1 of 1 nodes", since="s", eval_id="e", placed=0, desired=1
)
ROOM_BEING_MADE = NO_ROOM.model_copy(update={"provisional": True})
# Nomad placed 1 of 2: the one placed starts and will serve (never a refusal).
PLACED_IN_PART = NO_ROOM.model_copy(
    update={"reason": f"1 of 2 replicas placed; {NO_ROOM.reason}", "placed": 1, "desired": 2}
)


def table_from_kv(*documents: StateDocument) -> EndpointTable:
    table = EndpointTable(RouterMetrics())
    table.set_models(
        {d.name: ModelRecord(name=d.name, definition_hash="h", replicas=1) for d in documents}
    )
    table.set_services(())
    table.set_states(parse_states([kv_entry(KVPrefix.STATE, d.name, d) for d in documents]))
    return table


def test_state_documents_reach_the_table_as_written() -> None:
    docs = (
        full_state("p", parked=PARKED),
        full_state("u", unplaceable=NO_ROOM),
        full_state("r", unplaceable=ROOM_BEING_MADE),
        full_state("fine"),
    )
    table = table_from_kv(*docs)
    assert table.get("p").parked == PARKED
    assert table.get("u").unplaceable == NO_ROOM
    assert table.get("r").unplaceable == ROOM_BEING_MADE
    fine = table.get("fine")
    assert fine.parked is None and fine.unplaceable is None


def test_a_document_nested_too_deep_is_skipped_and_hides_no_other_key() -> None:
    """10 KB of `[` is RecursionError in json, not ValueError: it was let out of
    decode, and the router's watch stopped reading every other key (review)."""
    nested = base64.b64encode(b"[" * 5000 + b"]" * 5000).decode()
    bad = {"Key": kv_key(KVPrefix.ROUTING, "x"), "Value": nested, "ModifyIndex": 8}
    entries = [kv_entry(KVPrefix.STATE, "p", full_state("p", parked=PARKED)), bad]
    with pytest.raises(ValueError, match="not a StateDocument"):
        decode(StateDocument, base64.b64decode(nested))
    assert set(parse_states(entries)) == {"p"}
    bad_record = {**bad, "Key": kv_key(KVPrefix.MODELS, "x")}
    assert parse_models([bad_record]) == {}


def test_parked_is_refused_even_while_an_endpoint_passes() -> None:
    table = table_from_kv(full_state("p", parked=PARKED))
    table.set_endpoints("p", [ServiceAddress("127.0.0.1", 9)])
    refusal = gate(table.get("p"))
    assert isinstance(refusal, errors.ModelParked)
    assert PARKED.reason in refusal.message and "unknown model" in refusal.message


def test_unplaceable_is_refused_but_room_being_made_and_placed_in_part_are_not() -> None:
    table = table_from_kv(
        full_state("u", unplaceable=NO_ROOM),
        full_state("r", unplaceable=ROOM_BEING_MADE),
        full_state("p", unplaceable=PLACED_IN_PART),
    )
    assert isinstance(when_no_endpoint(table.get("u")), errors.ModelUnplaceable)
    for name in ("r", "p"):
        loading = when_no_endpoint(table.get(name))
        assert isinstance(loading, errors.ModelLoading) and loading.retry_after_s is not None


@pytest.mark.parametrize(
    ("unplaceable", "outcome"),
    [(NO_ROOM, "model_unplaceable"), (ROOM_BEING_MADE, None), (PLACED_IN_PART, None)],
)
def test_an_activation_wait_acts_on_the_state_written_meanwhile(
    unplaceable: Unplaceable, outcome: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, waits = count_activation_steps(monkeypatch)

    async def scenario() -> None:
        loading = ActivationAnswer(name="m", status=ActivationStatus.LOADING)
        async with activating_router(loading, window_s=30) as (app, planner):
            request = asyncio.ensure_future(post(app))
            await until(lambda: waits["m"] == 1, what="the request waits for an endpoint")
            document = full_state("m", unplaceable=unplaceable)
            app.state.table.set_states(parse_states([kv_entry(KVPrefix.STATE, "m", document)]))
            # It acts on the change itself: refused (no second wait), or waits on.
            await until(lambda: request.done() or waits["m"] == 2, what="acted on the change")
            if outcome is not None:
                assert request.done() and waits["m"] == 1
                assert (await request)[2]["error"]["code"] == outcome
                return
            assert not request.done()  # room being made, or placed in part: it waits on
            app.state.table.set_endpoints("m", [ServiceAddress("127.0.0.1", planner.port)])
            assert (await asyncio.wait_for(request, 10))[0] == 200

    run(scenario())


def test_a_model_record_round_trips() -> None:
    record = ModelRecord(
        name="gemma",
        definition_hash="h",
        replicas=2,
        source="file:///m.gguf",
        sha256="0" * 64,
        profile={"gpus": 1, "memory": "2GiB"},
        on_demand={"idle_after": 900},
    )
    assert parse_models([kv_entry(KVPrefix.MODELS, "gemma", record)]) == {"gemma": record}
