"""Compare `planner.spec.fit`'s memory estimate with what llama-server itself allocates.

For each model, context and slot count, starts the real llama-server (the dev
cache's ~/.cache/llmgw/bin/llama-server, on 127.0.0.1, CPU) as llmgw's job does
(`--parallel N --ctx-size context x N`: planner/engines/llama_cpp.py; f16 KV
cache, n_ubatch 512) with `-lv 4`, waits for
/health, reads the buffers it reports on stderr (`model buffer size`, `KV
buffer size`, `compute buffer size`, `output buffer size`, llama.cpp's
llama_model_loader / llama_kv_cache / sched_reserve lines) and its peak resident
memory (VmHWM), then stops it. Models: the tiny test model (written here,
tests/support/tiny_gguf.py) and, if cached, Gemma 3 270M
(~/.cache/llmgw/models/gemma-3-270m-q4_k_m.gguf).

Prints, per run, the estimate's parts against the reported ones and the error of
the total against the reported buffers and against the peak RSS (positive: the
estimate is larger, i.e. conservative). `--output json` for machines.
Usage::

    python bench/fit_estimate.py [--output json]

Exit codes: 0 every estimate at or above the reported buffers; 1 one below; 2 no
llama-server.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from planner.engines.fitargs import server_args  # noqa: E402
from planner.spec.fit import estimate  # noqa: E402
from planner.spec.ggufhead import read_local  # noqa: E402
from tests.support.ports import free_port  # noqa: E402
from tests.support.tiny_gguf import write_tiny_gguf  # noqa: E402

CACHE = Path.home() / ".cache/llmgw"
SERVER = CACHE / "bin/llama-server"
GEMMA = CACHE / "models/gemma-3-270m-q4_k_m.gguf"
MIB = 2**20
BUFFERS = {
    "weights": r"model buffer size =\s+([\d.]+) MiB",
    "kv_cache": r"KV buffer size =\s+([\d.]+) MiB",
    "compute": r"compute buffer size =\s+([\d.]+) MiB",
    "output": r"output buffer size =\s+([\d.]+) MiB",
}


def measure(model: Path, context: int, slots: int) -> dict[str, float]:
    """llama-server's reported buffers (MiB, summed over its lines) and peak RSS (MiB)."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(
            [
                str(SERVER),
                "-m",
                str(model),
                "--parallel",
                str(slots),
                "-c",
                str(context * slots),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--threads",
                "1",
                "-lv",
                "4",
            ],
            stdout=log,
            stderr=log,
        )
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                try:
                    urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).close()
                    break
                except OSError:
                    time.sleep(0.25)
            status = Path(f"/proc/{proc.pid}/status").read_text()
            peak = int(re.search(r"VmHWM:\s+(\d+) kB", status)[1]) / 1024  # type: ignore[index]
        finally:
            proc.terminate()
            proc.wait(30)
        log.seek(0)
        text = log.read().decode(errors="replace")
    found = {k: sum(float(v) for v in re.findall(p, text)) for k, p in BUFFERS.items()}
    return {**found, "rss_peak": peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", choices=("table", "json"), default="table")
    args = parser.parse_args()
    if not SERVER.exists():
        print(f"no llama-server at {SERVER}: run the bootstrap", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp())
    tiny = write_tiny_gguf(work / "tiny.gguf")
    runs = [("tiny", tiny, 512, 1), ("tiny", tiny, 4096, 1), ("tiny", tiny, 512, 4)]
    if GEMMA.exists():
        runs += [
            ("gemma-3-270m", GEMMA, c, n) for c, n in ((512, 1), (4096, 1), (32768, 1), (4096, 4))
        ]
    rows, below = [], False
    for name, path, context, slots in runs:
        est = estimate([read_local(path)], context, server_args(["--parallel", str(slots)])[0])
        got = measure(path, context, slots)
        reported = got["weights"] + got["kv_cache"] + got["compute"] + got["output"]
        total = est.total / MIB
        below |= total < reported
        rows.append(
            {
                "model": name,
                "context": context,
                "slots": slots,
                "estimate_mib": {
                    "weights": est.weights / MIB,
                    "kv_cache": est.kv_cache / MIB,
                    "compute": est.compute / MIB,
                    "overhead": est.overhead / MIB,
                    "total": total,
                },
                "reported_mib": got,
                "error_vs_buffers": (total - reported) / reported,
                "error_vs_rss_peak": (total - got["rss_peak"]) / got["rss_peak"],
            }
        )
    if args.output == "json":
        print(json.dumps(rows, indent=2))
    else:
        print(
            f"{'model':14} {'slots x ctx':>11} {'weights':>15} {'KV cache':>15} "
            f"{'compute+out':>15} {'total':>8} {'buffers':>8} {'RSS':>8} {'err/buf':>8} "
            f"{'err/RSS':>8}"
        )
        for r in rows:
            e, g = r["estimate_mib"], r["reported_mib"]
            print(
                f"{r['model']:14} {r['slots']:>3} x {r['context']:<5} "
                f"{e['weights']:>7.1f}/{g['weights']:<7.1f} "
                f"{e['kv_cache']:>7.1f}/{g['kv_cache']:<7.1f} "
                f"{e['compute']:>7.1f}/{g['compute'] + g['output']:<7.1f} "
                f"{e['total']:>8.1f} "
                f"{g['weights'] + g['kv_cache'] + g['compute'] + g['output']:>8.1f} "
                f"{g['rss_peak']:>8.1f} {r['error_vs_buffers']:>+8.0%} "
                f"{r['error_vs_rss_peak']:>+8.0%}"
            )
        print("MiB, estimate/reported; errors: (estimate - measured) / measured")
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
