"""engines/*.yaml: valid files load; every problem names its file, field and what was
expected, and nothing is partly loaded."""

from __future__ import annotations

from pathlib import Path

import pytest

from planner.errors import InvalidDefinitions
from planner.spec.engine_definitions import EngineRef, load_engines, managed, unmanaged

SHA = "ab" * 32


def write(folder: Path, name: str, text: str) -> Path:
    (folder / name).write_text(text)
    return folder / name


def problems(tmp_path: Path) -> list[str]:
    with pytest.raises(InvalidDefinitions) as info:
        load_engines([tmp_path])
    return sorted(str(e) for e in info.value.errors)


def test_an_artifact_engine_and_a_path_engine_load(tmp_path: Path) -> None:
    write(
        tmp_path,
        "a.yaml",
        f'name: llama.cpp\nversion: "11434"\n'
        f"artifact: https://h/b/llama-server\nsha256: {SHA.upper()}\n",
    )
    write(tmp_path, "b.yml", "name: old-llama.cpp\nversion: b4500\npath: /opt/b/llama-server\n")
    engines = {name: d for name, (_, d) in load_engines([tmp_path]).items()}
    art, local = engines["llama.cpp"], engines["old-llama.cpp"]
    assert (art.version, art.sha256, art.kind) == ("11434", SHA, "llama.cpp")
    assert art.meta_key == "llmgw_engine_llama.cpp" and art.job_id == "llmgw-engine-llama.cpp"
    assert art.command("/opt/e") == "/opt/e/llama.cpp/11434/llama-server"
    assert local.command("/opt/e") == "/opt/b/llama-server"
    assert managed(engines, "/opt/e")["llama.cpp"] == EngineRef(
        "llama.cpp", "llama.cpp", "/opt/e/llama.cpp/11434/llama-server", "11434"
    )
    assert unmanaged({"x": "/bin/x"})["x"] == EngineRef("x", "llama.cpp", "/bin/x", None)


def test_every_problem_names_file_field_and_expectation(tmp_path: Path) -> None:
    write(
        tmp_path,
        "both.yaml",
        f"name: a\nversion: '1'\nartifact: https://h/x\npath: /x\nsha256: {SHA}\n",
    )
    write(tmp_path, "nosha.yaml", "name: b\nversion: '1'\nartifact: https://h/x\n")
    write(tmp_path, "http.yaml", f"name: c\nversion: '1'\nartifact: http://h/x\nsha256: {SHA}\n")
    write(tmp_path, "kind.yaml", "name: d\nversion: '1'\npath: /x\nkind: vllm\n")
    write(tmp_path, "name.yaml", "name: llama.3x\nversion: '1'\npath: /x\n")
    write(tmp_path, "extra.yaml", "name: e\nversion: '1'\npath: /x\nurl: y\n")
    write(tmp_path, "rel.yaml", "name: f\nversion: 'a b'\npath: bin/x\n")
    write(tmp_path, "num.yaml", f"name: g\nversion: 1.10\npath: /x\nsha256: {'1' * 64}\n")
    write(tmp_path, "oct.yaml", "name: h\nversion: 0011434\npath: /x\n")
    write(tmp_path, "yes.yaml", "name: i\nversion: yes\npath: /x\n")
    write(
        tmp_path,
        "dollar.yaml",
        f"name: j\nversion: '1'\nsha256: {SHA}\n"
        "artifact: https://h/${node.unique.name}/llama-server\n",
    )
    write(tmp_path, "dollarpath.yaml", "name: k\nversion: '1'\npath: /opt/${meta.x}/bin\n")
    found = problems(tmp_path)
    expected = [
        "both.yaml: (top level): give exactly one of artifact",
        "dollar.yaml: artifact: the artifact URL contains '${', which Nomad would "
        "interpolate, got 'https://h/${node.unique.name}/llama-server'",
        "dollarpath.yaml: path: expected an absolute path on the nodes, got '/opt/${meta.x}/bin'",
        "extra.yaml: url: unknown field (expected one of: name, version, kind, artifact",
        "http.yaml: artifact: expected https://host/path/to/binary, got 'http://h/x'",
        "kind.yaml: kind: unknown engine kind 'vllm' (known: llama.cpp)",
        "name.yaml: name: expected a lower-case name whose dot-separated parts each start",
        "nosha.yaml: (top level): an artifact needs its sha256: nodes run what they download",
        "num.yaml: sha256: YAML read this sha256 as a number: quote it",
        "num.yaml: version: YAML read this version as the number 1.1, not as written: quote it",
        "oct.yaml: version: YAML read this version as the number 4892, not as written: "
        'quote it, e.g. version: "11434"',
        "rel.yaml: path: expected an absolute path on the nodes, got 'bin/x'",
        "rel.yaml: version: expected a version such as 11434",
        "yes.yaml: version: YAML read this version as the bool True, not as written",
    ]
    assert len(found) == len(expected), found
    for line, start in zip(found, expected, strict=True):
        assert line.startswith(f"{tmp_path}/{start}"), (line, start)
    assert found[7].endswith("download")  # a whole-file problem does not echo the file


def test_one_name_in_two_files_and_bad_yaml_are_errors(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "name: a\nversion: '1'\npath: /x\n")
    write(tmp_path, "b.yaml", "name: a\nversion: '2'\npath: /y\n")
    write(tmp_path, "c.yaml", "name: c\nname: d\n")
    write(tmp_path, "d.yaml", "")
    found = problems(tmp_path)
    assert (
        found[0] == f"{tmp_path}/b.yaml: name: engine 'a' is already defined in {tmp_path}/a.yaml"
    )
    assert "key 'name' appears twice" in found[1]
    assert (
        found[2] == f"{tmp_path}/d.yaml: expected a mapping with name, version and artifact or path"
    )
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidDefinitions, match="no engine files"):
        load_engines([tmp_path / "empty"])


def test_the_demos_engine_file_is_valid() -> None:
    folder = Path(__file__).resolve().parents[4] / "engines"
    [(_, engine)] = load_engines([folder]).values()
    assert (engine.name, engine.version, engine.path) == (
        "llama.cpp",
        "11434",
        "/opt/llmgw/bin/llama-server",
    )


def test_a_check_model_is_an_absolute_gguf_path_the_install_can_pass_on(tmp_path: Path) -> None:
    write(
        tmp_path,
        "ok.yaml",
        'name: ok\nversion: "1"\npath: /opt/b/llama-server\n'
        "check_model: /opt/llmgw/models/tiny.gguf\n",
    )
    [(_, ok)] = load_engines([tmp_path / "ok.yaml"]).values()
    assert ok.check_model == "/opt/llmgw/models/tiny.gguf"
    for i, bad in enumerate(
        ["tiny.gguf", "/m/tiny.bin", "/m/a b.gguf", "/m/${x}.gguf", "/m/%{x}.gguf", "/m/'.gguf"]
    ):
        write(
            tmp_path,
            f"bad{i}.yaml",
            f'name: bad{i}\nversion: "1"\npath: /b/x\ncheck_model: "{bad}"\n',
        )
    found = problems(tmp_path)
    assert len(found) == 6, found
    assert all(
        ": check_model: expected an absolute path of a .gguf file on the nodes" in p for p in found
    ), found
