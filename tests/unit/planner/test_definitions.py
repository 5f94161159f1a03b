"""The model file schema: every C01 kind of bad input is named with file, field and expectation."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.definitions import (
    ModelDefinition,
    load_definitions,
    parse_bytes,
    parse_seconds,
    resolve_source,
)
from planner.errors import InvalidDefinitions

VALID = """\
name: {name}
source: file:///models/tiny.gguf
profile:
  engine: llama.cpp
  context: 4096
  gpus: 0
  cpu: 2000
  memory: 2GiB
  args: ["--threads", "2"]
replicas: 1
"""


def write(folder: Path, filename: str, text: str) -> Path:
    path = folder / filename
    path.write_text(text)
    return path


def problems(folder: Path) -> list[str]:
    with pytest.raises(InvalidDefinitions) as info:
        load_definitions([folder])
    return [str(e) for e in info.value.errors]


def test_valid_file_loads_with_defaults(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", VALID.format(name="gemma-3-270m"))
    models = load_definitions([tmp_path])
    _, model = models["gemma-3-270m"]
    assert model.profile.memory == 2 * 2**30
    assert model.profile.args == ("--threads", "2")
    assert model.service_name == "llmgw-gemma-3-270m"


def test_unknown_key_names_file_field_and_suggests(tmp_path: Path) -> None:
    path = write(tmp_path, "a.yaml", VALID.format(name="a").replace("replicas:", "replica:"))
    [problem] = problems(tmp_path)
    assert problem.startswith(f"{path}: replica: unknown field")
    assert "did you mean 'replicas'" in problem


def test_unknown_profile_key_is_named_with_its_path(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", VALID.format(name="a").replace("  gpus: 0", "  gpu: 0"))
    [problem] = problems(tmp_path)
    assert ": profile.gpu: unknown field" in problem and "'gpus'" in problem


@pytest.mark.parametrize("name", ["bad_name", "Gemma", "-lead", "trail-", "x" * 58])
def test_name_must_be_a_dns_label(tmp_path: Path, name: str) -> None:
    write(tmp_path, "a.yaml", VALID.format(name=name))
    [problem] = problems(tmp_path)
    assert ": name: expected a DNS label" in problem and repr(name) in problem


@pytest.mark.parametrize(("name", "holder"), [
    ("planner", "a model's Consul service is llmgw-<name>, and llmgw-planner is the planner's "
                "service"),
    ("router", "llmgw-router is the router's service"),
    ("llmgw-planner", "a model's name is its Nomad job ID, and llmgw-planner is the planner's "
                      "job ID"),
    ("llmgw-router", "llmgw-router is the router's job ID"),
    ("llmgw-engine-llama", "llmgw-engine-<engine> are the job IDs of llmgw's engine installs"),
])
def test_names_llmgw_uses_for_itself_are_reserved(tmp_path: Path, name: str,
                                                   holder: str) -> None:
    path = write(tmp_path, "a.yaml", VALID.format(name=name))
    [problem] = problems(tmp_path)
    assert problem.startswith(f"{path}: name: {name!r} is reserved (llmgw keeps the names of "
                              "its own jobs and services: ")
    assert holder in problem and "; choose another name" in problem


def test_negative_gpu_count(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", VALID.format(name="a").replace("gpus: 0", "gpus: -1"))
    [problem] = problems(tmp_path)
    assert ": profile.gpus: Input should be greater than or equal to 0 (got -1)" in problem


def test_duplicate_name_across_files_names_both(tmp_path: Path) -> None:
    first = write(tmp_path, "a.yaml", VALID.format(name="same"))
    second = write(tmp_path, "b.yaml", VALID.format(name="same"))
    [problem] = problems(tmp_path)
    assert problem.startswith(f"{second}: name:") and str(first) in problem


def test_tab_indentation_is_explained(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", VALID.format(name="a").replace("  engine", "\tengine"))
    [problem] = problems(tmp_path)
    assert "invalid YAML: line 4" in problem and "spaces, not tabs" in problem


def test_empty_file(tmp_path: Path) -> None:
    path = write(tmp_path, "a.yaml", "  \n")
    assert problems(tmp_path) == [f"{path}: file is empty; expected a mapping with name, "
                                  "source, profile and replicas"]


def test_duplicate_key_in_one_file(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", VALID.format(name="a") + "replicas: 3\n")
    [problem] = problems(tmp_path)
    assert "key 'replicas' appears twice" in problem


def test_every_problem_of_every_file_is_reported(tmp_path: Path) -> None:
    write(tmp_path, "ok.yaml", VALID.format(name="fine"))
    write(tmp_path, "a.yaml", VALID.format(name="Bad").replace("gpus: 0", "gpus: -2"))
    write(tmp_path, "b.yaml", "")
    found = problems(tmp_path)
    assert len(found) == 3
    assert any("name:" in p for p in found) and any("profile.gpus" in p for p in found)



def test_an_unknown_engine_is_reported_with_the_other_files_problems(tmp_path: Path) -> None:
    write(tmp_path, "vllm.yaml", VALID.format(name="v").replace("llama.cpp", "vllm"))
    write(tmp_path, "bad.yaml", VALID.format(name="b").replace("gpus: 0", "gpus: -2"))
    with pytest.raises(InvalidDefinitions) as info:
        load_definitions([tmp_path], engines={"llama.cpp"})
    found = sorted(str(e) for e in info.value.errors)
    assert len(found) == 2 and "profile.gpus" in found[0], found
    assert found[1].endswith("vllm.yaml: profile.engine: unknown engine 'vllm' (this planner "
                             "knows: llama.cpp; define it in engines/*.yaml and run "
                             "`planner engines apply`, or name it in LLMGW_ENGINES)"), found


@pytest.mark.parametrize(("args", "expected"), [
    ('["--port", "1"]', "profile.args.0: --port is set by the planner's job template; "
                        "remove it and its value (Nomad gives each replica its address"),
    ('["--threads", "1", "--model=/x"]', "profile.args.2: --model is set by the planner"),
    ('["-m", "/x"]', "profile.args.0: -m is set by the planner"),
    ('["-c", "8192"]', "profile.args.0: -c is set by the planner's job template; remove it "
                       "and its value (set `profile.context` instead)"),
    ('["--ctx-size", "8192"]', "profile.args.0: --ctx-size is set by the planner"),
    ('["--host", "0.0.0.0"]', "profile.args.0: --host is set by the planner"),
    ('["${HOME}"]', "profile.args.0: argument '${HOME}' contains '${', which Nomad would "
                    "interpolate"),
    # C23: llama-server looks each argv element up whole ("invalid argument: --threads=1").
    ('["--threads=1"]', "profile.args.0: '--threads=1' is one element; write the flag and "
                        'its value as separate elements: ["--threads", "1"] (llama-server '
                        "does not split --flag=value)"),
    ('["--parallel", "1", "--threads 1"]',
     "profile.args.2: '--threads 1' is one element; write the flag and its value as "
     'separate elements: ["--threads", "1"] (each element is one argv element'),
    # llama-server: "error: invalid argument:  --threads" and "invalid argument: ".
    ('["--parallel", "1", " --threads", "2"]', "profile.args.2: argument ' --threads' has "
                                                "spaces around the flag; write '--threads'"),
    ('["--threads\t", "2"]', "profile.args.0: argument '--threads\\t' has spaces"),
    ('["--threads", "2", ""]', "profile.args.2: argument '' is empty; llama-server rejects"),
    ('["--threads", "2", " "]', "profile.args.2: argument ' ' is empty"),
    # Model sources of llama-server --help, which would bypass `source`.
    ('["-hfr", "org/repo"]', "profile.args.0: -hfr is set by the planner"),
    ('["--hf-file", "x.gguf"]', "profile.args.0: --hf-file is set by the planner"),
    ('["-hff", "x.gguf"]', "profile.args.0: -hff is set by the planner"),
    ('["--docker-repo", "ai/x"]', "profile.args.0: --docker-repo is set by the planner"),
    ('["--gpt-oss-20b-default"]', "profile.args.0: --gpt-oss-20b-default is set by the"),
])
def test_args_llama_server_would_reject_name_the_element(tmp_path: Path, args: str,
                                                         expected: str) -> None:
    path = write(tmp_path, "a.yaml", VALID.format(name="a").replace('["--threads", "2"]', args))
    [problem] = problems(tmp_path)
    assert problem.startswith(f"{path}: {expected}"), problem


@pytest.mark.parametrize("args", [
    '["--seed", "-1", "--temp", "-.5"]',  # negative values are not flags
    '["--override-kv", "tokenizer.ggml.add_bos_token=bool:false"]',  # a value may hold "="
    '["--chat-template-kwargs", "{\\"a b\\": 1}"]',  # and spaces
    '["-ngl", "20", "--metrics"]',
    '["--threads", " 2"]',  # a value is read by stoi, which skips the space
])
def test_args_llama_server_accepts_pass(tmp_path: Path, args: str) -> None:
    write(tmp_path, "a.yaml", VALID.format(name="a").replace('["--threads", "2"]', args))
    assert load_definitions([tmp_path])["a"][1].profile.args


def test_gpu_memory_without_gpus(tmp_path: Path) -> None:
    text = VALID.format(name="a").replace("gpus: 0", "gpus: 0\n  gpu_memory: 8GiB")
    write(tmp_path, "a.yaml", text)
    [problem] = problems(tmp_path)
    assert "gpu_memory is only meaningful with gpus > 0" in problem


def test_bad_source_scheme(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", VALID.format(name="a").replace("file:///models", "ftp://h"))
    [problem] = problems(tmp_path)
    assert ": source: expected a file://, https:// or hf:// source" in problem


def test_hash_covers_source_and_profile_not_replicas() -> None:
    base = ModelDefinition.model_validate(
        {"name": "a", "source": "file:///m.gguf", "profile": {}, "replicas": 1})
    scaled = base.model_copy(update={"replicas": 5})
    moved = ModelDefinition.model_validate(
        {"name": "a", "source": "file:///n.gguf", "profile": {}, "replicas": 1})
    bigger = ModelDefinition.model_validate(
        {"name": "a", "source": "file:///m.gguf", "profile": {"context": 8192}})
    assert base.definition_hash == scaled.definition_hash
    assert len({base.definition_hash, moved.definition_hash, bigger.definition_hash}) == 3


def test_sources_resolve() -> None:
    assert resolve_source("file:///a/b.gguf").local_path == "/a/b.gguf"
    assert resolve_source("https://h/x.gguf").download_url == "https://h/x.gguf"
    assert resolve_source("hf://org/repo/dir/x.gguf").download_url == \
        "https://huggingface.co/org/repo/resolve/main/dir/x.gguf"
    assert resolve_source("hf://org/repo@v2/x.gguf").download_url == \
        "https://huggingface.co/org/repo/resolve/v2/x.gguf"
    with pytest.raises(ValueError, match="absolute"):
        resolve_source("file://relative/x.gguf")


def test_sizes_and_durations() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("24 GB") == 24 * 10**9
    assert parse_seconds("10m") == 600
    with pytest.raises(ValueError, match="2GiB"):
        parse_bytes("lots")
