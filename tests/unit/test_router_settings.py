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
