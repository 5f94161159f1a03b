"""Planner settings, read once from the environment by the CLI.

Variables (the HashiCorp ones keep their usual names, so a shell that works
with `nomad` and `consul` works with `planner`):
  NOMAD_ADDR          default http://127.0.0.1:4646; https://... for a TLS agent
  NOMAD_TOKEN         optional ACL token (sent as X-Nomad-Token, event stream included)
  NOMAD_NAMESPACE     the one Nomad namespace the planner manages, default "default":
                      every call it makes (jobs, allocations, evaluations, deployments,
                      the event stream, the ACL checks, engine installs) is in it
                      (`planner.agents.nomad`); a name as Nomad allows it, never "*";
                      one that Nomad does not have is an error at start
  NOMAD_CACERT        CA file (PEM) that verifies Nomad's certificate; default: the
                      system's CAs
  NOMAD_CLIENT_CERT,  client certificate and key (PEM), for an agent with
  NOMAD_CLIENT_KEY    `tls { verify_https_client = true }`; the two go together
  CONSUL_HTTP_ADDR    host:port or http(s)://host:port, default 127.0.0.1:8500
  CONSUL_HTTP_SSL     true: https even when the address has no scheme (Go's
                      strconv.ParseBool spellings: 1/t/true/TRUE/True, 0/f/false...);
                      TLS is never turned off once asked for by either
  CONSUL_HTTP_TOKEN   optional ACL token
  CONSUL_CACERT,      as for Nomad, for Consul (`verify_incoming_https = true` asks
  CONSUL_CLIENT_CERT, for the client certificate)
  CONSUL_CLIENT_KEY
  LLMGW_TLS_CERT,     `planner serve` serves its admin API over HTTPS with this
  LLMGW_TLS_KEY       certificate and key (or --tls-cert/--tls-key); it then
                      advertises https://, the address followers forward writes to
  LLMGW_PLANNER_CACERT
                      CA file that verifies the planners' serving certificates: a
                      follower forwards writes to the leader with it (the router
                      reads the same variable to call the planner); default: the
                      system's CAs
  LLMGW_ENGINES       engine name -> llama-server path on the nodes,
                      "llama.cpp=/opt/llama/bin/llama-server,other=/path";
                      default "llama.cpp=/opt/llmgw/bin/llama-server" (the node
                      layout: engines in /opt/llmgw/bin, models in /opt/llmgw/models;
                      `make bootstrap` links the dev node's there)
                      An engine defined in engines/*.yaml (`planner engines apply`) of
                      the same name wins; these are engines assumed present on every
                      node, neither installed nor checked.
  LLMGW_ENGINE_ROOT   where `planner engines apply` installs artifact engines on the
                      nodes: <root>/<engine>/<version>/; default /opt/llmgw/engines
                      (model jobs run the command the install recorded, whatever
                      `planner apply`'s root)
  LLMGW_ENGINE_NOMAD_ADDR
                      the agent address engine installs record node metadata through
                      (Nomad forwards ?node_id= to the node); default empty: each
                      task's own agent, through the Task API socket
  LLMGW_TASK_DRIVER   default raw_exec (what `nomad agent -dev` enables)
  LLMGW_TASK_USER     the user model tasks run as on the nodes (the task's `user`:
                      raw_exec's and exec's need the Nomad client to run as root, and
                      raw_exec's is no sandbox); default empty: the Nomad client's own
                      user, root under raw_exec. The user must be able to read the
                      model files, run the engine and enter the client's data_dir
                      (0700 as Nomad makes it: chmod 711).
  LLMGW_MODELS_ROOT   the folder file:// model sources must lie in on the nodes, an
                      absolute path, or several joined by ':' (any will do); default
                      /opt/llmgw/models (`planner.spec.sources`)
  LLMGW_DATACENTERS   comma-separated, default "*" (every datacenter)
  LLMGW_JOBSPEC       default planner/jobspecs/model.nomad.hcl (package data)

Every certificate file configured (CAs, client certificates, the serving
certificate; keys are not certificates) is published as expiry metrics
(`llmgw_contract.certificates`). `Settings.validate` loads each configured file
once at start, so a missing file, one that is not PEM, a key without its
certificate or a key that does not match is a ValueError naming the variable
(the CLI's exit 2), not a failure at the first request. `llmgw_contract.tlsfiles` is the one
place this process builds an `ssl.SSLContext`.
"""

from __future__ import annotations

import os
import re
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from llmgw_contract.tlsfiles import tls_context
from planner.spec.sources import DEFAULT_MODELS_ROOT

# Package data (pyproject.toml): an installed wheel carries it too.
# Package data of `planner` (pyproject.toml), one level above this module.
DEFAULT_JOBSPEC = Path(__file__).resolve().parent.parent / "jobspecs" / "model.nomad.hcl"

NOMAD_TLS_VARS = ("NOMAD_CACERT", "NOMAD_CLIENT_CERT", "NOMAD_CLIENT_KEY")
CONSUL_TLS_VARS = ("CONSUL_CACERT", "CONSUL_CLIENT_CERT", "CONSUL_CLIENT_KEY")
PLANNER_CACERT_VAR = "LLMGW_PLANNER_CACERT"
SERVING_TLS_VARS = ("--tls-cert (LLMGW_TLS_CERT)", "--tls-key (LLMGW_TLS_KEY)")

# Go's strconv.ParseBool, which the `consul` CLI applies to CONSUL_HTTP_SSL.
_TRUE = frozenset({"1", "t", "T", "TRUE", "true", "True"})
_FALSE = frozenset({"0", "f", "F", "FALSE", "false", "False"})


def _engines(text: str) -> dict[str, str]:
    engines = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"LLMGW_ENGINES: expected name=path, got {item!r}")
        if "${" in path:
            # The job template runs it as the task's command, which Nomad interpolates.
            raise ValueError(
                f"LLMGW_ENGINES: {item!r} contains '${{', which Nomad would interpolate"
            )
        engines[name.strip()] = path.strip()
    return engines


def _task_user(text: str) -> str:
    """LLMGW_TASK_USER: empty, or a user name as useradd accepts it (shadow-utils'
    default NAME_REGEX, at most 32 characters)."""
    if text and not re.fullmatch(r"[a-z_][a-z0-9_-]{0,30}\$?", text):
        raise ValueError(
            f"LLMGW_TASK_USER: expected a user name such as nobody or llmgw, got {text!r}"
        )
    return text


def _models_root(text: str) -> str:
    parts = text.split(":")
    if any(not p.startswith("/") for p in parts) or any(c in text for c in "\0\n$"):
        raise ValueError(
            f"LLMGW_MODELS_ROOT: expected an absolute path on the nodes (or "
            f"several joined by ':'), got {text!r}"
        )
    return text


def _namespace(text: str) -> str:
    """NOMAD_NAMESPACE: one namespace's name as Nomad allows it (nomad/structs
    `validNamespaceName`: letters, digits and '-', 1 to 128 characters). Not "*": the
    planner manages one namespace, and a model's Consul service name has none."""
    if text == "*":
        raise ValueError(
            "NOMAD_NAMESPACE='*': the planner manages exactly one namespace; "
            "set it to that namespace's name (default: default)"
        )
    if not re.fullmatch(r"[a-zA-Z0-9-]{1,128}", text):
        raise ValueError(
            f"NOMAD_NAMESPACE={text!r} is not a Nomad namespace name "
            "(letters, digits and '-', at most 128)"
        )
    return text


def _bool(name: str, text: str | None) -> bool:
    if not text:
        return False
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise ValueError(f"{name}={text!r} is not a boolean (true/false, 1/0)")


def tls_reason(exc: BaseException) -> str | None:
    """The words of the `ssl` error inside `exc` (requests and python-nomad wrap it two
    or three layers deep, aiohttp one), e.g. "certificate verify failed: unable to get
    local issuer certificate"; None when `exc` is no TLS failure."""
    stack, seen, outer = [exc], set(), None
    while stack:
        error = stack.pop()
        if id(error) in seen:
            continue
        seen.add(id(error))
        # aiohttp's errors are ssl errors too, without the ssl module's attributes set.
        message, reason = getattr(error, "verify_message", None), getattr(error, "reason", None)
        if isinstance(error, ssl.SSLCertVerificationError) and isinstance(message, str):
            return f"certificate verify failed: {message}"
        if isinstance(error, ssl.SSLError) and isinstance(reason, str):
            return reason
        if isinstance(error, ssl.SSLError):
            outer = outer or str(error)
        inner = (
            *error.args,
            reason,
            getattr(error, "nomad_resp", None),
            error.__cause__,
            error.__context__,
        )
        stack.extend(e for e in inner if isinstance(e, BaseException))
    return outer


@dataclass(frozen=True)
class ClientTLS:
    """TLS towards one server (a Nomad or Consul agent, the leader planner): the CA file
    that verifies its certificate (None: the system's CAs) and the client certificate
    and key to present. `agent` and `names` (the three settings) are for messages."""

    agent: str
    names: tuple[str, str, str]
    cacert: str | None = None
    client_cert: str | None = None
    client_key: str | None = None

    @property
    def configured(self) -> bool:
        return bool(self.cacert or self.client_cert or self.client_key)

    @property
    def verify(self) -> str | bool:
        """`verify` for requests (python-nomad, py-consul): the CA file, or True."""
        return self.cacert or True

    @property
    def cert(self) -> tuple[str, str] | None:
        """`cert` for requests: (certificate, key), or None."""
        if self.client_cert and self.client_key:
            return self.client_cert, self.client_key
        return None

    def context(self) -> ssl.SSLContext:
        """The SSLContext for aiohttp; raises ValueError naming a bad setting."""
        return tls_context(self.names, self.cacert, self.client_cert, self.client_key)

    def failure(self, address: str, exc: BaseException) -> str | None:
        """What to tell an operator when `exc` is a failed TLS handshake with `address`
        (which agent, why, and the settings to check); None for any other error."""
        reason = tls_reason(exc)
        if reason is None:
            return None
        paths = list(zip(self.names, (self.cacert, self.client_cert, self.client_key), strict=True))
        given = [f"{name}={path}" for name, path in paths if name and path]
        unset = [name for name, path in paths if name and not path]
        check = [", ".join(given)] if given else []
        if unset:
            check.append(f"not set: {', '.join(unset)}")
        return f"TLS with {self.agent} at {address} failed ({reason}); check {'; '.join(check)}"


@dataclass(frozen=True)
class Settings:
    nomad_addr: str = "http://127.0.0.1:4646"
    nomad_token: str | None = None
    nomad_namespace: str = "default"
    consul_addr: str = "127.0.0.1:8500"
    consul_token: str | None = None
    engines: dict[str, str] = field(
        default_factory=lambda: {"llama.cpp": "/opt/llmgw/bin/llama-server"}
    )
    engine_root: str = "/opt/llmgw/engines"
    engine_nomad_addr: str = ""
    task_driver: str = "raw_exec"
    task_user: str = ""
    models_root: str = DEFAULT_MODELS_ROOT
    datacenters: tuple[str, ...] = ("*",)
    jobspec: Path = DEFAULT_JOBSPEC
    # TLS to the agents, under the names the `nomad` and `consul` CLIs read.
    nomad_cacert: str | None = None
    nomad_client_cert: str | None = None
    nomad_client_key: str | None = None
    consul_ssl: bool = False
    consul_cacert: str | None = None
    consul_client_cert: str | None = None
    consul_client_key: str | None = None
    # `planner serve`'s own HTTPS, and the CA its followers verify the leader with.
    tls_cert: str | None = None
    tls_key: str | None = None
    planner_cacert: str | None = None

    @property
    def nomad_tls(self) -> ClientTLS:
        return ClientTLS(
            "Nomad",
            NOMAD_TLS_VARS,
            self.nomad_cacert,
            self.nomad_client_cert,
            self.nomad_client_key,
        )

    @property
    def consul_tls(self) -> ClientTLS:
        return ClientTLS(
            "Consul",
            CONSUL_TLS_VARS,
            self.consul_cacert,
            self.consul_client_cert,
            self.consul_client_key,
        )

    @property
    def planner_tls(self) -> ClientTLS:
        """TLS towards the leader planner (a follower forwarding a write)."""
        return ClientTLS("the leader planner", (PLANNER_CACERT_VAR, "", ""), self.planner_cacert)

    @property
    def consul_url(self) -> str:
        """`consul_addr` as a URL: https:// when the address says so or `consul_ssl`."""
        raw = self.consul_addr if "://" in self.consul_addr else f"http://{self.consul_addr}"
        url = urlsplit(raw)
        scheme = "https" if self.consul_ssl else url.scheme
        return f"{scheme}://{url.netloc}"

    @property
    def serves_tls(self) -> bool:
        return bool(self.tls_cert)

    def certificate_files(self) -> list[str]:
        """The certificate files configured (CAs, client certificates, the serving
        certificate), for the certificate expiry metrics; keys are not certificates."""
        return [
            p
            for p in (
                self.nomad_cacert,
                self.nomad_client_cert,
                self.consul_cacert,
                self.consul_client_cert,
                self.planner_cacert,
                self.tls_cert,
            )
            if p
        ]

    def validate(self) -> None:
        """Check the addresses and load every configured TLS file once. Raises
        ValueError naming the setting (a missing or unreadable file, not PEM, a key
        without its certificate or one that does not match it)."""
        for name, url in (("NOMAD_ADDR", self.nomad_addr), ("CONSUL_HTTP_ADDR", self.consul_url)):
            parts = urlsplit(url if "://" in url else f"http://{url}")
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{name}={url!r} is not an http(s)://host:port address")
        for tls in (self.nomad_tls, self.consul_tls, self.planner_tls):
            if tls.configured:
                tls.context()
        if self.tls_cert or self.tls_key:
            tls_context(
                ("", *SERVING_TLS_VARS), certfile=self.tls_cert, keyfile=self.tls_key, server=True
            )

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        """Settings from `env` (default os.environ). Raises ValueError on a malformed value
        (files are only read by `validate`)."""
        env = dict(os.environ if env is None else env)
        defaults = cls()
        return cls(
            nomad_addr=env.get("NOMAD_ADDR") or defaults.nomad_addr,
            nomad_token=env.get("NOMAD_TOKEN") or None,
            nomad_namespace=_namespace(env.get("NOMAD_NAMESPACE") or defaults.nomad_namespace),
            consul_addr=env.get("CONSUL_HTTP_ADDR") or defaults.consul_addr,
            consul_token=env.get("CONSUL_HTTP_TOKEN") or None,
            engines=_engines(env["LLMGW_ENGINES"]) if "LLMGW_ENGINES" in env else defaults.engines,
            engine_root=env.get("LLMGW_ENGINE_ROOT") or defaults.engine_root,
            engine_nomad_addr=env.get("LLMGW_ENGINE_NOMAD_ADDR", ""),
            task_driver=env.get("LLMGW_TASK_DRIVER", defaults.task_driver),
            task_user=_task_user(env.get("LLMGW_TASK_USER", "")),
            models_root=_models_root(env.get("LLMGW_MODELS_ROOT") or defaults.models_root),
            datacenters=tuple(d.strip() for d in env.get("LLMGW_DATACENTERS", "*").split(",")),
            jobspec=Path(env.get("LLMGW_JOBSPEC", str(DEFAULT_JOBSPEC))),
            nomad_cacert=env.get("NOMAD_CACERT") or None,
            nomad_client_cert=env.get("NOMAD_CLIENT_CERT") or None,
            nomad_client_key=env.get("NOMAD_CLIENT_KEY") or None,
            consul_ssl=_bool("CONSUL_HTTP_SSL", env.get("CONSUL_HTTP_SSL")),
            consul_cacert=env.get("CONSUL_CACERT") or None,
            consul_client_cert=env.get("CONSUL_CLIENT_CERT") or None,
            consul_client_key=env.get("CONSUL_CLIENT_KEY") or None,
            tls_cert=env.get("LLMGW_TLS_CERT") or None,
            tls_key=env.get("LLMGW_TLS_KEY") or None,
            planner_cacert=env.get(PLANNER_CACERT_VAR) or None,
        )
