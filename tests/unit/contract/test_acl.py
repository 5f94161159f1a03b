"""The denial sentence (llmgw_contract.acl) and the planner's check that joins both
agents' answers (planner.agents.access); the agents' own answers are test_acl.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw_contract.acl import (
    CONSUL_KV_WRITE,
    CONSUL_SESSION_WRITE,
    ROUTER_CONSUL_KEYS_NEEDS,
    ROUTER_CONSUL_NEEDS,
    Agent,
    Permission,
    TokenStatus,
    denial,
)
from planner.agents import access
from planner.errors import PermissionDenied


def test_a_valid_token_lacking_a_rule_is_told_which_and_where_the_policy_is() -> None:
    assert denial(
        Agent.NOMAD,
        ['submit-job on namespace "default"'],
        TokenStatus.VALID,
        "acl/nomad/planner.hcl",
        "register job tiny",
    ) == (
        'Nomad denied submit-job on namespace "default" (register job tiny): the token in '
        "NOMAD_TOKEN lacks it; give the token the policy in acl/nomad/planner.hcl "
        "(llmgw's repository)"
    )


def test_an_empty_and_an_unknown_token_are_told_apart() -> None:
    empty = denial(Agent.CONSUL, ["a", "b"], TokenStatus.EMPTY, "acl/consul/router.hcl")
    assert empty.startswith(
        "Consul denied a, b: CONSUL_HTTP_TOKEN is empty, so Consul "
        "applied its anonymous token's policy"
    )
    unknown = denial(
        Agent.CONSUL, ["a"], TokenStatus.UNKNOWN, "acl/consul/router.hcl", detail="ACL not found"
    )
    assert "Consul does not know the token in CONSUL_HTTP_TOKEN (ACL not found)" in unknown


def test_consul_rules_are_asked_as_the_authorize_endpoint_takes_them() -> None:
    assert CONSUL_KV_WRITE.authorize_request() == {
        "Resource": "key",
        "Segment": "llmgw/",
        "Access": "write",
    }
    assert [p.rule for p in ROUTER_CONSUL_NEEDS] == [
        'key_prefix "llmgw/" read',
        'service_prefix "llmgw-" read',
        'node_prefix "" read',
        'session_prefix "" read',
    ]
    # Only with LLMGW_API_KEYS_CONSUL; a rule of acl/consul/router.hcl all the same.
    (keys,) = ROUTER_CONSUL_KEYS_NEEDS
    assert keys.authorize_request() == {
        "Resource": "key",
        "Segment": "llmgw-router/api-keys",
        "Access": "read",
    }
    policy = (Path(__file__).resolve().parents[3] / "acl/consul/router.hcl").read_text()
    assert 'key "llmgw-router/api-keys" {\n  policy = "read"\n}' in policy


class _Agent:
    def __init__(self, denied: list[Permission]) -> None:
        self._denied = denied

    def denied(self, needs: list[Permission]) -> tuple[list[Permission], TokenStatus, str] | None:
        found = [p for p in needs if p in self._denied]
        return (found, TokenStatus.VALID, "") if found else None


def test_check_names_what_both_agents_deny_in_one_error() -> None:
    nomad = _Agent([access.NOMAD_SUBMIT_JOB])
    consul = _Agent([CONSUL_SESSION_WRITE])
    with pytest.raises(PermissionDenied) as denied:
        access.check(nomad, consul, access.SERVE)  # type: ignore[arg-type]
    assert denied.value.exit_code == 3
    assert denied.value.rules == ['submit-job on namespace "default"', 'session_prefix "" write']
    assert "acl/nomad/planner.hcl" in str(denied.value)
    assert "; and Consul denied" in str(denied.value)
    access.check(_Agent([]), _Agent([]), access.SERVE)  # type: ignore[arg-type]
