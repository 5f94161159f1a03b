"""`make demo`: Gemma 3 270M served through the router on a real dev cluster.

Called by `python -m devcluster demo` after the bootstrap. Steps, each shown
as it runs: cluster up (standard ports, state in .run/demo), `planner serve`
(watcher + admin API on 127.0.0.1:4650), `planner engines apply engines/
--wait` (llama-server checked and recorded on the node), `planner apply models/ --wait`,
router up on 127.0.0.1:8080, one completion through the router, `planner
status`. Leaves everything running and says how to stop it (`make down`).
The admin token is generated once and kept in .run/demo/admin-token.
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
from devcluster.cluster import Cluster, up

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
    return {**os.environ, **cluster.env, "PATH": f"{BIN}:{os.environ.get('PATH', '')}",
            "LLMGW_ADMIN_TOKEN": token, "LLMGW_PLANNER_TOKEN": token,
            "LLMGW_PLANNER_URL": f"http://127.0.0.1:{PLANNER_PORT}",
            # Engine installs record node metadata through the agent, not the Task API
            # socket, whose path under a deep checkout's .run/ can pass 107 bytes.
            "LLMGW_ENGINE_NOMAD_ADDR": cluster.nomad_addr}


def start(cluster: Cluster, name: str, argv: list[str], health_url: str) -> None:
    """Start a long-running llmgw process in the background (once) and wait for its /health."""
    pidfile = cluster.root / f"{name}.pid"
    if pidfile.exists() and Path(f"/proc/{pidfile.read_text().strip()}").exists():
        say(f"{name} already running (pid {pidfile.read_text().strip()})")
        return
    with (cluster.root / f"{name}.log").open("ab") as log:
        proc = subprocess.Popen(argv, env=planner_env(cluster), stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    pidfile.write_text(str(proc.pid))
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(health_url, timeout=2).close()
            break
        except (urllib.error.URLError, ConnectionError) as exc:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit(f"[demo] {name} did not start: {exc}; see "
                                 f"{cluster.root / f'{name}.log'}") from exc
            time.sleep(0.3)
    say(f"{name} started (pid {proc.pid}, log {cluster.root / f'{name}.log'})")


def complete(model: str, timeout: float = 120.0) -> dict:
    """POST /v1/completions through the router, retrying while it has no endpoint yet."""
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 24,
                       "temperature": 0}).encode()
    deadline = time.monotonic() + timeout
    while True:
        request = urllib.request.Request(
            f"http://127.0.0.1:{ROUTER_PORT}/v1/completions", data=body,
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return json.load(response)
        except (urllib.error.URLError, ConnectionError) as exc:
            if time.monotonic() > deadline:
                raise SystemExit(f"[demo] no completion from the router: {exc}") from exc
            time.sleep(1)


def main() -> None:
    cluster = demo_cluster()
    say("starting consul and nomad (dev mode, 127.0.0.1) ...")
    up(cluster)
    say(f"cluster up: Nomad UI {cluster.nomad_addr}/ui, Consul UI {cluster.consul_addr}/ui")
    env = planner_env(cluster)
    venv = REPO / ".venv" / "bin"
    start(cluster, "planner", [str(venv / "planner"), "serve", "--port", str(PLANNER_PORT)],
          f"http://127.0.0.1:{PLANNER_PORT}/health")
    say("planner engines apply engines/ --wait")
    subprocess.run([str(venv / "planner"), "engines", "apply", str(REPO / "engines"),
                    "--wait", "--timeout", "120"], env=env, check=True)
    say("planner apply models/ --wait")
    subprocess.run([str(venv / "planner"), "apply", str(REPO / "models"),
                    "--wait", "--timeout", "300"], env=env, check=True)
    start(cluster, "router", [str(venv / "router"), "serve", "--host", "127.0.0.1",
                              "--port", str(ROUTER_PORT)],
          f"http://127.0.0.1:{ROUTER_PORT}/health")
    say(f"asking gemma-3-270m through the router: {PROMPT!r}")
    started = time.monotonic()
    answer = complete("gemma-3-270m")
    text = answer["choices"][0]["text"]
    say(f"answered in {time.monotonic() - started:.1f} s, usage {answer.get('usage')}")
    print(f"\n{PROMPT}{text}\n")
    subprocess.run([str(REPO / ".venv" / "bin" / "planner"), "status"], env=env, check=False)
    say("everything is still running. Try:")
    say(f"  export PATH={BIN}:$PATH   # nomad, consul")
    say(f"  export LLMGW_ADMIN_TOKEN=$(cat {cluster.root / 'admin-token'})   # admin API")
    say("  nomad job status gemma-3-270m ; consul catalog services")
    say("  .venv/bin/planner status --nodes   # the engines each node has")
    say(f"  curl -s 127.0.0.1:{ROUTER_PORT}/v1/completions -H 'Content-Type: application/json' "
        f"-d '{{\"model\":\"gemma-3-270m\",\"prompt\":\"Once upon a time\",\"max_tokens\":32}}'")
    say("stop it all with: make down")


if __name__ == "__main__":
    main()
