"""Planner settings, read once from the environment by the CLI.

Variables (the HashiCorp ones keep their usual names, so a shell that works
with `nomad` and `consul` works with `planner`):
  NOMAD_ADDR          default http://127.0.0.1:4646
  NOMAD_TOKEN         optional ACL token
  CONSUL_HTTP_ADDR    default 127.0.0.1:8500
  CONSUL_HTTP_TOKEN   optional ACL token
  LLMGW_ENGINES       engine name -> llama-server path on the nodes,
                      "llama.cpp=/opt/llama/bin/llama-server,other=/path";
                      default "llama.cpp=/opt/llmgw/bin/llama-server" (the node
                      layout: engines in /opt/llmgw/bin, models in /opt/llmgw/models;
                      `make bootstrap` links the dev node's there)
  LLMGW_TASK_DRIVER   default raw_exec (what `nomad agent -dev` enables)
  LLMGW_DATACENTERS   comma-separated, default "*" (every datacenter)
  LLMGW_JOBSPEC       default jobspecs/model.nomad.hcl of this checkout
  NOMAD_CACERT, NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY, CONSUL_CACERT,
  CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY
                      TLS files, as the `nomad` and `consul` CLIs read them; the
                      certificates among them are published as expiry metrics
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_JOBSPEC = Path(__file__).resolve().parents[1] / "jobspecs" / "model.nomad.hcl"


def _engines(text: str) -> dict[str, str]:
    engines = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"LLMGW_ENGINES: expected name=path, got {item!r}")
        engines[name.strip()] = path.strip()
    return engines


@dataclass(frozen=True)
class Settings:
    nomad_addr: str = "http://127.0.0.1:4646"
    nomad_token: str | None = None
    consul_addr: str = "127.0.0.1:8500"
    consul_token: str | None = None
    engines: dict[str, str] = field(
        default_factory=lambda: {"llama.cpp": "/opt/llmgw/bin/llama-server"})
    task_driver: str = "raw_exec"
    datacenters: tuple[str, ...] = ("*",)
    jobspec: Path = DEFAULT_JOBSPEC
    # TLS to the agents, under the names the `nomad` and `consul` CLIs read.
    nomad_cacert: str | None = None
    nomad_client_cert: str | None = None
    nomad_client_key: str | None = None
    consul_cacert: str | None = None
    consul_client_cert: str | None = None
    consul_client_key: str | None = None

    def certificate_files(self) -> list[str]:
        """The certificate files configured (CA and client certificates), for the
        certificate expiry metrics; keys are not certificates."""
        return [p for p in (self.nomad_cacert, self.nomad_client_cert, self.consul_cacert,
                            self.consul_client_cert) if p]

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        """Settings from `env` (default os.environ). Raises ValueError on a malformed value."""
        env = dict(os.environ if env is None else env)
        defaults = cls()
        return cls(
            nomad_addr=env.get("NOMAD_ADDR", defaults.nomad_addr),
            nomad_token=env.get("NOMAD_TOKEN") or None,
            consul_addr=env.get("CONSUL_HTTP_ADDR", defaults.consul_addr),
            consul_token=env.get("CONSUL_HTTP_TOKEN") or None,
            engines=_engines(env["LLMGW_ENGINES"]) if "LLMGW_ENGINES" in env
            else defaults.engines,
            task_driver=env.get("LLMGW_TASK_DRIVER", defaults.task_driver),
            datacenters=tuple(d.strip() for d in env.get("LLMGW_DATACENTERS", "*").split(",")),
            jobspec=Path(env.get("LLMGW_JOBSPEC", str(DEFAULT_JOBSPEC))),
            nomad_cacert=env.get("NOMAD_CACERT") or None,
            nomad_client_cert=env.get("NOMAD_CLIENT_CERT") or None,
            nomad_client_key=env.get("NOMAD_CLIENT_KEY") or None,
            consul_cacert=env.get("CONSUL_CACERT") or None,
            consul_client_cert=env.get("CONSUL_CLIENT_CERT") or None,
            consul_client_key=env.get("CONSUL_CLIENT_KEY") or None,
        )
