"""Parked / unplaceable state, refusal wording and the decisions (router.catalog's
parse_states, router.refusals)."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from starlette.testclient import TestClient

from llmgw_contract import ModelRecord, Parked, StateDocument, Unplaceable, encode, routing_of
from router import errors
from router.app import create_app
from router.catalog import ServiceAddress, parse_states
from router.endpoints import EndpointTable
from router.metrics import RouterMetrics
from router.refusals import (
    MESSAGE_LIMIT,
    gate,
    parked_message,
    refuse_at_once,
    stopped_message,
    summarize_error,
    unplaceable_message,
    when_no_endpoint,
)
from router.settings import RouterSettings


def record(name: str, replicas: int = 1) -> ModelRecord:
    return ModelRecord(name=name, definition_hash="h", replicas=replicas)


def state(name: str = "m", parked: Parked | None = None, unplaceable: Unplaceable | None = None):
    return StateDocument(name=name, parked=parked, unplaceable=unplaceable)


# A real llama-server's stderr for a GGUF with general.architecture = "kev",
# after the Nomad task event the planner puts first.
KEV_ERROR = """Terminated: Exit Code: 1
0.00.002.058 I srv  llama_server: initializing ...
0.00.007.933 I srv    load_model: loading model '/tmp/kev.gguf'
0.00.010.861 E llama_model_load: error loading model: unknown model architecture: 'kev'
0.00.010.889 E llama_model_load_from_file_impl: failed to load model
0.00.011.538 E common_fit_params: encountered an error while trying to fit params to free \
device memory: failed to load model
0.00.012.296 E llama_model_load: error loading model: unknown model architecture: 'kev'
0.00.012.309 E llama_model_load_from_file_impl: failed to load model
0.00.012.311 E cmn  common_init_: failed to load model '/tmp/kev.gguf'
0.00.012.314 E srv    load_model: failed to load model, '/tmp/kev.gguf'
0.00.012.319 I srv    operator(): operator(): cleaning up before exit...
0.00.013.184 E srv  llama_server: exiting due to model loading error"""
KEV_LINE = "llama_model_load: error loading model: unknown model architecture: 'kev'"
MISSING_GPU = 'no node has an nvidia/gpu device: 1 of 1 nodes filtered ("missing devices")'


def kv(key: str, value: object) -> dict:
    raw = value if isinstance(value, bytes) else json.dumps(value).encode()
    return {"Key": key, "Value": base64.b64encode(raw).decode()}


def routing(state: dict) -> dict:
    """The routing document the planner writes beside the state document ``state``."""
    return json.loads(encode(routing_of(StateDocument.model_validate(state))))


def state_doc(name: str, parked: bool = False, unplaceable: bool = False) -> dict:
    """The planner's JSON, with the keys the router ignores."""
    return {
        "name": name,
        "consecutive_failures": 5 if parked else 0,
        "last_error": KEV_ERROR if parked else None,
        "last_error_at": "2026-11-29T21:00:00+00:00",
        "counted": ["a/t/1"],
        "healthy_allocs": [],
        "healthy_at_ns": 0,
        "parked": {
            "reason": "5 consecutive start failures",
            "last_error": KEV_ERROR,
            "since": "2026-11-29T21:00:05+00:00",
            "definition_hash": "abc",
        }
        if parked
        else None,
        "unplaceable": {
            "reason": MISSING_GPU,
            "since": "2026-11-29T21:00:00+00:00",
            "eval_id": "e",
            "placed": 0,
            "desired": 1,
            "provisional": False,
        }
        if unplaceable
        else None,
        "added_later": {"x": 1},
    }


# --- parsing -------------------------------------------------------------------


def test_parse_states_keeps_parked_and_unplaceable_only() -> None:
    states = parse_states(
        [
            kv("llmgw/routing/p", routing(state_doc("p", parked=True))),
            kv("llmgw/routing/u", routing(state_doc("u", unplaceable=True))),
            kv("llmgw/routing/fine", routing(state_doc("fine"))),
            kv("llmgw/routing/broken", b"{nope"),
            kv("llmgw/routing/wrong", {"parked": "yes"}),
            kv("llmgw/routing/p/deeper", routing(state_doc("x", parked=True))),
        ]
    )
    assert sorted(states) == ["p", "u"]
    assert states["p"].parked == Parked(
        reason="5 consecutive start failures",
        last_error=KEV_ERROR,
        since="2026-11-29T21:00:05+00:00",
        definition_hash="abc",
    )
    assert states["u"].unplaceable == Unplaceable(
        reason=MISSING_GPU, since="2026-11-29T21:00:00+00:00", eval_id="e", desired=1
    )
    assert states["u"].parked is None
    assert parse_states(None) == {}


def test_parked_without_its_own_error_borrows_the_documents() -> None:
    doc = state_doc("p", parked=True)
    doc["parked"]["last_error"] = None
    (state,) = parse_states([kv("llmgw/routing/p", routing(doc))]).values()
    assert state.parked is not None and state.parked.last_error == KEV_ERROR


# --- wording -----------------------------------------------------------------


def test_summary_keeps_event_and_the_lines_that_name_the_error() -> None:
    summary = summarize_error(KEV_ERROR)
    assert summary.startswith("Terminated: Exit Code: 1 | " + KEV_LINE)
    assert summary.count("unknown model architecture") == 1  # repeated line shown once
    assert "0.00.0" not in summary  # llama.cpp's time/level prefix dropped
    assert "initializing" not in summary and "cleaning up" not in summary
    assert "\n" not in summary


def test_summary_falls_back_to_trouble_words_then_last_line() -> None:
    assert summarize_error("Driver Failure: boom\nok\nCUDA out of memory\nbye") == (
        "Driver Failure: boom | CUDA out of memory"
    )
    assert summarize_error("Terminated: Exit Code: 137\nstarting\nloading 40%") == (
        "Terminated: Exit Code: 137 | loading 40%"
    )
    assert summarize_error("") == "" and summarize_error("\n \n") == ""


def test_summary_is_bounded() -> None:
    noisy = "Terminated\n" + "\n".join(f"error {i}: " + "x" * 500 for i in range(50))
    summary = summarize_error(noisy, limit=600)
    assert len(summary) <= 600 and summary.startswith("Terminated | error 0: ")
    assert len(summarize_error("e" * 5000)) <= 600


def test_parked_message_says_why_and_what_lifts_it() -> None:
    message = parked_message(
        "kevin",
        Parked(
            reason="5 consecutive start failures",
            last_error=KEV_ERROR,
            since="2026-11-29T21:00:05+00:00",
        ),
    )
    assert "`kevin` is parked" in message
    assert "5 consecutive start failures" in message
    assert KEV_LINE in message
    assert "Terminated: Exit Code: 1" in message
    assert message.endswith(
        "change its source or profile, or run `planner retry kevin` (`planner apply` first "
        "if its Nomad job is gone)."
    )
    assert "retry shortly" not in message
    assert len(message) < MESSAGE_LIMIT


def test_messages_stay_under_the_limit_whatever_the_planner_wrote() -> None:
    huge = Parked(reason="r" * 5000, last_error="E" * 5000 + "\n" + "error " * 2000, since="s")
    message = parked_message("m", huge)
    assert len(message) <= MESSAGE_LIMIT
    assert message.endswith("`planner retry m` (`planner apply` first if its Nomad job is gone).")
    message = unplaceable_message("m", Unplaceable(reason="x" * 5000))
    assert len(message) <= MESSAGE_LIMIT and "fits on no node" in message
    assert len(stopped_message("m", "y" * 5000)) <= MESSAGE_LIMIT


def test_unplaceable_message_carries_nomads_reason() -> None:
    message = unplaceable_message(
        "big", Unplaceable(reason=MISSING_GPU, since="2026-11-29T21:00:00+00:00")
    )
    assert f"The model `big` fits on no node (since 2026-11-29T21:00:00+00:00): {MISSING_GPU}." in (
        message
    )


# --- decisions ----------------------------------------------------------------


def table_with(**states: StateDocument) -> EndpointTable:
    table = EndpointTable(RouterMetrics())
    table.set_models({n: record(n) for n in ("fine", *states)})
    table.set_services(())
    table.set_states(states)
    return table


PARKED_RECORD = Parked(reason="5 consecutive start failures", last_error=KEV_ERROR)
UNPLACEABLE_RECORD = Unplaceable(reason=MISSING_GPU)
PARKED = state("p", parked=PARKED_RECORD)
UNPLACEABLE = state("u", unplaceable=UNPLACEABLE_RECORD)
MEMORY = "memory exhausted on 1 of 1 nodes"
ROOM_BEING_MADE = state("r", unplaceable=Unplaceable(reason=MEMORY, provisional=True))


def test_decisions() -> None:
    both = state("both", parked=PARKED_RECORD, unplaceable=UNPLACEABLE_RECORD)
    table = table_with(p=PARKED, u=UNPLACEABLE, both=both, r=ROOM_BEING_MADE)
    fine, p, u, both_, r = (table.get(n) for n in ("fine", "p", "u", "both", "r"))
    assert gate(fine) is None and gate(u) is None and gate(r) is None
    assert isinstance(gate(p), errors.ModelParked)
    assert isinstance(when_no_endpoint(p), errors.ModelParked)
    assert isinstance(when_no_endpoint(both_), errors.ModelParked)  # parked wins
    refusal = when_no_endpoint(u)
    assert isinstance(refusal, errors.ModelUnplaceable) and MISSING_GPU in refusal.message
    # Room being made is never refused as no room: "loading", come back soon.
    refusal = when_no_endpoint(r)
    assert isinstance(refusal, errors.ModelLoading) and refusal.retry_after_s == 5
    assert "room being made" in refusal.message and MEMORY in refusal.message
    assert isinstance(when_no_endpoint(fine), errors.ModelNotReady)
    with pytest.raises(errors.ModelUnplaceable):
        asyncio.run(refuse_at_once(u))


def test_what_a_provisional_answer_waits_for_is_told_room_or_engine() -> None:
    """The planner's words of what Nomad may place the model on soon (`waiting`): room
    being made, or an engine installing, never "allocations are stopping" for both; a
    standing shortfall (told before) is waited for the same way, never refused."""
    engine = "waiting for engine llama.cpp 11434 to install on 1 node(s)"
    installing = Unplaceable(
        reason="engine llama.cpp 11434 is installed on 0 of 2 nodes",
        provisional=True,
        waiting=engine,
        standing=True,
    )
    refusal = when_no_endpoint(table_with(e=state("e", unplaceable=installing)).get("e"))
    assert isinstance(refusal, errors.ModelLoading), refusal
    assert refusal.message.startswith(f"The model `e` is {engine} (scheduler: engine llama")
    assert "allocations are stopping" not in refusal.message


def test_a_model_placed_in_part_is_loading_never_unplaceable() -> None:
    """1 of 2 replicas placed, none passing yet: the placed one is starting and will
    serve (issue 22, "never unplaceable for a model that serves")."""
    part = Unplaceable(reason=f"1 of 2 replicas placed; {MEMORY}", placed=1, desired=2)
    table = table_with(s=state("s", unplaceable=part))
    refusal = when_no_endpoint(table.get("s"))
    assert isinstance(refusal, errors.ModelLoading) and refusal.retry_after_s == 5
    assert "starting on the replicas placed: 1 of 2" in refusal.message
    assert MEMORY in refusal.message
    # Nothing placed is refused with the reason, as before.
    none = state("n", unplaceable=part.model_copy(update={"placed": 0}))
    assert isinstance(when_no_endpoint(table_with(n=none).get("n")), errors.ModelUnplaceable)


def test_a_model_known_only_from_its_service_is_not_ready_with_retry() -> None:
    table = EndpointTable(RouterMetrics())
    table.set_models({})
    table.set_services({"orphan"})
    refusal = when_no_endpoint(table.get("orphan"))
    assert isinstance(refusal, errors.ModelNotReady) and refusal.retry_after_s == 5
    assert "llmgw/models/orphan is missing" in refusal.message


def test_stopped_renders_without_retry_after() -> None:
    status, headers, body = errors.render(
        errors.ModelStopped("m", stopped_message("m", "defined with replicas: 0"))
    )
    assert status == 503 and dict(headers)[b"x-should-retry"] == b"false"
    assert b"retry-after" not in dict(headers)
    error = json.loads(body)["error"]
    assert error["code"] == "model_stopped" and error["param"] == "model"
    assert "`m` is stopped: defined with replicas: 0." in error["message"]


def test_parked_and_unplaceable_render_without_retry_after() -> None:
    table = table_with(p=PARKED, u=UNPLACEABLE)
    for name, code in (("p", "model_parked"), ("u", "model_unplaceable")):
        status, headers, body = errors.render(when_no_endpoint(table.get(name)))
        assert status == 503
        assert b"retry-after" not in dict(headers)
        error = json.loads(body)["error"]
        assert error["code"] == code and error["type"] == "server_error"
        assert error["param"] == "model"


def test_state_follows_models_in_either_order() -> None:
    table = EndpointTable(RouterMetrics())
    table.set_states({"late": PARKED})  # state read before the model is
    table.set_models({"late": record("late")})
    entry = table.get("late")
    assert entry.parked == PARKED.parked
    table.set_states({})
    assert entry.parked is None and entry.unplaceable is None
    table.set_states({"late": UNPLACEABLE})
    assert entry.unplaceable == UNPLACEABLE.unplaceable


# --- through the app ------------------------------------------------------------


@pytest.fixture
def app():
    app = create_app(RouterSettings(activation=False))  # refuse at once, as without a planner
    table = app.state.table
    table.set_models({n: record(n) for n in ("p", "u", "idle")})
    table.set_services(())
    table.set_states({"p": PARKED, "u": UNPLACEABLE})
    return app


def test_parked_wins_over_a_passing_endpoint(app) -> None:
    # The endpoint is unreachable: reaching it would be a 502, not a 503.
    app.state.table.set_endpoints("p", [ServiceAddress("127.0.0.1", 9)])
    response = TestClient(app).post("/v1/chat/completions", json={"model": "p"})
    assert response.status_code == 503
    assert "retry-after" not in response.headers
    error = response.json()["error"]
    assert error["code"] == "model_parked" and KEV_LINE in error["message"]


def test_refusals_are_counted_by_reason(app) -> None:
    client = TestClient(app)
    for model in ("p", "p", "u", "idle", "nope"):
        client.post("/v1/completions", json={"model": model})
    text = client.get("/metrics").text
    for series in (
        'llmgw_router_refusals_total{model="p",reason="parked"} 2.0',
        'llmgw_router_refusals_total{model="u",reason="unplaceable"} 1.0',
        'llmgw_router_refusals_total{model="idle",reason="not_ready"} 1.0',
        'llmgw_router_refusals_total{model="",reason="unknown_model"} 1.0',
        'llmgw_router_refusals_total{model="idle",reason="parked"} 0.0',  # exists at zero
        'llmgw_router_refusals_total{model="idle",reason="stopped"} 0.0',
        'llmgw_router_refusals_total{model="idle",reason="replicas_busy"} 0.0',
        'llmgw_router_requests_total{code="503",model="p"} 2.0',
        'llmgw_router_requests_total{code="404",model=""} 1.0',
    ):
        assert series in text, series


def test_removed_model_drops_its_refusal_series(app) -> None:
    app.state.table.set_models({})
    assert 'model="p"' not in app.state.metrics.exposition()[0].decode()


def test_the_log_tells_a_shortfall_once_not_each_look_of_nomad(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Found in an audit: every router logged a warning for each new evaluation of the
    same shortfall and for each look of Nomad at room while it stood, and again on the
    way back. Logged: a new shortfall, and a change of what the router does (refuse or
    wait)."""
    short = Unplaceable(reason=f"1 of 2 replicas placed; {MEMORY}", placed=1, desired=2)
    table = table_with(s=state("s", unplaceable=short))
    looking = short.model_copy(
        update={"provisional": True, "standing": True, "waiting": "waiting for room: 1 ..."}
    )
    caplog.clear()
    with caplog.at_level("INFO", logger="router.endpoints"):
        for answer in (looking, short.model_copy(update={"eval_id": "e2"}), short):
            table.set_states({"s": state("s", unplaceable=answer)})
        assert not caplog.records, caplog.text
        table.set_states({"s": state("s", unplaceable=short.model_copy(update={"reason": "cpu"}))})
        table.set_states({"s": state("s")})
    assert [r.getMessage() for r in caplog.records] == [
        "model s unplaceable: cpu",
        "model s no longer unplaceable",
    ]
