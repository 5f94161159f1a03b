"""Fit from the GGUF header: the estimate's parts, the refusals with their figures, and
the models we ship and test with still fitting their profiles."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from planner.engines.fitargs import server_args
from planner.errors import InvalidDefinitions
from planner.spec.definitions import ModelDefinition, load_definitions
from planner.spec.fit import OVERHEAD, Estimate, check_models, estimate, judge, size_text
from planner.spec.ggufhead import SourceError, read_local
from planner.spec.sources import Shard
from tests.support.sparse_gguf import write_sparse_gguf
from tests.support.tiny_gguf import write_tiny_gguf

REPO = Path(__file__).parents[3]
GEMMA = Path.home() / ".cache/llmgw/models/gemma-3-270m-q4_k_m.gguf"


def definition(source: str, **profile: object) -> ModelDefinition:
    return ModelDefinition.model_validate({"name": "m", "source": source, "profile": profile})


def test_estimate_parts_follow_the_header(tmp_path: Path) -> None:
    header = read_local(write_tiny_gguf(tmp_path / "tiny.gguf"))
    est = estimate([header], 512)
    # One slot (llmgw's default): 2 layers x 4 KV heads x (16 + 16) x 2 bytes per token.
    assert est.kv_cache == 512 * 2 * 4 * (16 + 16) * 2
    assert est.weights == header.tensor_bytes
    assert est.compute == 512 * 4 * (3 * 128 + 4 * 64 + 4 * 16) + 512 * 512 * 2 + 259 * 1 * 4
    assert est.total == est.weights + est.kv_cache + est.compute + OVERHEAD
    assert est.trained_context == 8192


def test_seventy_b_header_gives_its_known_sizes(tmp_path: Path) -> None:
    write_sparse_gguf(tmp_path / "big.gguf")
    est = estimate([read_local(tmp_path / "big.gguf")], 8192)
    assert size_text(est.weights) == "128.5 GiB"  # 69B parameters in f16
    assert size_text(est.kv_cache) == "2.5 GiB"  # Llama 2/3 70B at 8192 tokens, f16


def fake(context: int = 4096, total: int = 10 * 2**30, trained: int = 8192) -> Estimate:
    return Estimate(context, total - OVERHEAD, 0, 0, trained_context=trained)


def test_a_cpu_profile_below_the_estimate_is_refused_with_the_figures() -> None:
    model = definition("file:///m.gguf", memory="8GiB", context=4096)
    [problem] = judge(model, Path("m.yaml"), fake())
    assert (problem.file, problem.field) == (Path("m.yaml"), "profile.memory")
    assert problem.message.startswith(
        "the model needs ≈ 10 GiB for 4096 tokens of "
        "context; profile gives 8 GiB (weights 9.9 GiB + "
    )


def test_a_gpu_profile_is_judged_by_all_its_gpus() -> None:
    one = definition("file:///m.gguf", gpus=1, gpu_memory="8GiB", memory="1GiB")
    [problem] = judge(one, Path("m.yaml"), fake())
    assert problem.field == "profile.gpu_memory" and "profile gives 8 GiB" in problem.message
    two = definition("file:///m.gguf", gpus=2, gpu_memory="8GiB", memory="1GiB")
    assert judge(two, Path("m.yaml"), fake()) == []  # 16 GiB over two GPUs
    unstated = definition("file:///m.gguf", gpus=1, memory="1GiB")
    assert judge(unstated, Path("m.yaml"), fake()) == []


def test_context_beyond_training_is_refused_unless_stretched() -> None:
    long = definition("file:///m.gguf", memory="64GiB", context=16384)
    [problem] = judge(long, Path("m.yaml"), fake(context=16384))
    assert problem.field == "profile.context"
    assert problem.message.startswith(
        "16384 tokens is more than the model was trained for (8192, its context_length)"
    )
    stretched = definition(
        "file:///m.gguf", memory="64GiB", context=16384, args=["--rope-scaling", "yarn"]
    )
    assert judge(stretched, Path("m.yaml"), fake(context=16384)) == []


def test_check_models_collects_every_problem_and_notes_absent_files(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    models = {
        "fits": (Path("a.yaml"), definition(f"file://{tiny}", memory="256MiB", context=512)),
        "small": (Path("b.yaml"), definition(f"file://{tiny}", memory="32MiB", context=512)),
        "elsewhere": (Path("c.yaml"), definition("file:///nodes/only.gguf")),
        "broken": (Path("d.yaml"), definition("https://h/x.gguf")),
    }

    def read(shard: Shard):
        if shard.url:
            raise SourceError("https://h/x.gguf is unreachable (refused)")
        return read_local(Path(shard.local_path or ""))

    with pytest.raises(InvalidDefinitions) as info:
        check_models(models, read)
    assert [(str(e.file), e.field) for e in info.value.errors] == [
        ("b.yaml", "profile.memory"),
        ("d.yaml", "source"),
    ]
    assert "unreachable" in info.value.errors[1].message

    del models["small"], models["broken"]
    fits = check_models(models, read)
    assert fits["fits"].estimate is not None
    assert fits["elsewhere"].note == "not checked: /nodes/only.gguf is not on this machine"


def test_the_tests_default_profile_fits_the_tiny_model(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    model = definition(f"file://{tiny}", context=512, cpu=100, memory="256MiB")
    assert check_models({"m": (Path("m.yaml"), model)})["m"].estimate.total < 256 * 2**20


@pytest.mark.skipif(not GEMMA.exists(), reason="the demo model is not in the cache")
def test_the_demo_definition_fits_gemma() -> None:
    [(name, (file, model))] = load_definitions([REPO / "models"]).items()
    local = model.model_copy(update={"source": f"file://{GEMMA}"})
    fit = check_models({name: (file, local)})[name]
    assert fit.estimate is not None and fit.estimate.total < model.profile.memory


def test_a_quantization_newer_than_the_gguf_package_is_noted_not_judged(tmp_path: Path) -> None:
    header = read_local(write_tiny_gguf(tmp_path / "tiny.gguf"))
    newer = dataclasses.replace(header, unknown_types=frozenset({99}))
    model = definition(f"file://{tmp_path}/tiny.gguf", memory="1MiB")
    fit = check_models({"m": (Path("m.yaml"), model)}, lambda shard: newer)["m"]
    assert fit.estimate is None
    assert (
        fit.note == "not checked: ggml tensor type(s) [99] unknown to this planner's gguf package"
    )


def test_cache_type_slots_and_ubatch_change_the_estimate(tmp_path: Path) -> None:
    header = read_local(write_tiny_gguf(tmp_path / "tiny.gguf"))
    base = estimate([header], 512)
    args, _ = server_args(["-ctk", "q8_0", "-ctv", "q4_0", "-np", "1", "-ub", "256"])
    est = estimate([header], 512, args)
    # 2 layers x 4 KV heads x (16 x 34/32 + 16 x 18/32) bytes per token.
    assert est.kv_cache == round(512 * 2 * 4 * (16 * 34 / 32 + 16 * 18 / 32))
    assert est.kv_cache < base.kv_cache / 2
    assert est.compute == 256 * 4 * (3 * 128 + 4 * 64 + 4 * 16) + 256 * 512 * 2 + 259 * 1 * 4


def test_every_slot_has_a_kv_cache_of_the_whole_context(tmp_path: Path) -> None:
    # Issue 20, item 2: `--parallel 4` with context 2048 holds 4 x 2048 tokens of cache,
    # where llama-server had given each request 512.
    header = read_local(write_tiny_gguf(tmp_path / "tiny.gguf"))
    one = estimate([header], 2048)
    four = estimate([header], 2048, server_args(["--parallel", "4"])[0])
    assert (one.slots, four.slots) == (1, 4)
    assert four.kv_cache == 4 * one.kv_cache == 4 * 2048 * 2 * 4 * (16 + 16) * 2
    # The mask spans one slot's cache; the logits hold a row per slot.
    assert four.compute - one.compute == 259 * 3 * 4
    assert "KV cache 4 MiB for 4 slots x 2048 tokens" in four.text()
    assert four.as_dict()["slots"] == 4 and four.as_dict()["context"] == 2048


def test_a_slot_holds_whole_blocks_of_256_cells_as_llama_cpp_pads_them(tmp_path: Path) -> None:
    header = read_local(write_tiny_gguf(tmp_path / "tiny.gguf"))
    assert estimate([header], 300).kv_cache == estimate([header], 512).kv_cache


def test_slots_are_named_in_a_refusal(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    model = definition(f"file://{tiny}", context=4096, memory="64MiB", args=["--parallel", "2"])
    with pytest.raises(InvalidDefinitions) as info:
        check_models({"m": (Path("m.yaml"), model)})
    [problem] = info.value.errors
    assert problem.field == "profile.memory"
    assert "for 2 slots x 4096 tokens of context; profile gives 64 MiB" in problem.message


def test_args_are_checked_when_the_model_file_is_not_here() -> None:
    # The job's slot count comes from them, so a node path does not skip them.
    model = definition("file:///nodes/m.gguf", args=["--parallel", "-1"])
    with pytest.raises(InvalidDefinitions) as info:
        check_models({"m": (Path("m.yaml"), model)})
    assert [e.field for e in info.value.errors] == ["profile.args.1"]


def partial(gpu_layers: int) -> Estimate:
    return Estimate(
        4096, 8 * 2**30, 2 * 2**30, 2**30, trained_context=8192, layers=40, gpu_layers=gpu_layers
    )


def test_a_partial_offload_is_judged_on_the_gpu_and_in_host_memory() -> None:
    est = partial(20)  # half the layers: 5 GiB of weights and KV + 1 GiB compute on the GPU
    assert (est.gpu_bytes, est.host_bytes) == (6 * 2**30, 5 * 2**30 + OVERHEAD)
    roomy = definition(
        "file:///m.gguf", gpus=1, gpu_memory="8GiB", memory="6GiB", args=["-ngl", "20"]
    )
    assert judge(roomy, Path("m.yaml"), est) == []  # 11 GiB in all would not fit 8 GiB
    tight = definition(
        "file:///m.gguf", gpus=1, gpu_memory="4GiB", memory="2GiB", args=["-ngl", "20"]
    )
    gpu, host = judge(tight, Path("m.yaml"), est)
    assert gpu.field == "profile.gpu_memory" and gpu.message.startswith(
        "with 20 of 40 layers on the GPU (--n-gpu-layers), the GPU share needs ≈ 6 GiB"
    )
    assert host.field == "profile.memory" and host.message.startswith(
        "with 20 of 40 layers on the GPU (--n-gpu-layers), the rest needs ≈ 5.1 GiB for "
        "4096 tokens of context; profile gives 2 GiB"
    )
    # No layer on the GPU: everything is host memory, whatever gpu_memory says.
    [cpu] = judge(tight, Path("m.yaml"), partial(0))
    assert cpu.field == "profile.memory" and "needs ≈ 11.1 GiB" in cpu.message


def test_check_models_reads_the_args_and_names_a_bad_value(tmp_path: Path) -> None:
    tiny = write_tiny_gguf(tmp_path / "tiny.gguf")
    gpu = definition(
        f"file://{tiny}",
        context=512,
        gpus=1,
        gpu_memory="1GiB",
        memory="256MiB",
        args=["-ngl", "1"],
    )
    fit = check_models({"m": (Path("m.yaml"), gpu)})["m"]
    assert (fit.estimate.gpu_layers, fit.estimate.layers, fit.estimate.offload) == (1, 2, 0.5)
    cpu = definition(f"file://{tiny}", context=512, memory="256MiB", args=["-ngl", "1"])
    assert check_models({"m": (Path("m.yaml"), cpu)})["m"].estimate.offload == 1.0
    bad = definition(
        f"file://{tiny}", context=512, memory="256MiB", args=["--threads", "1", "-ctv", "q2"]
    )
    with pytest.raises(InvalidDefinitions) as info:
        check_models({"m": (Path("m.yaml"), bad)})
    assert [e.field for e in info.value.errors] == ["profile.args.3"]


def test_a_local_split_missing_a_later_shard_is_refused(tmp_path: Path) -> None:
    first = write_tiny_gguf(tmp_path / "t.gguf", split_max_tensors=8)
    model = definition(f"file://{first}", context=512, memory="256MiB")
    assert check_models({"m": (Path("m.yaml"), model)})["m"].estimate is not None
    (tmp_path / "t-00002-of-00003.gguf").unlink()
    with pytest.raises(InvalidDefinitions) as info:
        check_models({"m": (Path("m.yaml"), model)})
    [problem] = info.value.errors
    assert (problem.field, problem.message) == (
        "source",
        (
            f"{tmp_path}/t-00002-of-00003.gguf is missing: the first shard of this split model "
            "is on this machine but shard 2 of 3 is not"
        ),
    )
    # None of it here: a node's path, noted and not judged.
    elsewhere = definition("file:///nodes/t-00001-of-00003.gguf", context=512)
    assert (
        check_models({"m": (Path("m.yaml"), elsewhere)})["m"].note
        == "not checked: /nodes/t-00001-of-00003.gguf is not on this machine"
    )
