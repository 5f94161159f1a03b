"""llmgw_contract.reserved: the names llmgw uses for itself are the ones its jobspecs,
engine install job and Terraform module use, and every one of them is refused."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import hcl2
import pytest

from llmgw_contract import (
    ENGINE_JOB_PREFIX,
    PLANNER_JOB,
    PLANNER_SERVICE,
    ROUTER_JOB,
    ROUTER_SERVICE,
    model_from_service,
    reserved_name,
)
from llmgw_contract.reserved import RULE

ROOT = Path(__file__).resolve().parents[3]


def _unquoted(value: Any) -> str:
    """python-hcl2 keeps the quotes of strings."""
    return str(value).strip('"')


def _job_name_default(jobspec: str) -> str:
    variables = hcl2.loads((ROOT / "jobspecs" / jobspec).read_text())["variable"]
    [body] = [
        body
        for block in variables
        for label, body in block.items()
        if _unquoted(label) == "job_name"
    ]
    return _unquoted(body["default"])


def test_the_deploy_jobspecs_default_to_the_reserved_job_ids() -> None:
    assert _job_name_default("planner.nomad.hcl") == PLANNER_JOB
    assert _job_name_default("router.nomad.hcl") == ROUTER_JOB


def test_the_terraform_module_names_the_reserved_jobs_and_service() -> None:
    [local] = hcl2.loads((ROOT / "terraform" / "main.tf").read_text())["locals"]
    assert _unquoted(local["planner_job"]) == PLANNER_JOB
    assert _unquoted(local["router_job"]) == ROUTER_JOB
    assert _unquoted(local["router_service"]) == ROUTER_SERVICE


def test_the_router_job_registers_the_reserved_service() -> None:
    text = (ROOT / "jobspecs" / "router.nomad.hcl").read_text()
    assert re.findall(r'^\s*name\s*=\s*"(llmgw-[^"]+)"', text, re.M) == [ROUTER_SERVICE]


def test_the_engine_install_job_id_is_the_reserved_prefix() -> None:
    text = (ROOT / "planner" / "jobspecs" / "engine.nomad.hcl").read_text()
    assert f'id          = "{ENGINE_JOB_PREFIX}${{var.engine}}"' in text


@pytest.mark.parametrize(
    ("name", "holder"),
    [
        ("llmgw-planner", "llmgw-planner is the planner's job ID"),
        ("llmgw-router", "llmgw-router is the router's job ID"),
        ("llmgw-engine-llama", "llmgw-engine-<engine> are the job IDs of llmgw's engine installs"),
        ("planner", "llmgw-planner is the planner's service"),
        ("router", "llmgw-router is the router's service"),
    ],
)
def test_each_reserved_name_says_the_rule_and_what_holds_it(name: str, holder: str) -> None:
    why = reserved_name(name)
    assert why is not None and why.startswith(RULE) and holder in why


@pytest.mark.parametrize(
    "name", ["gemma", "llmgw-gemma", "planners", "my-router", "llmgw-engines", "engine-llama"]
)
def test_other_names_are_free(name: str) -> None:
    assert reserved_name(name) is None


def test_the_router_takes_no_reserved_service_for_a_model() -> None:
    assert model_from_service(PLANNER_SERVICE) is None
    assert model_from_service(ROUTER_SERVICE) is None
