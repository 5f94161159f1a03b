"""Whether a model fits its profile, judged from its GGUF header before any download.

Called by `planner apply` (`check_models`) after the files are valid and before
anything is rendered or registered: a profile too small for the model is refused
with the figures, as is a context longer than the model was trained for, or a
source that cannot be read. `--dry-run` prints each estimate.

The estimate, in bytes, of what llama-server allocates as llmgw starts it (one slot
unless the profile's args say `--parallel N`, each slot with its own KV cache of
`profile.context` tokens; f16 cache, n_ubatch 512), or at what the profile's `args`
set instead (`planner.engines.fitargs`: -ngl, -ctk/-ctv, -np, -ub):

  weights   the tensors' sizes (every shard of a split model)
  KV cache  slots x slot cells x layers x KV heads x (key x K bytes + value head dim
            x V bytes), a slot's cells being the context rounded up to 256
            (`fitargs.slot_cells`, as llama.cpp pads each sequence's cache)
            (2 bytes each for f16; a quantized cache type's bytes per element from its
            block size), from
            <arch>.block_count, .attention.head_count_kv, .attention.key_length /
            .value_length (else embedding_length / head_count); per-layer arrays
            summed. Every layer is counted at the full context, so a model with
            sliding-window layers (Gemma 3: 15 of 18) gets an upper bound.
  compute   llama.cpp's graph buffer: n_ubatch x 4 bytes x (3 x feed_forward_length
            + 4 x embedding_length + head_count x key_length) for the activations,
            n_ubatch x slot cells x 2 bytes for the attention mask (each slot's cache is
            a stream of its own, and the mask spans one), and the logits of the
            slots (vocabulary x slots x 4 bytes). Fitted to llama-server's own
            "compute buffer size" lines: Gemma 3 270M 19.3 / 24.8 / 52.8 MiB at 512 /
            4096 / 32768 tokens (slope 1 KiB a token = 512 x 2 bytes).
  overhead  64 MiB: the process, its tokenizer tables and CPU repacked weights,
            measured as llama-server's resident memory beyond the buffers it
            reports: 14 MiB for the tiny test model, 41 MiB for Gemma 3 270M (of
            which 12.7 MiB CPU_REPACK). bench/fit_estimate.py prints the comparison.

The limit compared is `gpus x gpu_memory` for a GPU profile (llama.cpp spreads the
layers over its GPUs), `memory` for a CPU one; a GPU profile without gpu_memory
is estimated, not judged against its GPUs. A GPU profile whose args keep only N of
the model's L layers on the GPUs (-ngl N < L) is judged in two parts: the GPUs hold
N/L of the weights and of the KV cache plus the compute buffer; `memory` holds the
rest plus the overhead. The share is by layer count: llama.cpp puts whole repeating
layers on the GPU (llama-model.cpp, n_gpu_layers), and the token embeddings and the
output layer, which are not repeating layers, are counted at the same share. A
file:// source this machine does not have (a node's path) is not judged either, and
says so; but a split one whose first shard is here and another is not is refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gguf import Keys

from planner.engines.fitargs import DEFAULT, ServerArgs, server_args, slot_cells
from planner.errors import DefinitionError, InvalidDefinitions
from planner.spec.definitions import ModelDefinition
from planner.spec.ggufhead import ArrayLength, GgufHeader, SourceError
from planner.spec.sources import Shard, read_shard

OVERHEAD = 64 * 2**20
# Arguments that stretch the trained context on purpose (RoPE scaling).
CONTEXT_STRETCHERS = ("--rope-scaling", "--rope-scale", "--yarn-orig-ctx")


def size_text(n: int) -> str:
    """Bytes as people read them: '9.8 GiB', '512 MiB'."""
    if n >= 2**30:
        return f"{n / 2**30:.1f}".removesuffix(".0") + " GiB"
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


@dataclass(frozen=True)
class Estimate:
    """Bytes llama-server needs for one model at `context` tokens per request in each
    of `slots` slots (module docstring)."""

    context: int
    weights: int
    kv_cache: int
    compute: int
    overhead: int = OVERHEAD
    trained_context: int | None = None
    layers: int = 0  # the model's repeating layers (block_count)
    gpu_layers: int | None = None  # how many of them -ngl keeps on a GPU; None: all
    slots: int = 1  # requests served at once, each with `context` tokens (--parallel)

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.compute + self.overhead

    @property
    def offload(self) -> float:
        """The share of the layers on the GPUs (of a GPU profile): 1.0 for all."""
        if self.gpu_layers is None or self.layers <= 0 or self.gpu_layers >= self.layers:
            return 1.0
        return self.gpu_layers / self.layers

    @property
    def gpu_bytes(self) -> int:
        """What the GPUs hold: everything (`total`, as a full offload has always been
        judged), else their share of weights and KV cache plus the compute buffer."""
        if self.offload >= 1.0:
            return self.total
        if self.offload <= 0:
            return 0
        return round(self.offload * (self.weights + self.kv_cache)) + self.compute

    @property
    def host_bytes(self) -> int:
        """What a partial offload leaves in host memory (with the overhead)."""
        return self.total - self.gpu_bytes

    def parts(self) -> str:
        tokens = (
            f"{self.slots} slots x {self.context} tokens"
            if self.slots > 1
            else f"{self.context} tokens"
        )
        text = (
            f"weights {size_text(self.weights)} + KV cache {size_text(self.kv_cache)} "
            f"for {tokens} + compute {size_text(self.compute)} + overhead "
            f"{size_text(self.overhead)}"
        )
        if self.offload < 1.0:
            text += (
                f"; {self.gpu_layers} of {self.layers} layers on the GPU: "
                f"{size_text(self.gpu_bytes)} there, {size_text(self.host_bytes)} in "
                "host memory"
            )
        return text

    def text(self) -> str:
        return f"≈ {size_text(self.total)} ({self.parts()})"

    def as_dict(self) -> dict[str, Any]:
        return {
            "bytes": self.total,
            "context": self.context,
            "slots": self.slots,
            "weights": self.weights,
            "kv_cache": self.kv_cache,
            "compute": self.compute,
            "overhead": self.overhead,
            "trained_context": self.trained_context,
            **(
                {
                    "gpu_layers": self.gpu_layers,
                    "layers": self.layers,
                    "gpu_bytes": self.gpu_bytes,
                    "host_bytes": self.host_bytes,
                }
                if self.offload < 1.0
                else {}
            ),
        }


def _ints(value: Any, layers: int) -> list[int]:
    """A per-layer figure: a scalar repeated, or the array itself."""
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)] * layers if isinstance(value, int | float) else []


def _scalar(value: Any) -> int | None:
    if isinstance(value, list):
        return max((int(v) for v in value), default=None)
    return int(value) if isinstance(value, int | float) else None


def estimate(headers: list[GgufHeader], context: int, args: ServerArgs = DEFAULT) -> Estimate:
    """Pure: the estimate from a model's headers (every shard; metadata from the first)
    for llama-server run with `args`. Missing keys count as 0 (an architecture without
    them is llama-server's to refuse)."""
    first = headers[0]
    layers = _scalar(first.arch_key(Keys.LLM.BLOCK_COUNT)) or 0
    embed = _scalar(first.arch_key(Keys.LLM.EMBEDDING_LENGTH)) or 0
    heads = _scalar(first.arch_key(Keys.Attention.HEAD_COUNT)) or 0
    kv_heads = _ints(
        first.arch_key(Keys.Attention.HEAD_COUNT_KV) or first.arch_key(Keys.Attention.HEAD_COUNT),
        layers,
    )
    head_dim = embed // heads if heads else 0
    key = _scalar(first.arch_key(Keys.Attention.KEY_LENGTH)) or head_dim
    value = _scalar(first.arch_key(Keys.Attention.VALUE_LENGTH)) or head_dim
    ffn = _scalar(first.arch_key(Keys.LLM.FEED_FORWARD_LENGTH)) or 0
    tokens = first.metadata.get(Keys.Tokenizer.LIST)
    vocab = (
        tokens.length
        if isinstance(tokens, ArrayLength)
        else len(tokens)
        if isinstance(tokens, list)
        else _scalar(first.arch_key(Keys.LLM.VOCAB_SIZE))
    )
    cells = slot_cells(context)
    kv = round(
        args.parallel
        * cells
        * sum(kv_heads[:layers])
        * (key * args.kv_bytes_k + value * args.kv_bytes_v)
    )
    compute = (
        args.ubatch * 4 * (3 * ffn + 4 * embed + heads * key)
        + args.ubatch * cells * 2
        + (vocab or 0) * args.parallel * 4
    )
    return Estimate(
        context,
        sum(h.tensor_bytes for h in headers),
        kv,
        compute,
        trained_context=_scalar(first.arch_key(Keys.LLM.CONTEXT_LENGTH)),
        layers=layers,
        gpu_layers=args.gpu_layers,
        slots=args.parallel,
    )


def judge(definition: ModelDefinition, file: Path, est: Estimate) -> list[DefinitionError]:
    """Pure: the problems of one definition against its estimate."""
    profile, problems = definition.profile, []
    trained = est.trained_context
    if (
        trained
        and profile.context > trained
        and not any(a in CONTEXT_STRETCHERS for a in profile.args)
    ):
        problems.append(
            DefinitionError(
                file,
                "profile.context",
                (
                    f"{profile.context} tokens is more than the model was trained for "
                    f"({trained}, its context_length); ask for at most {trained}, or stretch it "
                    "on purpose with --rope-scaling in args"
                ),
            )
        )
    if not profile.gpus:
        return problems + _over(
            file,
            "profile.memory",
            est.total,
            profile.memory,
            size_text(profile.memory),
            profile.context,
            est,
        )
    if profile.gpu_memory and est.offload > 0:
        gives = (
            f"{profile.gpus} x {size_text(profile.gpu_memory)}"
            if profile.gpus > 1
            else size_text(profile.gpu_memory)
        )
        problems += _over(
            file,
            "profile.gpu_memory",
            est.gpu_bytes,
            profile.gpus * profile.gpu_memory,
            gives,
            profile.context,
            est,
        )
    if est.offload < 1.0:
        problems += _over(
            file,
            "profile.memory",
            est.host_bytes,
            profile.memory,
            size_text(profile.memory),
            profile.context,
            est,
        )
    return problems


def _over(
    file: Path, where: str, need: int, limit: int, gives: str, context: int, est: Estimate
) -> list[DefinitionError]:
    if need <= limit:
        return []
    what = (
        "the model needs"
        if est.offload >= 1.0
        else (
            f"with {est.gpu_layers} of {est.layers} layers on the GPU (--n-gpu-layers), "
            + ("the GPU share needs" if where == "profile.gpu_memory" else "the rest needs")
        )
    )
    tokens = f"{est.slots} slots x {context}" if est.slots > 1 else f"{context}"
    return [
        DefinitionError(
            file,
            where,
            (
                f"{what} ≈ {size_text(need)} for {tokens} tokens of context; profile gives "
                f"{gives} ({est.parts()}; from the GGUF header)"
            ),
        )
    ]


@dataclass(frozen=True)
class Fit:
    """One model's estimate, or why there is none (`note`)."""

    estimate: Estimate | None
    note: str = ""

    def text(self) -> str:
        return self.estimate.text() if self.estimate else self.note

    def as_dict(self) -> dict[str, Any]:
        return {
            **(self.estimate.as_dict() if self.estimate else {}),
            **({"note": self.note} if self.note else {}),
        }


Reader = Callable[[Shard], GgufHeader]


def check_models(
    models: dict[str, tuple[Path, ModelDefinition]], read: Reader | None = None
) -> dict[str, Fit]:
    """Read every model's header(s) and judge it: {name: Fit}. Raises InvalidDefinitions
    with every problem of every model (field `source` when it cannot be read)."""
    reader = read or read_shard
    fits, problems = {}, []
    for name, (file, definition) in models.items():
        # The args first, whether or not the header can be read: the job's slot count
        # comes from them (planner.engines.llama_cpp).
        args, arg_problems = server_args(definition.profile.args)
        problems += [
            DefinitionError(file, f"profile.args.{i}", message) for i, message in arg_problems
        ]
        headers: list[GgufHeader] = []
        try:
            for shard in definition.shards:
                headers.append(reader(shard))
        except FileNotFoundError as exc:
            if headers:
                # Its first shard is here, so this is the nodes' folder (or a copy of it)
                # and a shard is missing: llama-server would fail at every start.
                problems.append(
                    DefinitionError(
                        file,
                        "source",
                        (
                            f"{exc.filename} is missing: the first shard of this split model is on "
                            f"this machine but shard {len(headers) + 1} of "
                            f"{len(definition.shards)} is not"
                        ),
                    )
                )
            else:
                fits[name] = Fit(None, f"not checked: {exc.filename} is not on this machine")
            continue
        except SourceError as exc:
            problems.append(DefinitionError(file, "source", str(exc)))
            continue
        problems += _split_problems(file, headers)
        unknown = sorted(set().union(*(h.unknown_types for h in headers)))
        if unknown:
            # A quantization newer than the gguf package: its size is unknown, so the
            # estimate would be short; llama-server judges the file.
            fits[name] = Fit(
                None,
                f"not checked: ggml tensor type(s) {unknown} unknown "
                "to this planner's gguf package",
            )
            continue
        if not definition.profile.gpus:
            args = replace(args, gpu_layers=None)  # a CPU profile holds every layer
        est = estimate(headers, definition.profile.context, args)
        problems += judge(definition, file, est)
        fits[name] = Fit(est)
    if problems:
        raise InvalidDefinitions(problems)
    return fits


def _split_problems(file: Path, headers: list[GgufHeader]) -> list[DefinitionError]:
    """Each shard says it is the shard its name says (split.no, split.count)."""
    if len(headers) == 1:
        split = headers[0].split
        return (
            []
            if split is None
            else [
                DefinitionError(
                    file,
                    "source",
                    (
                        f"{headers[0].where} is shard {split[0] + 1} of a {split[1]}-file split "
                        "model; name its first shard, <name>-00001-of-"
                        f"{split[1]:05d}.gguf"
                    ),
                )
            ]
        )
    return [
        DefinitionError(
            file,
            "source",
            (
                f"{h.where} says it is shard {h.split[0] + 1 if h.split else '(none)'} of "
                f"{h.split[1] if h.split else 1}; its name says {i + 1} of {len(headers)}"
            ),
        )
        for i, h in enumerate(headers)
        if h.split != (i, len(headers))
    ]
