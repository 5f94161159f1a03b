"""Settings from environment and flags (router.settings)."""

from __future__ import annotations

import pytest

from router.settings import RouterSettings


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
    with pytest.raises(ValueError, match="LLMGW_REPLICA_CONCURRENCY"):
        RouterSettings.from_env({"LLMGW_REPLICA_CONCURRENCY": "many"})
