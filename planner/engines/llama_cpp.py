"""llama.cpp's `llama-server`: its arguments, its readiness path, its error lines.

The engine kind every model ran before engines were a seam (`planner.engines`).
Sources of each rule: llama.cpp's `tools/server/server.cpp` (the `/health` route
answers 503 while the model loads and 200 once ready; `--metrics` turns on
`/metrics`; `--alias` is the model name `/v1/models` reports) and its `common/log.cpp`
(stderr lines carry an elapsed-time and level prefix, "0.00.008.710 E ").
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from planner.engines import MODEL_FILE, NOMAD_IP, NOMAD_PORT
from planner.fitargs import slots

# llama.cpp's log prefix: elapsed time and level, "0.00.008.710 E ".
LOG_PREFIX = re.compile(r"^\d+\.\d+\.\d+\.\d+ ([A-Z]) +")
_TROUBLE = re.compile(r"error|fail|unknown|invalid|cannot|unable|no such|out of memory", re.I)

# Every layer on the GPU when it has any: llama.cpp clamps the count to the model's layers.
ALL_LAYERS = "999"


class LlamaCpp:
    """The llama.cpp engine (`planner.engines.Engine`)."""

    kind = "llama.cpp"
    health_path = "/health"

    def server_args(self, model: str, context: int, gpus: int,
                    args: Sequence[str] = ()) -> list[str]:
        """The slot count is always given (the profile's last --parallel, else 1): left
        out, llama-server picks its own (4, sharing one unified cache, on recent builds).
        --ctx-size is the whole cache, which llama.cpp splits evenly between the slots
        when the cache is not unified (src/llama-context.cpp, n_ctx_seq = n_ctx /
        n_seq_max), so it is `context` x slots: each request can use `context` tokens
        (rounded up to a multiple of 256 by llama.cpp; `planner.fitargs`)."""
        parallel = slots(args)
        server = ["--model", MODEL_FILE, "--alias", model, "--host", NOMAD_IP,
                  "--port", NOMAD_PORT, "--parallel", str(parallel),
                  "--ctx-size", str(context * parallel), "--metrics"]
        return server + (["--n-gpu-layers", ALL_LAYERS] if gpus > 0 else [])

    def error_lines(self, stderr_tail: str) -> str:
        return stderr_summary(stderr_tail)


def stderr_summary(tail: str, keep_errors: int = 8, keep_last: int = 2) -> str:
    """What of a task's stderr tail an operator needs: its error lines (llama.cpp's
    level E, or words of trouble), each once and in order, since llama.cpp names
    the cause first ("failed to open GGUF file", "unknown model architecture"),
    then its last lines. Time prefixes are dropped, so repeats collapse."""
    lines, errors = [], []
    for raw in tail.splitlines():
        match = LOG_PREFIX.match(raw)
        line = (raw[match.end():] if match else raw).strip()
        if not line or line in lines:
            continue
        lines.append(line)
        if (match and match.group(1) == "E") or _TROUBLE.search(line):
            errors.append(line)
    last = [line for line in lines[-keep_last:] if line not in errors[:keep_errors]]
    return "\n".join(errors[:keep_errors] + last)


ENGINE = LlamaCpp()
