"""`make demo`: Gemma 3 270M served through the router on a real dev cluster.

Called by `python -m devcluster demo` after the bootstrap. Steps, each shown
as it runs: cluster up (standard ports, state in .run/demo), `planner serve`
(watcher + admin API on 127.0.0.1:4650), `planner engines apply engines/
--wait` (llama-server checked and recorded on the node), `planner apply models/ --wait`,
router up on 127.0.0.1:8080, one completion through the router, `planner
status`, then what the Nomad UI would show of the model (below). Leaves
everything running and says how to stop it (`make down`). The admin token is
generated once and kept in .run/demo/admin-token.

The Nomad UI: the Nomad built here from its Go module has none (its Ember app
is built by `make dev-ui`, from npm packages this environment does not serve;
`/ui/` answers "Nomad UI is not available in this binary",
command/agent/stub_asset.go). The demo says so rather than print a URL that
leads nowhere, and prints the same facts the UI's job page shows: `nomad job
status` and the job's `llmgw_*` meta (parking reason, last error, since, the
model record), read from /v1/job/<id>, the API the UI reads. A Nomad with its
UI gets its URL printed instead.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from devcluster.bootstrap import BIN, REPO
from devcluster.cluster import Cluster, alive, up

# What a Nomad built without its web UI answers on /ui/ (command/agent/stub_asset.go).
NO_UI_TEXT = "Nomad UI is not available in this binary"
# The meta keys llmgw writes on a model's job (llmgw_contract.JobMeta), by prefix: the
# demo imports no planner code.
META_PREFIX = "llmgw_"
PARKED_PREFIX = "llmgw_parked_"

ROUTER_PORT = 8080
PLANNER_PORT = 4650
PROMPT = "The capital of France is"


def say(message: str) -> None:
    print(f"[demo] {message}", file=sys.stderr, flush=True)


def demo_cluster() -> Cluster:
    return Cluster(REPO / ".run" / "demo", port_offset=0)


def admin_token(cluster: Cluster) -> str:
    path = cluster.root / "admin-token"
    if not path.exists():
        path.write_text(secrets.token_urlsafe(24))
        path.chmod(0o600)
    return path.read_text().strip()


def planner_env(cluster: Cluster) -> dict[str, str]:
    token = admin_token(cluster)
    return {
        **os.environ,
        **cluster.env,
        "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
        "LLMGW_ADMIN_TOKEN": token,
        "LLMGW_PLANNER_TOKEN": token,
        "LLMGW_PLANNER_URL": f"http://127.0.0.1:{PLANNER_PORT}",
        # Engine installs record node metadata through the agent, not the Task API
        # socket, whose path under a deep checkout's .run/ can pass 107 bytes.
        "LLMGW_ENGINE_NOMAD_ADDR": cluster.nomad_addr,
    }


def start(cluster: Cluster, name: str, argv: list[str], health_url: str) -> None:
    """Start a long-running llmgw process in the background (once) and wait for its /health."""
    pidfile = cluster.root / f"{name}.pid"
    running = _running(pidfile, argv)
    if running is not None:
        say(f"{name} already running (pid {running})")
        return
    with (cluster.root / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(
            argv,
            env=planner_env(cluster),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    pidfile.write_text(str(proc.pid))
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(health_url, timeout=2).close()
            break
        except (urllib.error.URLError, ConnectionError) as exc:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(
                    f"[demo] {name} did not start: {exc}; see {cluster.root / f'{name}.log'}"
                ) from exc
            time.sleep(0.3)
    say(f"{name} started (pid {proc.pid}, log {cluster.root / f'{name}.log'})")


def _running(pidfile: Path, argv: list[str]) -> int | None:
    """The pid in `pidfile` while that process still runs `argv`. A process killed a
    moment ago is a zombie until it is reaped, and its pid can go to another program
    later: either is not running (found by a new user: `kill -9` of the planner, then
    `make demo` at once said "planner already running" and started none)."""
    try:
        pid = int(pidfile.read_text())
        args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except (OSError, ValueError):
        return None
    # A script runs as `<interpreter> <script> <args>`: its path and arguments end the line.
    args = [a for a in args if a]
    ours = len(args) >= len(argv) and args[len(args) - len(argv) :] == argv
    return pid if ours and alive(pid) else None


def complete(model: str, timeout: float = 120.0) -> dict:
    """POST /v1/completions through the router, retrying while it has no endpoint yet."""
    body = json.dumps(
        {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    ).encode()
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(
            f"http://127.0.0.1:{ROUTER_PORT}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.load(response)
        except (urllib.error.URLError, ConnectionError) as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"[demo] no completion from the router: {exc}") from exc
            time.sleep(1)


def nomad_ui_available(nomad_addr: str) -> bool:
    """Whether the Nomad agent at `nomad_addr` serves its web UI (False: a binary built
    without it, which answers /ui/ with a stub page)."""
    with urllib.request.urlopen(f"{nomad_addr}/ui/", timeout=5) as response:
        return NO_UI_TEXT not in response.read().decode(errors="replace")


def llmgw_meta(job: dict) -> dict[str, str]:
    """The job's `llmgw_*` meta, as the Nomad UI's job page lists it (its Meta table,
    from /v1/job/<id>): {key: value}, sorted by key."""
    return dict(
        sorted((k, v) for k, v in (job.get("Meta") or {}).items() if k.startswith(META_PREFIX))
    )


def meta_lines(meta: dict[str, str]) -> list[str]:
    """One line per key, `key = value`; a multi-line value (a last error with stderr
    lines) goes on indented lines of its own, as the UI wraps it."""
    lines = []
    for key, value in meta.items():
        first, *rest = value.splitlines() or [""]
        lines += [f"{key} = {first}", *(f"    {line}" for line in rest)]
    return lines


def show_job(cluster: Cluster, job_id: str) -> None:
    """What the Nomad UI would show of a model's job: `nomad job status` and its
    llmgw_* meta (parked: reason, last error, since)."""
    say(f"nomad job status {job_id}  (the Nomad UI's job page, as text)")
    subprocess.run(
        [str(BIN / "nomad"), "job", "status", job_id], env=planner_env(cluster), check=False
    )
    with urllib.request.urlopen(f"{cluster.nomad_addr}/v1/job/{job_id}", timeout=10) as resp:
        meta = llmgw_meta(json.load(resp))
    say("its llmgw_* meta (a parked model's reason and last error are here):")
    for line in meta_lines(meta):
        print(f"  {line}", file=sys.stderr)
    if not any(key.startswith(PARKED_PREFIX) for key in meta):
        print("  (not parked: no llmgw_parked_* keys)", file=sys.stderr)


def main() -> None:
    cluster = demo_cluster()
    say("starting consul and nomad (dev mode, 127.0.0.1) ...")
    up(cluster)
    ui = nomad_ui_available(cluster.nomad_addr)
    say(f"cluster up: Nomad {cluster.nomad_addr}, Consul UI {cluster.consul_addr}/ui")
    if ui:
        say(f"Nomad UI: {cluster.nomad_addr}/ui")
    else:
        say(
            "Nomad UI: none: this Nomad is built from its Go module without the web UI; "
            "the demo prints what the UI would show (`nomad job status`, llmgw_* meta)"
        )
    env = planner_env(cluster)
    venv = REPO / ".venv" / "bin"
    start(
        cluster,
        "planner",
        [str(venv / "planner"), "serve", "--port", str(PLANNER_PORT)],
        f"http://127.0.0.1:{PLANNER_PORT}/health",
    )
    say("planner engines apply engines/ --wait")
    subprocess.run(
        [
            str(venv / "planner"),
            "engines",
            "apply",
            str(REPO / "engines"),
            "--wait",
            "--timeout",
            "120",
        ],
        env=env,
        check=True,
    )
    say("planner apply models/ --wait")
    subprocess.run(
        [str(venv / "planner"), "apply", str(REPO / "models"), "--wait", "--timeout", "300"],
        env=env,
        check=True,
    )
    start(
        cluster,
        "router",
        [str(venv / "router"), "serve", "--host", "127.0.0.1", "--port", str(ROUTER_PORT)],
        f"http://127.0.0.1:{ROUTER_PORT}/health",
    )
    say(f"asking gemma-3-270m through the router: {PROMPT!r}")
    started = time.monotonic()
    answer = complete("gemma-3-270m")
    text = answer["choices"][0]["text"]
    say(f"answered in {time.monotonic() - started:.1f} s, usage {answer.get('usage')}")
    print(f"\n{PROMPT}{text}\n")
    subprocess.run([str(REPO / ".venv" / "bin" / "planner"), "status"], env=env, check=False)
    show_job(cluster, "gemma-3-270m")
    say("everything is still running. Try:")
    say(f"  export PATH={BIN}:$PATH   # nomad, consul")
    say(f"  export LLMGW_ADMIN_TOKEN=$(cat {cluster.root / 'admin-token'})   # admin API")
    say("  nomad job status gemma-3-270m ; consul catalog services")
    say("  .venv/bin/planner status --nodes   # the engines each node has")
    say("  nomad job inspect gemma-3-270m | grep llmgw_   # the meta a parked model carries")
    say(
        f"  curl -s 127.0.0.1:{ROUTER_PORT}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model":"gemma-3-270m","prompt":"Once upon a time","max_tokens":32}}\''
    )
    say("stop it all with: make down")


if __name__ == "__main__":
    main()
