# llmgw on a production cluster with ACLs: three routers on port 8080 (one per
# node), two planners, the wheel and its dependencies from an internal mirror.
#
#   export NOMAD_TOKEN=... CONSUL_HTTP_TOKEN=...   # tokens that may manage ACLs, KV, jobs
#   tofu init && tofu apply

terraform {
  required_version = ">= 1.5"
}

provider "nomad" {
  address = "https://nomad.service.consul:4646"
}

provider "consul" {
  address = "consul.service.consul:8501"
  scheme  = "https"
}

module "llmgw" {
  # From a clone of the repository; or "git::https://git.example.com/llmgw.git//terraform?ref=v0.1.0".
  source = "../.."

  wheel_url     = "https://pkgs.example.com/llmgw/llmgw-0.1.0-py3-none-any.whl"
  wheel_sha256  = "0000000000000000000000000000000000000000000000000000000000000000"
  pip_index_url = "https://pkgs.example.com/pypi/simple"

  driver           = "exec"
  datacenters      = ["dc1"]
  router_instances = 3
  router_port      = 8080

  planner_settings = {
    LLMGW_ENGINES     = "llama.cpp=/opt/llmgw/bin/llama-server"
    LLMGW_TASK_DRIVER = "exec"
  }
  router_settings = {
    LLMGW_QUEUE_TIMEOUT = "30"
  }
}

output "router_service" {
  description = "Point the load balancer at this Consul service's passing instances."
  value       = module.llmgw.router_service_name
}
