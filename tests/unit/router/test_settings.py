"""Settings from environment and flags (router.settings), TLS files checked at start, and
the certificate series on the router's metrics."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.app import create_app
from router.settings import RouterSettings
from tests.support.tls import issue, make_ca


def test_defaults() -> None:
    settings = RouterSettings.from_env({})
    assert (settings.host, settings.port) == ("127.0.0.1", 8080)
    assert settings.consul_location() == ("http", "127.0.0.1", 8500)


def test_environment_and_overrides() -> None:
    settings = RouterSettings.from_env(
        {"CONSUL_HTTP_ADDR": "https://consul.service:8501", "LLMGW_ROUTER_PORT": "9000"}
    )
    assert settings.port == 9000
    assert settings.consul_location() == ("https", "consul.service", 8501)
    flagged = settings.with_overrides(port=None, host="0.0.0.0")
    assert (flagged.host, flagged.port) == ("0.0.0.0", 9000)


def test_bad_number_names_the_variable() -> None:
    with pytest.raises(ValueError, match="LLMGW_ROUTER_PORT"):
        RouterSettings.from_env({"LLMGW_ROUTER_PORT": "eighty"})


def test_activation_settings_from_environment_and_flags() -> None:
    defaults = RouterSettings.from_env({})
    assert defaults.activation and defaults.planner_url == "http://127.0.0.1:4650"
    assert (defaults.activation_window_s, defaults.usage_interval_s) == (45.0, 10.0)
    assert defaults.planner_token is None
    settings = RouterSettings.from_env(
        {
            "LLMGW_PLANNER_URL": "http://planner.service:4650",
            "LLMGW_PLANNER_TOKEN": "s3cret",
            "LLMGW_ACTIVATION_WINDOW": "30",
            "LLMGW_USAGE_INTERVAL": "5",
        }
    )
    assert settings.planner_url == "http://planner.service:4650"
    assert (settings.activation_window_s, settings.usage_interval_s) == (30.0, 5.0)
    assert settings.planner_token == "s3cret" and "s3cret" not in repr(settings)
    settings.validate()
    flagged = settings.with_overrides(activation_window_s=2.5, activation=False)
    assert flagged.activation_window_s == 2.5 and not flagged.activation
    assert not RouterSettings.from_env({"LLMGW_ACTIVATION": "false"}).activation
    with pytest.raises(ValueError, match="LLMGW_ACTIVATION"):
        RouterSettings.from_env({"LLMGW_ACTIVATION": "maybe"})
    with pytest.raises(ValueError, match="planner URL"):
        RouterSettings(planner_url="planner:4650").validate()


def test_planner_url_none_means_no_fixed_planner() -> None:
    """The router job's empty planner_url: only the leader and the instances Consul lists,
    not the default http://127.0.0.1:4650 (found by QA on issue 11)."""
    settings = RouterSettings.from_env({"LLMGW_PLANNER_URL": "none"})
    settings.validate()
    assert settings.fixed_planner_url is None and settings.planner_scheme == "http"
    assert RouterSettings.from_env({}).fixed_planner_url == "http://127.0.0.1:4650"
    https = RouterSettings.from_env({"LLMGW_PLANNER_URL": "https://p:4650"})
    assert https.planner_scheme == "https"


def test_concurrency_and_queue_settings() -> None:
    defaults = RouterSettings.from_env({})
    assert (defaults.replica_concurrency, defaults.default_replica_concurrency) == (0, 4)
    assert defaults.initial_replica_limit == 4 and defaults.queue_timeout_s == 30.0
    settings = RouterSettings.from_env(
        {"LLMGW_REPLICA_CONCURRENCY": "2", "LLMGW_QUEUE_TIMEOUT": "0.5"}
    )
    assert settings.replica_concurrency == 2 and settings.initial_replica_limit == 2
    assert settings.queue_timeout_s == 0.5
    settings.validate()
    flagged = settings.with_overrides(replica_concurrency=0, queue_timeout_s=None)
    assert flagged.replica_concurrency == 0 and flagged.queue_timeout_s == 0.5
    with pytest.raises(ValueError, match="replica concurrency"):
        RouterSettings(replica_concurrency=-1).validate()
    with pytest.raises(ValueError, match="queue timeout"):
        RouterSettings(queue_timeout_s=-1).validate()
    # The planner refuses a usage report with an interval over 300 s (its bound on how
    # old a router's load may be): the router refuses to start with one.
    with pytest.raises(ValueError, match="usage interval"):
        RouterSettings(usage_interval_s=600).validate()
    with pytest.raises(ValueError, match="LLMGW_REPLICA_CONCURRENCY"):
        RouterSettings.from_env({"LLMGW_REPLICA_CONCURRENCY": "many"})


def test_tls_settings_from_environment_and_flags(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    client_cert, client_key = issue(ca, tmp_path, "client", client=True)
    settings = RouterSettings.from_env(
        {
            "CONSUL_HTTP_ADDR": "127.0.0.1:8501",
            "CONSUL_HTTP_SSL": "true",
            "CONSUL_CACERT": str(ca.ca_cert),
            "CONSUL_CLIENT_CERT": str(client_cert),
            "CONSUL_CLIENT_KEY": str(client_key),
            "LLMGW_PLANNER_URL": "https://127.0.0.1:4650",
            "LLMGW_PLANNER_CACERT": str(ca.ca_cert),
        }
    ).with_overrides(tls_cert=str(ca.cert), tls_key=str(ca.key))
    settings.validate()
    assert settings.consul_location() == ("https", "127.0.0.1", 8501)
    assert settings.consul_ssl_context() is not None
    assert settings.planner_ssl_context() is not None
    # Keys are not certificates.
    assert settings.certificate_files() == [
        str(ca.ca_cert),
        str(client_cert),
        str(ca.ca_cert),
        str(ca.cert),
    ]
    plain = RouterSettings.from_env({})
    assert plain.consul_ssl_context() is None and plain.planner_ssl_context() is None
    with pytest.raises(ValueError, match="CONSUL_HTTP_SSL"):
        RouterSettings.from_env({"CONSUL_HTTP_SSL": "maybe"})


def test_bad_tls_files_name_their_variable(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not PEM")
    cases = {
        "CONSUL_CACERT=/nowhere.pem: No such file or directory": {"consul_cacert": "/nowhere.pem"},
        "CONSUL_CLIENT_KEY is set but CONSUL_CLIENT_CERT is not": {
            "consul_client_key": str(ca.key)
        },
        "LLMGW_PLANNER_CACERT=.*not a PEM CA": {"planner_cacert": str(garbage)},
        r"--tls-key \(LLMGW_TLS_KEY\) is set but --tls-cert": {"tls_key": str(ca.key)},
        r"--tls-cert \(LLMGW_TLS_CERT\)=.* do not load": {
            "tls_cert": str(ca.ca_cert),
            "tls_key": str(ca.key),
        },
    }
    for message, change in cases.items():
        with pytest.raises(ValueError, match=message):
            RouterSettings(**change).validate()


def test_cli_exits_2_naming_the_bad_setting(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "router.cli", "serve", "--tls-key", str(tmp_path / "k.pem")],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin"},
    )
    assert run.returncode == 2
    assert "--tls-key (LLMGW_TLS_KEY) is set but --tls-cert (LLMGW_TLS_CERT) is not" in run.stderr
    assert "Traceback" not in run.stderr


def test_the_certificate_series_are_on_the_router_metrics(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    missing = str(tmp_path / "gone.pem")
    app = create_app(
        RouterSettings(activation=False, consul_cacert=str(ca.ca_cert), planner_cacert=missing)
    )
    text = app.state.metrics.exposition()[0].decode()
    assert f'llmgw_certificate_read_success{{path="{ca.ca_cert}"}} 1.0' in text
    assert f'llmgw_certificate_read_success{{path="{missing}"}} 0.0' in text
    assert f'llmgw_certificate_expiry_timestamp_seconds{{path="{ca.ca_cert}"}}' in text
