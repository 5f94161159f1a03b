"""llama.cpp's `llama-server`: its arguments, its readiness path, its error lines.

The engine kind every model ran before engines were a seam (`planner.engines`).
Sources of each rule: llama.cpp's `tools/server/server.cpp` (the `/health` route
answers 503 while the model loads and 200 once ready; `--metrics` turns on
`/metrics`; `--alias` is the model name `/v1/models` reports) and its `common/log.cpp`
(stderr lines carry an elapsed-time and level prefix, "0.00.008.710 E ") and
`ggml/src/gguf.cpp` (a file that is not GGUF: "invalid magic characters: '<its first
4 bytes>', expected 'GGUF'", the bytes as they are).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from llmgw_contract.lasterror import LOG_PREFIX, is_error
from planner.engines import MODEL_FILE, NOMAD_IP, NOMAD_PORT
from planner.engines.fitargs import slots

# What a last error says of a file that is not GGUF, instead of llama.cpp's quote of its
# first bytes: a `file://` source naming, say, an SSH key would send "----" to API
# clients (issue 18). The bytes are raw, so they may hold a quote or a line break:
# the quote ends at "expected 'GGUF'" when that follows within a few characters, else
# the rest of the line goes (older builds print no "expected").
NOT_GGUF = "not a GGUF file (bad magic)"
_BAD_MAGIC = re.compile(r"invalid magic characters:?\s*'.{0,12}?',\s*expected 'GGUF'", re.DOTALL)
_BAD_MAGIC_REST = re.compile(r"invalid magic characters[^\n]*(\n[^\n]{0,4}'[ \t]*(?=\n|$))?")
# llama.cpp's grammar parser quotes the grammar it could not parse (a file, with
# --grammar-file): the rest of the line goes.
_GRAMMAR_QUOTE = re.compile(r"(error parsing grammar:)[^\n]*")
_UNPRINTABLE = re.compile(r"[^\x20-\x7e\t\u00a0-\U0010ffff]|[\ufffd]")

# Every layer on the GPU when it has any: llama.cpp clamps the count to the model's layers.
ALL_LAYERS = "999"


class LlamaCpp:
    """The llama.cpp engine (`planner.engines.Engine`)."""

    kind = "llama.cpp"
    health_path = "/health"
    check_args = ("--version",)
    check_request = ("/completion", '{"prompt": "Hello", "n_predict": 1}')

    def server_args(
        self, model: str, context: int, gpus: int, args: Sequence[str] = ()
    ) -> list[str]:
        """The slot count is always given (the profile's last --parallel, else 1): left
        out, llama-server picks its own (4, sharing one unified cache, on recent builds).
        --ctx-size is the whole cache, which llama.cpp splits evenly between the slots
        when the cache is not unified (src/llama-context.cpp, n_ctx_seq = n_ctx /
        n_seq_max), so it is `context` x slots: each request can use `context` tokens
        (rounded up to a multiple of 256 by llama.cpp; `planner.engines.fitargs`)."""
        parallel = slots(args)
        server = [
            "--model",
            MODEL_FILE,
            "--alias",
            model,
            "--host",
            NOMAD_IP,
            "--port",
            NOMAD_PORT,
            "--parallel",
            str(parallel),
            "--ctx-size",
            str(context * parallel),
            "--metrics",
        ]
        return server + (["--n-gpu-layers", ALL_LAYERS] if gpus > 0 else [])

    def error_lines(self, stderr_tail: str) -> str:
        return stderr_summary(stderr_tail)


def redacted(tail: str) -> str:
    """`tail` without the bytes llama.cpp quotes from files that are not models (a bad
    GGUF magic, a grammar), and with every unprintable character as "?"."""
    tail = _BAD_MAGIC_REST.sub(NOT_GGUF, _BAD_MAGIC.sub(NOT_GGUF, tail))
    tail = _GRAMMAR_QUOTE.sub(r"\1 (the grammar is not shown)", tail)
    return "\n".join(_UNPRINTABLE.sub("?", line) for line in tail.splitlines())


def stderr_summary(tail: str, keep_errors: int = 8, keep_last: int = 2) -> str:
    """What of a task's stderr tail an operator needs: its error lines (llama.cpp's
    level E, or words of trouble on a line that is not a warning:
    `llmgw_contract.lasterror.is_error`), each once and in order, since llama.cpp names
    the cause first ("failed to open GGUF file", "unknown model architecture"),
    then its last lines. Time prefixes are dropped, so repeats collapse; quoted bytes
    of a file that is not a model never appear (`redacted`)."""
    lines, errors = [], []
    for raw in redacted(tail).splitlines():
        match = LOG_PREFIX.match(raw)
        line = (raw[match.end() :] if match else raw).strip()
        if not line or line in lines:
            continue
        lines.append(line)
        if is_error(raw):
            errors.append(line)
    last = [line for line in lines[-keep_last:] if line not in errors[:keep_errors]]
    return "\n".join(errors[:keep_errors] + last)


ENGINE = LlamaCpp()
