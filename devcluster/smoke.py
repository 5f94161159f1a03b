"""Run each binary the bootstrap built once, before any cluster starts (issue "Any machine").

A build that cannot run on this machine used to show up minutes later as five
start failures and a parked model (a native llama-server on a CPU with AMX died
of SIGSEGV in its first graph compute). Here it fails the bootstrap at once,
naming the binary, the signal, the build flags and the log.

Called by devcluster.bootstrap (standard library only, like it):
  ran_once(name, argv, ...)     a binary runs and exits without a signal
  serves(binary, model, ...)    llama-server loads a GGUF, answers /health and
                                completes a few tokens (its warm-up and a batched
                                prompt are the first graph computes)
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from devcluster.ports import free_port

# Long enough that the prompt is evaluated as one batch of dozens of tokens: the
# matrix kernels a CPU variant picks for batches (AMX, AVX-512 VNNI) run on it.
PROMPT = "The quick brown fox jumps over the lazy dog. " * 8
LOAD_SECONDS = 180.0
COMPLETE_SECONDS = 120.0

# What a signal usually means for a fresh build; the rest are named only.
MEANINGS = {
    signal.SIGILL: "illegal instruction: the build uses CPU instructions this machine lacks",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGBUS: "bus error",
    signal.SIGKILL: "killed (out of memory?)",
    signal.SIGABRT: "aborted",
}


class SmokeFailed(Exception):
    """A binary did not run or serve; the message says which, how, and where the log is."""


def died_of(returncode: int | None) -> str:
    """'SIGSEGV (segmentation fault)' for a process killed by a signal (Popen's negative
    returncode; a shell's 128+N), '' for a normal exit or one still running."""
    if returncode is None:
        return ""
    number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    try:
        sig = signal.Signals(number)
    except ValueError:
        return ""
    meaning = MEANINGS.get(sig)
    return f"{sig.name} ({meaning})" if meaning else sig.name


def _tail(log: Path, lines: int = 15) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def ran_once(
    name: str, argv: list[str], log: Path, ok_codes: tuple[int, ...] = (0,), timeout: float = 60.0
) -> None:
    """Run `argv` once (output to `log`); raise SmokeFailed if it dies of a signal, hangs
    past `timeout` seconds or exits with a code outside `ok_codes`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        try:
            code = subprocess.run(
                argv, stdout=out, stderr=subprocess.STDOUT, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired as exc:
            raise SmokeFailed(
                f"{name}: `{' '.join(argv)}` did not exit in {timeout:.0f} s; log {log}"
            ) from exc
    signal_name = died_of(code)
    if signal_name or code not in ok_codes:
        how = f"died of {signal_name}" if signal_name else f"exited {code}"
        raise SmokeFailed(f"{name}: `{' '.join(argv)}` {how}\n{_tail(log)}\nlog: {log}")


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def wait_ready(proc: subprocess.Popen[bytes], port: int) -> None:
    deadline = time.monotonic() + LOAD_SECONDS
    while proc.poll() is None and time.monotonic() < deadline:
        if _get(f"http://127.0.0.1:{port}/health") == 200:
            return
        time.sleep(0.2)
    if proc.poll() is None:
        raise SmokeFailed(f"not ready after {LOAD_SECONDS:.0f} s")


def _complete(port: int, tokens: int) -> dict:
    body = json.dumps({"prompt": PROMPT, "n_predict": tokens, "temperature": 0}).encode()
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=COMPLETE_SECONDS) as response:
        return json.load(response)


def serves(binary: Path, model: Path, log: Path, build: str, tokens: int = 4) -> float:
    """Start `binary` on `model` (127.0.0.1, a free port, 512 tokens of context), wait for
    /health, complete `tokens` tokens of PROMPT, stop it; return the seconds it took.
    `build` (the build flags) goes into the error. Raises SmokeFailed naming the binary,
    the model, the signal it died of (if any), the build and the log's tail."""
    port = free_port()
    started = time.monotonic()
    argv = [
        str(binary),
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ctx-size",
        "512",
        "--parallel",
        "1",
    ]
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_ready(proc, port)
        if proc.poll() is None:
            answer = _complete(port, tokens)
            if int(answer.get("tokens_predicted", 0)) < 1:
                raise SmokeFailed(f"completed no token: {json.dumps(answer)[:200]}")
    except (SmokeFailed, OSError, ValueError) as exc:
        problem = str(exc)
    else:
        problem = ""
    if problem:  # a connection cut by a crash may be seen before the exit is
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
    exited = proc.poll()  # before our own SIGTERM: a signal now is the server's
    crashed = died_of(exited)
    if exited is not None and not (crashed or problem):
        problem = f"exited {exited} while it should have been serving"
    stop(proc)
    if crashed or problem:
        how = f"died of {crashed}" if crashed else problem
        raise SmokeFailed(
            f"{binary.name} serving {model.name}: {how}\nbuild: {build}\n{_tail(log)}\nlog: {log}"
        )
    return time.monotonic() - started


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
