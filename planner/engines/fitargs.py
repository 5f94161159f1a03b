"""What of a profile's `args` changes llama-server's memory need, read for `planner.spec.fit`.

Called by `planner.spec.fit.check_models` at `planner apply`. The flags and their defaults
are llama-server's own (`llama-server --help` of the cached build; llama.cpp
common/arg.cpp): llama.cpp takes the last occurrence of a flag, and the operator's
args follow the template's (`planner.engines.llama_cpp`), so the last one here wins
too.

  -ngl, --gpu-layers, --n-gpu-layers N   layers kept in VRAM: an exact number, 'all' or
                                         'auto' (default auto; the template gives 999 on a
                                         GPU profile). 'auto' is counted as all: it never
                                         exceeds the GPUs, and all is the template's choice.
  -ctk, --cache-type-k / -ctv, --cache-type-v TYPE   KV cache element type (default f16;
                                         allowed: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl,
                                         q5_0, q5_1). Bytes per element are the gguf
                                         package's block sizes (GGML_QUANT_SIZES: q8_0 34
                                         bytes a block of 32 = 1.0625, q4_0 18/32 = 0.5625).
  -np, --parallel N                      server slots: requests served at once. llmgw
                                         always passes it (default 1: `slots`), so a
                                         definition means the same on every build:
                                         llama-server's own default, -1 (auto), is 4 slots
                                         sharing one unified cache (tools/server/server.cpp),
                                         and is refused here, as is 0. Every slot has its
                                         own KV cache of `profile.context` tokens
                                         (`planner.engines.llama_cpp`); the logits buffer
                                         holds one vocabulary row per slot.
  -kvu, --kv-unified, --kv-unified-per-slot   refused: one cache shared by every slot lets
                                         one request take what the others were promised,
                                         so `profile.context` would no longer be what each
                                         request can use.
  -ub, --ubatch-size N                   physical batch (default 512): the compute
                                         buffer's activations and attention mask scale
                                         with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

GPU_LAYERS = ("-ngl", "--gpu-layers", "--n-gpu-layers")
CACHE_TYPE_K = ("-ctk", "--cache-type-k")
CACHE_TYPE_V = ("-ctv", "--cache-type-v")
PARALLEL = ("-np", "--parallel")
UNIFIED_CACHE = ("-kvu", "--kv-unified", "--kv-unified-per-slot")
UBATCH = ("-ub", "--ubatch-size")
CACHE_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
# llmgw's slot count when the profile's args set none (llama-server's own default,
# auto, would be 4 slots sharing one cache).
DEFAULT_PARALLEL = 1
DEFAULT_UBATCH = 512
# llama.cpp gives each sequence (slot) a whole number of 256-cell blocks: it pads
# n_ctx to 256 and n_ctx / n_seq_max again (src/llama-context.cpp, GGML_PAD(..., 256)),
# so a slot asked for `context` tokens holds `slot_cells(context)`.
KV_PAD = 256


def slot_cells(context: int) -> int:
    """KV cells llama.cpp gives one slot asked for `context` tokens: `context` rounded
    up to a multiple of KV_PAD (256)."""
    return -(-context // KV_PAD) * KV_PAD


def bytes_per_element(cache_type: str) -> float:
    """Bytes one KV cache element takes in `cache_type` (one of CACHE_TYPES)."""
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[cache_type.upper()]]
    return size / block


@dataclass(frozen=True)
class ServerArgs:
    """The memory-relevant settings llama-server will run with. `gpu_layers` None: all."""

    gpu_layers: int | None = None
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    parallel: int = DEFAULT_PARALLEL
    ubatch: int = DEFAULT_UBATCH

    @property
    def kv_bytes_k(self) -> float:
        return bytes_per_element(self.cache_type_k)

    @property
    def kv_bytes_v(self) -> float:
        return bytes_per_element(self.cache_type_v)


DEFAULT = ServerArgs()


def _last(args: Sequence[str], names: tuple[str, ...]) -> tuple[int, str] | None:
    """(index of the value, value) of the last occurrence of a flag among `names`."""
    found = None
    for i, arg in enumerate(args[:-1]):
        if arg in names:
            found = (i + 1, args[i + 1])
    return found


def _count(
    found: tuple[int, str] | None, default: int, auto: int, what: str
) -> tuple[int, tuple[int, str] | None]:
    """A positive count (-1 or 0: llama-server's auto), or the problem at its index."""
    if found is None:
        return default, None
    index, text = found
    try:
        value = int(text)
    except ValueError:
        return default, (index, f"expected {what} as a whole number, got {text!r}")
    return (value if value > 0 else auto), None


def _slots(found: tuple[int, str] | None) -> tuple[int, tuple[int, str] | None]:
    """The slot count of the last -np/--parallel (DEFAULT_PARALLEL without one), or
    the problem at its index: not a whole number, or under 1."""
    count, problem = _count(found, DEFAULT_PARALLEL, 0, "a number of slots")
    if found is None or problem or count >= 1:
        return count, problem
    return DEFAULT_PARALLEL, (
        found[0],
        (
            f"expected a number of slots, 1 or more, got {found[1]!r} (llama-server's auto lets "
            "each build choose its own count and share one cache; llmgw gives each slot "
            "`profile.context` tokens)"
        ),
    )


def slots(args: Sequence[str]) -> int:
    """The slots llama-server runs with for a profile's `args` (its last valid
    -np/--parallel, else DEFAULT_PARALLEL, 1): the requests it serves at once, each
    with `profile.context` tokens."""
    return _slots(_last(args, PARALLEL))[0]


def server_args(args: Sequence[str]) -> tuple[ServerArgs, list[tuple[int, str]]]:
    """The settings `args` give llama-server, and the problems found as (index in args,
    message): a value llama-server would refuse."""
    problems: list[tuple[int, str]] = []
    layers: int | None = None
    if (found := _last(args, GPU_LAYERS)) is not None:
        index, text = found
        if text.isdigit():
            layers = int(text)
        elif text not in ("all", "auto"):
            problems.append((index, f"expected a number of layers, 'all' or 'auto', got {text!r}"))
    types = []
    for names, default in ((CACHE_TYPE_K, "f16"), (CACHE_TYPE_V, "f16")):
        found = _last(args, names)
        if found is not None and found[1] not in CACHE_TYPES:
            problems.append(
                (
                    found[0],
                    f"expected a cache type, one of {', '.join(CACHE_TYPES)}, got {found[1]!r}",
                )
            )
            found = None
        types.append(found[1] if found else default)
    parallel, problem = _slots(_last(args, PARALLEL))
    problems += [problem] if problem else []
    problems += [
        (
            i,
            f"{arg} is not for llmgw: every slot has its own cache of "
            "`profile.context` tokens, what each request can use; a unified cache "
            "would let one request take the others'. Remove it (set the slots with "
            "--parallel)",
        )
        for i, arg in enumerate(args)
        if arg in UNIFIED_CACHE
    ]
    ubatch, problem = _count(_last(args, UBATCH), DEFAULT_UBATCH, DEFAULT_UBATCH, "a batch size")
    problems += [problem] if problem else []
    return ServerArgs(layers, types[0], types[1], parallel, ubatch), problems
