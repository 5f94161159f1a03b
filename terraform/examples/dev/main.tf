# llmgw on the dev cluster of `make demo` (no ACLs): the wheel built from this
# checkout, served from dist/ on the same machine.
#
#   .venv/bin/pip wheel --no-deps -w dist . && .venv/bin/pip wheel -w dist/wheelhouse dist/llmgw-*.whl
#   python3 -m http.server -b 127.0.0.1 -d dist 8000 &
#   tofu init && tofu apply

terraform {
  required_version = ">= 1.5"
}

variable "dist_url" {
  type        = string
  default     = "http://127.0.0.1:8000"
  description = "The http server above, serving dist/."
}

provider "nomad" {
  address = "http://127.0.0.1:4646"
}

provider "consul" {
  address = "127.0.0.1:8500"
}

module "llmgw" {
  source = "../.."

  wheel_url      = "${var.dist_url}/llmgw-0.1.0-py3-none-any.whl"
  wheelhouse_url = "${var.dist_url}/wheelhouse/"
  acl_enabled    = false

  # Two of each on one node: dynamic ports, found through Consul. Small CPU shares,
  # so a model's rolling update (the demo model asks 2000 MHz) still fits beside
  # them on a two-core machine (README.md, "A small dev cluster").
  planner_instances = 2
  router_instances  = 2
  planner_cpu       = 100
  router_cpu        = 200
  install_cpu       = 100

  planner_settings = {
    LLMGW_ENGINES = "llama.cpp=/opt/llmgw/bin/llama-server"
  }
}

output "router_service" {
  description = "The routers' Consul service: `consul catalog nodes -service=llmgw-router`."
  value       = module.llmgw.router_service_name
}
