"""What portability costs: the bootstrap's portable llama-server against a native build.

The bootstrap builds llama-server for every machine of the architecture (the
x86-64-v3 baseline, AVX-512 and AMX off; issue "Any machine"). This bench builds
the same sdist once more with `-DGGML_NATIVE=ON` for this CPU (cached under
~/.cache/llmgw/bench/, keyed by the CPU's flags; about 5 min on 2 cores the first
time), then runs each binary on Gemma 3 270M Q4_K_M (the demo model) on
127.0.0.1, both up at once and asked in turn (so other load on the machine falls
on both alike): one warm-up each, then `--runs` completions each of a ~250-token
prompt with 64 new tokens, prompt cache off, reading llama-server's own `timings`
(prompt_per_second: prompt processing; predicted_per_second: generation).

Prints the medians and the ratio portable / native (1.0: no cost). A native
build that crashes here (as on CPUs with AMX) is reported as such, not as 0.
Usage::

    python bench/portable_vs_native.py [--runs 5] [--threads 2] [--output json]

Exit codes: 0 measured; 2 no portable llama-server or demo model (run `make bootstrap`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from devcluster import bootstrap, smoke  # noqa: E402

PROMPT = (
    "In the beginning the universe was created. This has made a lot of people very "
    "angry and been widely regarded as a bad move. "
) * 10
NEW_TOKENS = 64


def native_binary() -> Path:
    """The native build for this CPU, built once (SystemExit from the bootstrap's build
    on failure)."""
    out = bootstrap.CACHE / "bench" / f"llama-server-native-{bootstrap.cpu_flags_digest()}"
    if not out.exists():
        flags = [*bootstrap.LLAMA_COMMON_FLAGS, "-DGGML_NATIVE=ON"]
        bootstrap.llama_compile(
            flags,
            out,
            bootstrap.CACHE / "build" / "llama-native",
            bootstrap.CACHE / "logs" / "llama-native.log",
        )
    return out


def _post(port: int, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.load(response)


def start(binary: Path, model: Path, threads: int) -> tuple[subprocess.Popen[bytes], int]:
    """`binary` serving `model` on a free port of 127.0.0.1, ready (SmokeFailed if not)."""
    port = smoke.free_port()
    log = bootstrap.CACHE / "logs" / f"bench-{binary.name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [
                str(binary),
                "--model",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--ctx-size",
                "2048",
                "--parallel",
                "1",
                "--threads",
                str(threads),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    smoke.wait_ready(proc, port)
    return proc, port


def measure(binaries: dict[str, Path], model: Path, runs: int, threads: int) -> dict:
    """Median prompt and generation tokens/s of each binary on `model` ({"crashed": ...} for
    one that died). Both servers are up at once and asked in turn, A B A B ..., so load
    from anything else on the machine falls on both alike (an idle server takes no CPU)."""
    body = {
        "prompt": PROMPT,
        "n_predict": NEW_TOKENS,
        "temperature": 0,
        "cache_prompt": False,
        "ignore_eos": True,
    }
    servers, result, timings = {}, {}, {name: [] for name in binaries}
    try:
        for name, binary in binaries.items():
            try:
                servers[name] = start(binary, model, threads)
                _post(servers[name][1], body)  # warm-up
            except (OSError, smoke.SmokeFailed) as exc:
                proc = servers.pop(name, (None, 0))[0]
                result[name] = {"crashed": (smoke.died_of(proc.poll()) if proc else "") or str(exc)}
        for _ in range(runs):
            for name, (_, port) in servers.items():
                timings[name].append(_post(port, body)["timings"])
    finally:
        for proc, _ in servers.values():
            smoke.stop(proc)
    for name in servers:
        got = timings[name]
        result[name] = {
            "prompt_tokens": got[0]["prompt_n"],
            "prompt_per_second": statistics.median(t["prompt_per_second"] for t in got),
            "predicted_per_second": statistics.median(t["predicted_per_second"] for t in got),
        }
    return result


def print_table(result: dict) -> None:
    print(f"Gemma 3 270M Q4_K_M, {result['threads']} threads, median of {result['runs']} runs")
    print(f"{'build':<10} {'prompt tok/s':>13} {'gen tok/s':>10}")
    for name in ("portable", "native"):
        row = result[name]
        if "crashed" in row:
            print(f"{name:<10} crashed: {row['crashed']}")
        else:
            print(
                f"{name:<10} {row['prompt_per_second']:>13.1f} {row['predicted_per_second']:>10.1f}"
            )
    if "ratio" in result:
        print(
            f"portable / native: prompt {result['ratio']['prompt']:.2f}, "
            f"generation {result['ratio']['generation']:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", choices=["table", "json"], default="table")
    args = parser.parse_args()
    portable, model = bootstrap.llama_binary(), bootstrap.gemma_path()
    if not portable.exists() or not model.exists():
        print("no portable llama-server or demo model: run `make bootstrap`", file=sys.stderr)
        sys.exit(2)
    result: dict = {
        "runs": args.runs,
        "threads": args.threads,
        "portable_flags": [f for f in bootstrap.llama_cmake_flags() if "GGML" in f],
    }
    result.update(
        measure({"portable": portable, "native": native_binary()}, model, args.runs, args.threads)
    )
    if "crashed" not in result["portable"] and "crashed" not in result["native"]:
        result["ratio"] = {
            "prompt": result["portable"]["prompt_per_second"]
            / result["native"]["prompt_per_second"],
            "generation": result["portable"]["predicted_per_second"]
            / result["native"]["predicted_per_second"],
        }
    if args.output == "json":
        print(json.dumps(result, indent=2))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
