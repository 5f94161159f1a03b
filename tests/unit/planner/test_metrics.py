"""The planner's /metrics rendering: every model at zero, one-hot states, what it wants."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from llmgw_contract import ModelRecord, ModelState, ScalingBounds, StateDocument, Unplaceable
from planner.daemon.engine_install import NodeInstall
from planner.daemon.metrics import PlannerMetrics
from planner.daemon.statusbook import Row, row, wanted_replicas
from planner.model.status import ModelStatus

T0 = datetime(2026, 11, 30, tzinfo=UTC)
ALWAYS = ModelRecord(name="a", definition_hash="h", replicas=2)
ON_DEMAND = ModelRecord(name="od", definition_hash="h", replicas=1, on_demand={"idle_after": 60})


def status(name: str, state: ModelState, ready: int = 0, failures: int = 0) -> ModelStatus:
    return ModelStatus(
        name=name,
        state=state,
        desired=0,
        running=0,
        ready=ready,
        consecutive_failures=failures,
        start_failures_total=failures,
        reason="",
        last_error=None,
        since=None,
    )


def test_what_a_model_wants_now() -> None:
    assert wanted_replicas(ALWAYS, None, T0) == 2  # parked or stopped, it still wants them
    assert wanted_replicas(ON_DEMAND, None, T0) == 0  # idle
    assert wanted_replicas(ON_DEMAND, T0 - timedelta(seconds=30), T0) == 1  # asked for
    assert wanted_replicas(ON_DEMAND, T0 - timedelta(seconds=61), T0) == 0


def test_unplaceable_series_ignores_room_being_made() -> None:
    room = StateDocument(name="a", unplaceable=Unplaceable(reason="r", provisional=True))
    short = StateDocument(name="a", unplaceable=Unplaceable(reason="r"))
    loading = status("a", ModelState.LOADING)
    assert not row(ALWAYS, loading, room, None, T0).unplaceable
    assert row(ALWAYS, status("a", ModelState.UNPLACEABLE), short, None, T0).unplaceable
    # Room being made after a told shortfall: it stands (an alert's `for` goes on).
    standing = Unplaceable(reason="r", provisional=True, standing=True, desired=2)
    looking = StateDocument(name="a", unplaceable=standing)
    assert row(ALWAYS, loading, looking, None, T0) == Row(loading, 2, True, 2)


def test_every_model_is_published_zeros_included_with_one_hot_states() -> None:
    rows = [
        Row(status("a", ModelState.PARKED, failures=5), 2, False),
        Row(status("od", ModelState.IDLE), 0, False),
    ]
    text = PlannerMetrics(lambda: rows).exposition()[0].decode()
    assert 'llmgw_model_desired_replicas{model="a"} 2.0' in text
    assert 'llmgw_model_ready_replicas{model="a"} 0.0' in text
    assert 'llmgw_model_parked{model="a"} 1.0' in text
    assert 'llmgw_model_parked{model="od"} 0.0' in text
    assert 'llmgw_model_start_failures_total{model="a"} 5.0' in text
    assert 'llmgw_model_consecutive_start_failures{model="od"} 0.0' in text
    states = [line for line in text.splitlines() if line.startswith('llmgw_model_state{model="a"')]
    assert len(states) == len(ModelState)
    assert sum(float(line.split()[-1]) for line in states) == 1
    assert 'llmgw_model_state{model="a",state="parked"} 1.0' in text
    assert "llmgw_planner_leader 0.0" in text
    assert "llmgw_planner_leader_changes_total 0.0" in text


def test_a_pruned_model_leaves_no_series() -> None:
    rows: list[Row] = [Row(status("a", ModelState.SERVING, ready=2), 2, False)]
    metrics = PlannerMetrics(lambda: rows)
    assert 'model="a"' in metrics.exposition()[0].decode()
    rows.clear()
    assert 'model="a"' not in metrics.exposition()[0].decode()


def test_engine_installs_per_node_at_zero_and_a_stale_version_at_one() -> None:
    rows = [
        NodeInstall("a", "llama.cpp", "11434", "11434", "complete"),
        NodeInstall("b", "llama.cpp", "11434", "11000", "failed", "sha256 mismatch"),
        NodeInstall("c", "llama.cpp", "11434", None, "running"),
    ]
    metrics = PlannerMetrics(lambda: [], engines=lambda: rows)
    text = metrics.exposition()[0].decode()
    for node, version, value in (
        ("a", "11434", "1.0"),
        ("b", "11434", "0.0"),
        ("b", "11000", "1.0"),
        ("c", "11434", "0.0"),
    ):
        assert (
            f'llmgw_engine_installed{{engine="llama.cpp",node="{node}",'
            f'version="{version}"}} {value}'
        ) in text, text


def test_a_scaling_model_serving_short_of_a_scale_up_is_never_unplaceable() -> None:
    """Issue 22, "never unplaceable for a model that serves": the shortfall is its own
    gauge; a fixed model short of its replicas stays unplaceable as before."""
    scaling = ALWAYS.model_copy(update={"scaling": ScalingBounds(min=1, max=3, target=2)})
    short = StateDocument(
        name="a", unplaceable=Unplaceable(reason="memory exhausted", placed=2, desired=3)
    )
    serving = status("a", ModelState.SERVING, ready=2)
    scaled = row(scaling, serving, short, None, T0)
    assert (scaled.unplaceable, scaled.unplaced) == (False, 1)
    fixed = row(ALWAYS, status("a", ModelState.DEGRADED, ready=2), short, None, T0)
    assert (fixed.unplaceable, fixed.unplaced) == (True, 1)
    nothing = row(scaling, status("a", ModelState.UNPLACEABLE), short, None, T0)
    assert nothing.unplaceable
    text = PlannerMetrics(lambda: [scaled]).exposition()[0].decode()
    assert 'llmgw_model_unplaceable{model="a"} 0.0' in text
    assert 'llmgw_model_unplaced_replicas{model="a"} 1.0' in text
