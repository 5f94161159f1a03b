"""Names llmgw uses for itself, which no model may take.

A model's name is its Nomad job ID and, as `llmgw-<name>`, its Consul service
(`keys.service_name`). llmgw's own processes use names in the same two spaces:

    Nomad job ID     llmgw-planner           jobspecs/planner.nomad.hcl `job_name` default,
                                             terraform/main.tf `planner_job`
                     llmgw-router            jobspecs/router.nomad.hcl `job_name` default,
                                             terraform/main.tf `router_job`
                     llmgw-engine-<engine>   each engine's install job
                                             (planner/jobspecs/engine.nomad.hcl)
    Consul service   llmgw-planner           every `planner serve` (its leadership check)
                     llmgw-router            the router job's instances

A model named after one of those jobs would be overwritten by deploying llmgw (or
overwrite it) and could read that job's Nomad variables (`nomad/jobs/<job>`: the
planner's tokens); one whose service is llmgw's own would mix its replicas into it.
So `planner apply` refuses them (`planner.spec.definitions`), and the router's 404 for
such a name says why no model has it (`router.errors`). tests/unit/test_reserved_names.py
holds the jobspecs and the Terraform module to these values.
"""

from __future__ import annotations

from llmgw_contract.keys import PLANNER_SERVICE, ROUTER_SERVICE, service_name

# The job IDs the deploy jobspecs (and the Terraform module) give llmgw's own jobs.
PLANNER_JOB = "llmgw-planner"
ROUTER_JOB = "llmgw-router"
# Each engine's install job is this prefix and the engine's name.
ENGINE_JOB_PREFIX = "llmgw-engine-"

_OWN_JOBS = {PLANNER_JOB: "the planner's", ROUTER_JOB: "the router's"}
_OWN_SERVICES = {PLANNER_SERVICE: "the planner's", ROUTER_SERVICE: "the router's"}

RULE = "llmgw keeps the names of its own jobs and services"


def reserved_name(model: str) -> str | None:
    """Why `model` cannot be a model's name, naming the rule and what holds the name,
    e.g. "a model's name is its Nomad job ID, and llmgw-planner is the planner's job
    ID"; None for a name that is free."""
    if model in _OWN_JOBS:
        return (
            f"{RULE}: a model's name is its Nomad job ID, and {model} is {_OWN_JOBS[model]} job ID"
        )
    if model.startswith(ENGINE_JOB_PREFIX):
        return (
            f"{RULE}: a model's name is its Nomad job ID, and {ENGINE_JOB_PREFIX}<engine> "
            "are the job IDs of llmgw's engine installs"
        )
    service = service_name(model)
    if service in _OWN_SERVICES:
        return (
            f"{RULE}: a model's Consul service is llmgw-<name>, and {service} is "
            f"{_OWN_SERVICES[service]} service"
        )
    return None
