# llmgw on a production cluster with ACLs and TLS: three routers on port 8080, at
# most one per node (an update's canary takes port 8080 on a node without a router,
# so the cluster needs at least four client nodes; with fewer, leave router_port at
# 0), two planners, the wheel and its dependencies from an internal mirror. The
# jobs reach the agents over https with the CA and client certificates installed
# on every node under /etc/llmgw/tls/ (the agents' CA; a client certificate the
# agents accept), and the planners serve their admin API over HTTPS.
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

  # The local agents' https listeners, and the files the jobs verify them with.
  nomad_addr         = "https://127.0.0.1:4646"
  nomad_cacert       = "/etc/llmgw/tls/nomad-ca.pem"
  nomad_client_cert  = "/etc/llmgw/tls/nomad-cli.pem"
  nomad_client_key   = "/etc/llmgw/tls/nomad-cli-key.pem"
  consul_addr        = "127.0.0.1:8501"
  consul_ssl         = true
  consul_cacert      = "/etc/llmgw/tls/consul-ca.pem"
  consul_client_cert = "/etc/llmgw/tls/consul-cli.pem"
  consul_client_key  = "/etc/llmgw/tls/consul-cli-key.pem"
  planner_cacert     = "/etc/llmgw/tls/llmgw-ca.pem"

  driver           = "exec"
  datacenters      = ["dc1"]
  router_instances = 3
  router_port      = 8080

  planner_settings = {
    LLMGW_ENGINES     = "llama.cpp=/opt/llmgw/bin/llama-server"
    LLMGW_TASK_DRIVER = "exec"
    LLMGW_TLS_CERT    = "/etc/llmgw/tls/planner.pem"
    LLMGW_TLS_KEY     = "/etc/llmgw/tls/planner-key.pem"
    # Followers verify the leader they forward writes to.
    LLMGW_PLANNER_CACERT = "/etc/llmgw/tls/llmgw-ca.pem"
  }
  router_settings = {
    LLMGW_QUEUE_TIMEOUT = "30"
  }
}

output "router_service" {
  description = "Point the load balancer at this Consul service's passing instances."
  value       = module.llmgw.router_service_name
}
