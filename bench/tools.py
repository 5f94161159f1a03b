"""The side-by-side bench's outside programs, installed once into ~/.cache/llmgw/bench.

Used by ``bench/side_by_side.py``. Each returns ``None`` with a reason when it
cannot be had, so the bench runs without it and says why:

- :func:`wrk` and :func:`nginx`: Debian (bookworm) packages, as the bootstrap
  installs prometheus (devcluster/bootstrap.py): ``apt-get download`` with
  this machine's apt sources, ``dpkg-deb -x``, the binary kept under
  ``~/.cache/llmgw/bench/debian``. wrk needs LuaJIT, shipped beside it from its
  own package and found through ``LD_LIBRARY_PATH``; nginx's libraries (PCRE2,
  OpenSSL, zlib, libcrypt) are in the base system.
- :func:`litellm`: the LiteLLM proxy in a venv of its own
  (``~/.cache/llmgw/bench/litellm-venv``), never in the project's. Pinned to
  :data:`LITELLM_VERSION`: 1.107.0 was a compromised release, never installed;
  1.109 and later need ``litellm-proxy``, which the package index here does not
  carry, so the last release whose wheel still holds the proxy is taken, with
  its ``proxy`` extra's requirements less the two packages the index lacks
  (``litellm-proxy-extras``: database migrations; ``litellm-enterprise``), which a
  proxy with no database and no enterprise features does not import.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from _support import REPO

sys.path.insert(0, str(REPO))

from devcluster.bootstrap import CACHE, run

HOME = CACHE / "bench"
DEBIAN = HOME / "debian"
LOGS = CACHE / "logs"

LITELLM_VERSION = "1.108.14"
assert LITELLM_VERSION != "1.107.0", "1.107.0 was a compromised release"
# The proxy extra of litellm 1.108.14 (its wheel's METADATA), less
# litellm-proxy-extras and litellm-enterprise (not on the index; unused here).
LITELLM_PROXY_NEEDS = (
    "uvicorn>=0.33.0,<1.0",
    "uvloop>=0.22.1,<1.0",
    "fastapi>=0.136.3,<1.0",
    "starlette>=1.0.1,<2.0",
    "backoff>=2.2.1,<3.0",
    "pyyaml>=6.0.3,<7.0",
    "rq>=2.7.0,<3.0",
    "orjson>=3.11.6,<4.0",
    "hiredis>=3.0.0,<4.0",
    "apscheduler>=3.11.2,<4.0",
    "fastapi-sso>=0.19.0,<1.0",
    "pyjwt>=2.13.0,<3.0",
    "python-multipart>=0.0.27,<1.0",
    "cryptography>=49.0.0,<51.0",
    "pynacl>=1.6.2,<2.0",
    "websockets>=15.0.1,<16.0",
    "gunicorn>=23.0.0,<24.0",
    "mcp>=2.3.0,<3",
    "restrictedpython>=8.5,<9.0",
    "rich>=13.9.4,<14.0",
    "polars>=1.38.1,<2.0",
    "expression>=5.6.0,<6.0",
)


def _debian(packages: tuple[str, ...], log: Path) -> Path:
    """``packages`` downloaded and extracted into :data:`DEBIAN`; that root."""
    # dpkg-deb -x creates the last directory only ("failed to create directory" on a
    # machine where ~/.cache/llmgw/bench is not there yet).
    DEBIAN.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        # Sandbox user root: apt's _apt user cannot write into our private temp dir.
        run(
            ["apt-get", "-oAPT::Sandbox::User=root", "download", *packages],
            cwd=Path(tmp),
            log=log,
            append=True,
        )
        for deb in sorted(Path(tmp).glob("*.deb")):
            run(["dpkg-deb", "-x", str(deb), str(DEBIAN)], log=log, append=True)
    return DEBIAN


def _works(cmd: list[str], env: dict[str, str] | None = None) -> bool:
    try:
        return subprocess.run(cmd, capture_output=True, timeout=30, env=env).returncode in (0, 1)
    except OSError:
        return False


def _install(binary: Path, packages: tuple[str, ...], check: list[str], env=None) -> str | None:
    """Install ``packages`` unless ``binary`` already runs; ``None``, else why not."""
    if binary.exists() and _works(check, env):
        return None
    log = LOGS / f"bench-{binary.name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("")
    try:
        _debian(packages, log)
    except SystemExit as exc:
        return f"apt-get download {' '.join(packages)} failed: {str(exc).splitlines()[0]}"
    return None if _works(check, env) else f"{binary} does not run (log {log})"


def wrk() -> tuple[list[str], dict[str, str]] | str:
    """wrk's command and environment, else why it is not available."""
    binary = DEBIAN / "usr/bin/wrk"
    env = {**os.environ, "LD_LIBRARY_PATH": str(DEBIAN / "usr/lib/x86_64-linux-gnu")}
    why = _install(binary, ("wrk", "libluajit-5.1-2"), [str(binary), "--version"], env)
    return why if why else ([str(binary)], env)


def nginx() -> Path | str:
    """nginx's binary, else why it is not available."""
    binary = DEBIAN / "usr/sbin/nginx"
    why = _install(binary, ("nginx",), [str(binary), "-v"])
    return why if why else binary


def litellm() -> Path | str:
    """The ``litellm`` command of its own venv, else why it is not available."""
    venv = HOME / "litellm-venv"
    command = venv / "bin" / "litellm"
    stamp = venv / f".installed-{LITELLM_VERSION}"
    if stamp.exists() and command.exists():
        return command
    log = LOGS / "bench-litellm.log"
    try:
        if not (venv / "bin" / "python").exists():
            run([sys.executable, "-m", "venv", str(venv)], log=log)
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        run([*pip, f"litellm=={LITELLM_VERSION}", *LITELLM_PROXY_NEEDS], log=log, append=True)
    except SystemExit as exc:
        return f"pip install litellm=={LITELLM_VERSION} failed: {str(exc).splitlines()[0]}"
    stamp.write_text("")
    return command
