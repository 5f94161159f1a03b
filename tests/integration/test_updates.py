"""Model updates without downtime, on real agents (issue "Model updates without
downtime"): a changed definition serves before the old one stops, a bad one is rolled
back while the old one serves, and a replica count change touches no running replica."""

from __future__ import annotations

import contextlib
import json
import os
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from devcluster.bootstrap import GEMMA_FILE, NODE_MODELS
from devcluster.cluster import Cluster
from planner.model.resurrect import renewed
from planner.spec.definitions import load_definitions
from tests.conftest import PlannerDaemon, forget_models, http_json, nomad_get, wait_for
from tests.integration.test_on_demand import complete
from tests.integration.test_parking import (
    KEV_ERROR,
    QUICK_RESTARTS,
    SLOW_RESTARTS,
    write_model,
)
from tests.support.tiny_gguf import write_tiny_gguf
from tests.support.traffic import steady

pytestmark = pytest.mark.integration

MODELS = (
    "upd-context",
    "upd-bad",
    "upd-scale",
    "upd-parked",
    "upd-early",
    "upd-renewed",
    "upd-aba",
)


@pytest.fixture(scope="module", autouse=True)
def _forget_this_modules_models(cluster: Cluster) -> Iterator[None]:
    yield
    forget_models(cluster, *MODELS)


def client(router: str, model: str) -> contextlib.AbstractContextManager[list[int]]:
    """One client asking the router every 100 ms, one request at a time, for as long as
    the block runs; yields the statuses it got (`steady`: connection errors included)."""
    return steady(lambda: complete(router, model, timeout=60), interval=0.1)


def urllib_text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as answer:
        return answer.read().decode()


def running(cluster: Cluster, name: str) -> dict[str, dict]:
    """The job's allocations Nomad wants running and that run: {alloc ID: stub}."""
    return {
        a["ID"]: a
        for a in nomad_get(cluster, f"/v1/job/{name}/allocations")
        if a["DesiredStatus"] == "run" and a["ClientStatus"] == "running"
    }


def definition(folder: Path, name: str) -> str:
    return load_definitions([folder], models_root=os.environ["LLMGW_MODELS_ROOT"])[name][
        1
    ].definition_hash


def more(outcomes: list[int], count: int) -> Callable[[], bool]:
    """Until the client made `count` more requests (so it asked after the change too)."""
    start = len(outcomes)
    return lambda: len(outcomes) >= start + count


def test_a_changed_context_serves_before_the_old_stops_and_no_request_fails(
    cluster: Cluster, planner: Callable, planner_daemon: PlannerDaemon, router: str, tmp_path: Path
) -> None:
    gemma = NODE_MODELS / GEMMA_FILE
    profile = 'context: {}\n  cpu: 500\n  memory: 1GiB\n  args: ["--threads", "1"]'
    folder = write_model(tmp_path / "m", "upd-context", gemma, profile=profile.format(2048))
    assert planner("apply", str(folder), "--wait", "--timeout", "120").returncode == 0
    [old] = running(cluster, "upd-context")
    with client(router, "upd-context") as outcomes:
        wait_for(more(outcomes, 10), 30, "the client served before the update")
        write_model(tmp_path / "m", "upd-context", gemma, profile=profile.format(4096))
        started = time.monotonic()
        applied = planner("apply", str(folder), "--wait", "--timeout", "180")
        took = time.monotonic() - started
        assert applied.returncode == 0, applied.stderr
        wait_for(lambda: old not in running(cluster, "upd-context"), 30, "the old one gone")
        wait_for(more(outcomes, 20), 30, "the client served after the update")
    failed = [o for o in outcomes if o != 200]
    print(
        f"update of upd-context (context 2048 -> 4096): --wait returned after {took:.1f} s; "
        f"{len(outcomes)} requests, {len(failed)} failed"
    )
    assert failed == []
    assert "rolling out version" in applied.stderr  # --wait reported the rollout
    [new] = running(cluster, "upd-context")
    job = nomad_get(cluster, "/v1/job/upd-context")
    assert new != old and running(cluster, "upd-context")[new]["JobVersion"] == job["Version"]
    args = job["TaskGroups"][0]["Tasks"][0]["Config"]["args"]
    assert args[args.index("--ctx-size") + 1] == "4096"


def test_a_bad_update_is_rolled_back_while_the_old_version_serves(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    router: str,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    folder = write_model(tmp_path / "m", "upd-bad", tiny_model)
    assert planner("apply", str(folder), "--wait", "--timeout", "60").returncode == 0
    good = definition(folder, "upd-bad")
    [old] = running(cluster, "upd-bad")
    kev = write_tiny_gguf(tmp_path / "kev.gguf", architecture="kev")
    with client(router, "upd-bad") as outcomes:
        write_model(tmp_path / "m", "upd-bad", kev, extra=QUICK_RESTARTS)
        bad = definition(folder, "upd-bad")
        applied = planner("apply", str(folder), "--wait", "--timeout", "240")
        assert applied.returncode == 1, applied.stderr
        assert "rolled back" in applied.stderr, applied.stderr
        wait_for(more(outcomes, 10), 30, "the client served after the rollback")
    assert [o for o in outcomes if o != 200] == []
    assert old in running(cluster, "upd-bad")  # the old replica served throughout
    model = planner_daemon.model("upd-bad")
    assert model["state"] == "serving", model
    failed = model["update_failed"]
    assert (failed["definition_hash"], failed["consecutive_failures"]) == (bad, 5), failed
    assert KEV_ERROR in failed["last_error"], failed
    job = nomad_get(cluster, "/v1/job/upd-bad")
    assert job["Meta"]["llmgw_definition_hash"] == good  # left on the old version
    metrics = urllib_text(f"{planner_daemon.url}/metrics")
    assert 'llmgw_model_update_failed{model="upd-bad"} 1.0' in metrics

    again = planner("apply", str(folder), "--output", "json")
    assert again.returncode == 1
    [change] = [c for c in json.loads(again.stdout)["changes"] if c["model"] == "upd-bad"]
    assert change["action"] == "rolled-back", change
    assert nomad_get(cluster, "/v1/job/upd-bad")["Version"] == job["Version"]  # not tried

    # `planner retry` does try it again, beside the old one, and it is rolled back again.
    retried = planner("retry", "upd-bad")
    assert retried.returncode == 0 and "rolling definition" in retried.stderr, retried.stderr
    wait_for(
        lambda: (
            (f := planner_daemon.model("upd-bad")["update_failed"]) is not None
            and f["job_version"] > failed["job_version"]
        ),
        120,
        "the retry rolled back",
    )
    assert old in running(cluster, "upd-bad")

    # Reviewer's finding on issue 22: every scale makes a job version and Nomad keeps the
    # last 6; once the failed one is gone, apply must still refuse it (the state
    # document's record), and a retry, with no version to revert to, forgets it.
    churn(cluster, "upd-bad", 6)
    kept = nomad_get(cluster, "/v1/job/upd-bad/versions")["Versions"]
    assert bad not in {v["Meta"]["llmgw_definition_hash"] for v in kept}, kept
    churned = nomad_get(cluster, "/v1/job/upd-bad")["Version"]
    again = planner("apply", str(folder), "--output", "json")
    assert again.returncode == 1, again.stderr
    [change] = [c for c in json.loads(again.stdout)["changes"] if c["model"] == "upd-bad"]
    assert change["action"] == "rolled-back", change
    assert nomad_get(cluster, "/v1/job/upd-bad")["Version"] == churned  # not tried
    retried = planner("retry", "upd-bad")
    assert retried.returncode == 0 and "no longer kept" in retried.stderr, retried.stderr
    assert planner_daemon.model("upd-bad")["update_failed"] is None

    fixed = write_tiny_gguf(tmp_path / "fixed.gguf", seed=1)
    write_model(tmp_path / "m", "upd-bad", fixed)
    assert planner("apply", str(folder), "--wait", "--timeout", "120").returncode == 0
    model = planner_daemon.model("upd-bad")
    assert (model["state"], model["update_failed"]) == ("serving", None), model
    assert nomad_get(cluster, "/v1/job/upd-bad")["Meta"]["llmgw_definition_hash"] == definition(
        folder, "upd-bad"
    )


def churn(cluster: Cluster, name: str, times: int) -> None:
    """Scale the job's group up and down `times` times through Nomad's /scale, as the
    scaler does (each makes a job version), each once no deployment runs (Nomad refuses
    a scale during one: the rollback's own, then the scale's); it ends at the count it
    had when `times` is even."""
    group = nomad_get(cluster, f"/v1/job/{name}")["TaskGroups"][0]
    for turn in range(times):
        wait_for(lambda: deployed(cluster, name), 90, f"{name} deployed before scale {turn + 1}")
        count = group["Count"] + (1 if turn % 2 == 0 else 0)
        try:
            answer = http_json(
                f"{cluster.nomad_addr}/v1/job/{name}/scale",
                {"Count": count, "Target": {"Group": group["Name"]}, "Message": "test: churn"},
            )
        except urllib.error.HTTPError as exc:
            raise AssertionError(f"scale {turn + 1}: {exc.read().decode()}") from exc
        # Its deployment, if it makes one, exists once its evaluation is complete.
        wait_for(
            lambda e=answer["EvalID"]: evaluated(cluster, e), 30, f"scale {turn + 1} evaluated"
        )
    wait_for(lambda: deployed(cluster, name), 90, f"{name} deployed after {times} scales")


def evaluated(cluster: Cluster, eval_id: str) -> bool:
    return nomad_get(cluster, f"/v1/evaluation/{eval_id}")["Status"] == "complete"


def deployed(cluster: Cluster, name: str) -> bool:
    """No deployment of the job is running."""
    return all(d["Status"] != "running" for d in nomad_get(cluster, f"/v1/job/{name}/deployments"))


def test_more_replicas_start_beside_the_first_without_touching_it(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    folder = write_model(tmp_path / "m", "upd-scale", tiny_model)
    assert planner("apply", str(folder), "--wait", "--timeout", "60").returncode == 0
    [(first, before)] = running(cluster, "upd-scale").items()
    write_model(tmp_path / "m", "upd-scale", tiny_model, replicas=3)
    assert planner("apply", str(folder), "--wait", "--timeout", "90").returncode == 0
    wait_for(lambda: len(running(cluster, "upd-scale")) == 3, 30, "three replicas")
    deployments = nomad_get(cluster, "/v1/job/upd-scale/deployments")
    assert all(
        not g.get("DesiredCanaries")
        for d in deployments
        for g in (d.get("TaskGroups") or {}).values()
    ), deployments
    after = nomad_get(cluster, f"/v1/allocation/{first}")
    # Still the same allocation, wanted and running (found by a new user: a replaced
    # allocation keeps its restarts and StartedAt, so those alone proved nothing).
    assert first in running(cluster, "upd-scale")
    assert (after["DesiredStatus"], after["ClientStatus"]) == ("run", "running")
    assert not (after.get("DeploymentStatus") or {}).get("Canary")
    task, was = after["TaskStates"]["llama-server"], before["TaskStates"]["llama-server"]
    assert (task["Restarts"], task["StartedAt"]) == (0, was["StartedAt"])
    assert http_json(f"{planner_daemon.url}/v1/models/upd-scale")["ready"] == 3


def test_a_renewed_job_takes_a_new_count_in_place(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    """Reviewer's finding on issue 19's QA fix: a job `planner retry` registered renewed
    (meta llmgw_renewed) was rendered again by the next apply without that key, a meta
    change Nomad takes as a destructive update: a canary for every replica, for a change
    of count alone. Apply keeps the marker: the count changes in place."""
    name = "upd-renewed"
    folder = write_model(tmp_path / "m", name, tiny_model)
    assert planner("apply", str(folder), "--wait", "--timeout", "60").returncode == 0
    # The registration a retry makes when a failed replica of an older definition holds
    # its place (`planner.model.retry`): the same job, renewed. It replaces the replica.
    job = nomad_get(cluster, f"/v1/job/{name}")
    index = job["JobModifyIndex"]
    http_json(
        f"{cluster.nomad_addr}/v1/jobs",
        {"Job": renewed(job, index), "EnforceIndex": True, "JobModifyIndex": index},
    )
    version = job["Version"] + 1
    wait_for(
        lambda: any(
            d["JobVersion"] == version and d["Status"] == "successful"
            for d in nomad_get(cluster, f"/v1/job/{name}/deployments")
        ),
        90,
        "the renewed version rolled out",
    )
    wait_for(lambda: len(running(cluster, name)) == 1, 30, "the replaced replica stopped")
    [(first, before)] = running(cluster, name).items()

    write_model(tmp_path / "m", name, tiny_model, replicas=2)
    planned = json.loads(planner("apply", str(folder), "--dry-run", "--output", "json").stdout)
    [change] = [c for c in planned["changes"] if c["model"] == name]
    assert change["reason"] == "replicas 1 -> 2", change
    assert not any("llmgw_renewed" in line for line in change["diff"]), change["diff"]
    assert planner("apply", str(folder), "--wait", "--timeout", "90").returncode == 0
    wait_for(lambda: len(running(cluster, name)) == 2, 30, "two replicas")
    after = nomad_get(cluster, f"/v1/job/{name}")
    assert after["Meta"]["llmgw_renewed"] == str(index)
    assert all(
        not g.get("DesiredCanaries")
        for d in nomad_get(cluster, f"/v1/job/{name}/deployments")
        if d["JobVersion"] > version
        for g in (d.get("TaskGroups") or {}).values()
    )
    alloc = nomad_get(cluster, f"/v1/allocation/{first}")
    assert first in running(cluster, name) and not (alloc.get("DeploymentStatus") or {}).get(
        "Canary"
    )
    task, was = alloc["TaskStates"]["llama-server"], before["TaskStates"]["llama-server"]
    assert (task["Restarts"], task["StartedAt"]) == (0, was["StartedAt"])


def starts_by_definition(cluster: Cluster, name: str) -> dict[str, int]:
    """How many times Nomad started the task under each definition, over every allocation
    of the job: the definition from the job each allocation was placed with (its own
    copy, so versions Nomad no longer keeps still count), the starts from its task
    state's restart count (Nomad keeps only a task's last 10 events)."""
    counted: dict[str, int] = {}
    for stub in nomad_get(cluster, f"/v1/job/{name}/allocations"):
        alloc = nomad_get(cluster, f"/v1/allocation/{stub['ID']}")
        definition = alloc["Job"]["Meta"]["llmgw_definition_hash"]
        for state in (alloc.get("TaskStates") or {}).values():
            started = not (state.get("StartedAt") or "0001").startswith("0001")
            counted[definition] = counted.get(definition, 0) + state.get("Restarts", 0) + started
    return counted


def parked(cluster: Cluster, planner_daemon: PlannerDaemon, name: str, what: str) -> dict:
    """The model once parked, with the definition its parked job runs ("definition")."""
    model = wait_for(
        lambda: (m := planner_daemon.model(name))["state"] == "parked" and m, 180, what
    )
    job = nomad_get(cluster, f"/v1/job/{name}")
    assert job["Stop"] is True
    return {**model, "definition": job["Meta"]["llmgw_definition_hash"]}


def failing_then_rolling_out(
    planner: Callable, planner_daemon: PlannerDaemon, tmp_path: Path, name: str
) -> tuple[Callable[[int], str], str, str]:
    """Model `name` in tmp_path/m: definition A (a GGUF that never loads) applied and
    failing, then definition B (as broken) applied, rolling out with a canary. Returns
    `define(seed, extra)` (writes definition `seed`, `extra` its further lines, and gives
    its hash), A's and B's hashes. A keeps the default pause between starts, so B is
    applied while A still restarts; B pauses twice as long, so A's 5 starts end before
    B's whatever Nomad's jitter (up to 25 % of each pause): A's four pauses take 20-25 s,
    B's 40-50 s. With equal pauses the jitter could end B's first (CI, stop 31): the job
    was parked, and so stopped, while A's replica still restarted, and it never ended
    failed holding its place."""
    folder = tmp_path / "m"

    def define(seed: int, extra: str = "") -> str:
        source = write_tiny_gguf(tmp_path / f"kev{seed}.gguf", architecture="kev", seed=seed)
        write_model(folder, name, source, extra=extra)
        return definition(folder, name)

    a = define(0)
    assert planner("apply", str(folder)).returncode == 0
    wait_for(lambda: planner_daemon.model(name)["consecutive_failures"] >= 1, 60, "A failing")
    b = define(1, SLOW_RESTARTS)
    assert planner("apply", str(folder)).returncode == 0
    return define, a, b


def test_a_parked_model_whose_canary_rollout_was_cut_never_starts_an_old_definition(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    router: str,
    tmp_path: Path,
) -> None:
    """Issue 19's QA, replayed: definition A fails; B rolls out with a canary beside A's
    failing replica and is parked; A's replica, stopped by Nomad after its restarts,
    keeps its place in the count. D1: C lifts parking and rolls out with a canary:
    five starts of C, parked, none of A or B. D2, D3: D lifts parking and `planner
    retry` follows at once, under traffic through the router (which activates): a
    forced reschedule would start A again at its own job version, its failures
    counting against nothing, never parked, `model_loading` for ever; a renewal would
    replace D's canary and start the count over. D's rollout is under way, so the retry
    does neither: five starts of D, parked, and the router says so."""
    name, folder = "upd-parked", tmp_path / "m"
    define, a, b = failing_then_rolling_out(planner, planner_daemon, tmp_path, name)
    first = parked(cluster, planner_daemon, name, "B parked")
    assert first["consecutive_failures"] == 5 and first["definition"] == b
    wait_for(
        lambda: any(
            x["ClientStatus"] == "failed" and x["DesiredStatus"] == "run" and x["JobVersion"] == 0
            for x in nomad_get(cluster, f"/v1/job/{name}/allocations")
        ),
        60,
        "A's replica stopped by Nomad, still holding its place",
    )
    before = starts_by_definition(cluster, name)
    print(f"A, then B rolling out with a canary, parked: starts {before}")
    assert before[b] == 5

    # D1: C lifts parking; its canary alone starts, five times, and it is parked again
    # (nothing acts meanwhile: the quick pause). D pauses slowly: the retry right after
    # its apply must find its rollout under way, and two CLI runs on a loaded machine
    # must fit before its 5th start (at least 40 s; at the default, 20 s).
    c = define(2, QUICK_RESTARTS)
    applied = json.loads(planner("apply", str(folder), "--output", "json").stdout)
    [change] = [x for x in applied["changes"] if x["model"] == name]
    assert "lifts parking" in change["reason"], change
    again = parked(cluster, planner_daemon, name, "C parked")
    assert again["consecutive_failures"] == 5 and again["definition"] == c
    d1 = starts_by_definition(cluster, name)
    print(f"D1: C lifted parking: starts {d1}, {again['reason']}")
    assert (d1[a], d1[b], d1[c]) == (before[a], before[b], 5), d1

    # D2, D3: D lifts parking, retried at once, under traffic through the router.
    answers: list[str] = []

    def ask() -> None:
        try:
            complete(router, name, timeout=60)
            answers.append("ok")
        except urllib.error.HTTPError as exc:
            answers.append(json.load(exc)["error"]["code"])
            raise

    with steady(ask, interval=0.2):
        d = define(3, SLOW_RESTARTS)
        assert planner("apply", str(folder)).returncode == 0
        retried = planner("retry", name)
        assert retried.returncode == 0, retried.stderr
        last = parked(cluster, planner_daemon, name, "D parked after the retry")
        wait_for(lambda: answers[-3:] == ["model_parked"] * 3, 30, "the router says parked")
    d2 = starts_by_definition(cluster, name)
    print(
        f"D2/D3: D applied, then retry ({retried.stderr.strip()}): starts {d2}, "
        f"{last['reason']}; the router answered "
        f"{ {k: answers.count(k) for k in set(answers)} } over {len(answers)} requests"
    )
    assert last["definition"] == d and last["consecutive_failures"] == 5
    assert (d2[a], d2[b], d2[c]) == (before[a], before[b], 5), d2
    # D's canary was rolling out: the retry wrote nothing and forgave nothing (issue 19's
    # second QA: it renewed the job over the canary, 7 to 10 starts of D between parks).
    assert "nothing to retry now" in retried.stderr, retried.stderr
    assert d2[d] == 5, d2
    assert "ok" not in answers and answers[-1] == "model_parked"


def test_a_retry_while_the_old_replica_still_restarts_still_parks_the_canary(
    cluster: Cluster,
    planner: Callable,
    planner_daemon: PlannerDaemon,
    router: str,
    tmp_path: Path,
) -> None:
    """D2's retry earlier: A's replica still restarting (nothing for a forced reschedule
    to place again), B's canary failing beside it: the retry forgives nothing (issue
    19's second QA: it forgave, and B started 7 times between parks), the canary's
    remaining starts fail, and A's replica ends failed, holding its place. Nothing will
    start again: the model is parked after five starts of B, and the router says so."""
    name = "upd-early"
    _, a, b = failing_then_rolling_out(planner, planner_daemon, tmp_path, name)
    wait_for(lambda: planner_daemon.model(name)["consecutive_failures"] >= 1, 60, "B failing")
    answers: list[str] = []

    def ask() -> None:
        try:
            complete(router, name, timeout=60)
            answers.append("ok")
        except urllib.error.HTTPError as exc:
            answers.append(json.load(exc)["error"]["code"])
            raise

    with steady(ask, interval=0.2):
        retried = planner("retry", name)
        assert retried.returncode == 0, retried.stderr
        last = parked(cluster, planner_daemon, name, "B parked after the retry")
        wait_for(lambda: answers[-3:] == ["model_parked"] * 3, 90, "the router says parked")
    counted = starts_by_definition(cluster, name)
    print(
        f"early retry ({retried.stderr.strip()}): starts {counted}, {last['reason']}; the "
        f"router answered { {k: answers.count(k) for k in set(answers)} }"
    )
    assert last["definition"] == b and counted[a] <= 5 and counted[b] == 5, counted
    assert last["consecutive_failures"] == 5, last


def test_an_earlier_definition_applied_again_starts_five_times(
    cluster: Cluster, planner: Callable, planner_daemon: PlannerDaemon, tmp_path: Path
) -> None:
    """Issue 19's third QA (D1): A parked, B parked, A applied again. A's first failed
    replica still held its place, and a job equal to its own is no update of it: Nomad
    placed nothing, and the model was parked again 0.3 s later with 0 starts. The apply
    now renews the job: five more starts of A, then parked."""
    name, folder = "upd-aba", tmp_path / "m"

    def define(seed: int) -> str:
        source = write_tiny_gguf(tmp_path / f"kev{seed}.gguf", architecture="kev", seed=seed)
        write_model(folder, name, source, extra=QUICK_RESTARTS)  # each one parked, then the next
        return definition(folder, name)

    a = define(0)
    assert planner("apply", str(folder)).returncode == 0
    assert parked(cluster, planner_daemon, name, "A parked")["definition"] == a
    b = define(1)
    assert planner("apply", str(folder)).returncode == 0
    assert parked(cluster, planner_daemon, name, "B parked")["definition"] == b
    before = starts_by_definition(cluster, name)
    assert define(0) == a
    assert planner("apply", str(folder)).returncode == 0
    wait_for(lambda: starts_by_definition(cluster, name)[a] > before[a], 60, "A started again")
    again = parked(cluster, planner_daemon, name, "A parked again")
    after = starts_by_definition(cluster, name)
    print(f"A, B, then A again: starts {before} -> {after}, {again['reason']}")
    assert again["definition"] == a and again["consecutive_failures"] == 5
    assert (after[a], after[b]) == (before[a] + 5, before[b]), after
