"""Test-only engines: the real llama-server behind small shell wrappers that produce,
for real processes under real Nomad and Consul, behaviours no tiny model produces by
itself. Each one is a fake of one thing, and says which.

    llama.cpp             the real llama-server, nothing wrapped
    slow-llama.cpp        sleeps 90 s first: a model that takes 90 s to load (C09). A real
                          one needs gigabytes of weights; to Nomad and Consul it is the
                          same, a server that does not answer its health check for 90 s
    wait8-llama.cpp       sleeps 8 s first: a model that loads in about 8 s (C19)
    crash-llama.cpp       serves, passes its health check, then exits 1 after
                          CRASH_AFTER_S, every time: a server that aborts on its first real
                          request (C15, reported against llama-swap)
    slowstop-llama.cpp    takes STOP_DELAY_S to exit when told to stop: a large model
                          freeing its memory, so "room being made" lasts long enough to
                          be seen (C20)
    index1-llama.cpp      fails every start of replica server[1] (NOMAD_ALLOC_INDEX 1) the
                          way llama-server does for a missing file; server[0] is the real
                          server: one replica stopped by Nomad beside a serving one, on
                          one node
    nodefault-llama.cpp   on a node whose agent has LLMGW_FAKE_FAULT=missing-model in its
                          environment (raw_exec tasks inherit it), exits 1 the way
                          llama-server does when the model file is missing on that node;
                          elsewhere the real server (C14)
    segv-llama.cpp        prints llama.cpp's harmless vocabulary warning, then dies of
                          SIGSEGV: a build that crashes on the first graph compute (issue
                          17: AMX kernels of a -march=native build). Crashing for real needs
                          a CPU the build does not fit; to Nomad a death by SIGSEGV is the
                          same whichever program dies

`crashing_engine` writes a program that dies of a given signal however it is run (its
`--version` included): an engine build that crashes on a node (SIGILL: instructions the
CPU lacks).
"""

from __future__ import annotations

from pathlib import Path

SLOW_START_SECONDS = 90
CRASH_AFTER_S = 8
STOP_DELAY_S = 4

# What llama-server prints (stderr) for a missing file, trimmed (a real run's lines).
_MISSING = (
    "gguf_init_from_file: failed to open GGUF file '$model' (No such file or "
    "directory)\nllama_model_load: error loading model: llama_model_loader: failed "
    "to load model from $model\nsrv  llama_server: exiting due to model loading error"
)


# llama.cpp's warning for a vocabulary token whose type is not "control" (a real
# Gemma 3 load's line, as the parked model of issue 17 kept it as its headline).
VOCAB_WARNING = (
    "load: control-looking token: 212 '</s>' was not control-type; this is "
    "probably a bug in the model"
)


def crashing_engine(path: Path, signal: str, warning: str = VOCAB_WARNING) -> Path:
    """An executable at `path` that prints `warning` to stderr and kills itself with
    `signal` ("SEGV", "ILL"), whatever its arguments."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nprintf "%s\\n" "{warning}" >&2\nkill -{signal} $$\n')
    path.chmod(0o755)
    return path


def _missing_file_when(condition: str, real: str) -> str:
    """A wrapper that exits 1 with llama-server's missing-file error when the shell
    `condition` holds, and runs the real server otherwise."""
    return (
        f"if [ {condition} ]; then\n  model=$2\n"
        f'  printf "%s\\n" "{_MISSING}" >&2\n  exit 1\nfi\n'
        f'exec {real} "$@"\n'
    )


def write_engines(folder: Path, llama_server: Path) -> dict[str, str]:
    """Write the wrappers into `folder`; returns LLMGW_ENGINES' map {name: path}."""
    real = str(llama_server)
    scripts = {
        "slow-llama.cpp": f'sleep {SLOW_START_SECONDS}\nexec {real} "$@"\n',
        "wait8-llama.cpp": f'sleep 8\nexec {real} "$@"\n',
        "crash-llama.cpp": (
            f'{real} "$@" &\nsleep {CRASH_AFTER_S}\nkill -9 $!\n'
            'echo "crash-llama.cpp: aborting after serving" >&2\nexit 1\n'
        ),
        "slowstop-llama.cpp": (
            f'{real} "$@" &\npid=$!\n'
            f'trap "sleep {STOP_DELAY_S}; kill $pid; exit 0" INT TERM\n'
            "wait $pid\n"
        ),
        "index1-llama.cpp": _missing_file_when('"$NOMAD_ALLOC_INDEX" = 1', real),
        "nodefault-llama.cpp": _missing_file_when('"$LLMGW_FAKE_FAULT" = missing-model', real),
    }
    engines = {
        "llama.cpp": real,
        "segv-llama.cpp": str(crashing_engine(folder / "segv-llama.cpp", "SEGV")),
    }
    for name, body in scripts.items():
        path = folder / name
        path.write_text("#!/bin/sh\n" + body)
        path.chmod(0o755)
        engines[name] = str(path)
    return engines
