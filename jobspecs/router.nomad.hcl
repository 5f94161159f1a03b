# llmgw's router as a Nomad service job: `router serve`, `instances` of them,
# each registered in Consul as the service `llmgw-router` with an HTTP check on
# its /health (200 once it has read the models, services and states from
# Consul). Clients (or the load balancer in front) send to the passing
# instances of that service.
#
#   nomad job run -var wheel_url=https://pkgs.example.com/llmgw-0.1.0-py3-none-any.whl \
#     -var instances=3 jobspecs/router.nomad.hcl
#
# An update is a Nomad deployment gated on that check: `canaries` new instances
# start beside the old ones and are promoted once each has passed its check for
# `min_healthy_time`; then the rest are replaced `max_parallel` at a time, each
# new one healthy before the next old one stops. A stopping instance leaves
# Consul `shutdown_delay` before it gets its signal, and drains what it still
# serves, so a client that follows the passing instances sees no failed request
# (tests/integration/test_deploy_jobs.py). A canary that never passes reverts
# the job.
#
# PEM files may also come from the Nomad variable as items <VARIABLE>_PEM (see
# planner.nomad.hcl and `tls_files` below).
#
# Install, tokens and settings work as in planner.nomad.hcl: the wheel is an
# artifact pip-installed into a venv in the allocation; tokens are the items of
# the Nomad variable nomad/jobs/<job_name> (CONSUL_HTTP_TOKEN, and
# LLMGW_PLANNER_TOKEN, the planner's LLMGW_ADMIN_TOKEN), which must exist before
# the job starts; settings are Consul KV keys <config_prefix>/<job_name>/LLMGW_*
# (LLMGW_QUEUE_TIMEOUT, LLMGW_REPLICA_CONCURRENCY...), read when an instance
# starts. Change `settings_version` to roll them out.

variable "job_name" {
  type        = string
  default     = "llmgw-router"
  description = "The job ID; also names the Nomad variable (nomad/jobs/<job_name>) and the settings' KV folder."
}

variable "datacenters" {
  type        = list(string)
  default     = ["*"]
  description = "Datacenters the router may run in."
}

variable "node_pool" {
  type        = string
  default     = "default"
  description = "Nomad node pool the router runs in."
}

variable "instances" {
  type        = number
  default     = 2
  description = "Router instances."
}

variable "port" {
  type        = number
  default     = 0
  description = "Static port for every instance (one instance per node then); 0: a dynamic port each, found through Consul."
}

variable "wheel_url" {
  type        = string
  description = "URL of the llmgw wheel (llmgw-<version>-py3-none-any.whl); Nomad's artifact downloader fetches it, so http(s)://, s3:: and the other go-getter forms work."
}

variable "wheel_sha256" {
  type        = string
  default     = ""
  description = "Expected sha256 of the wheel; empty skips the check."
}

variable "pip_index_url" {
  type        = string
  default     = ""
  description = "Package index for the wheel's dependencies; empty: pip's own configuration on the node."
}

variable "wheelhouse_url" {
  type        = string
  default     = ""
  description = "A folder of dependency wheels (an HTTP directory listing or a path on the node); when set, pip installs only from it (--no-index --find-links)."
}

variable "python" {
  type        = string
  default     = "python3"
  description = "Python >= 3.11 on the node that creates the venv."
}

variable "driver" {
  type        = string
  default     = "raw_exec"
  description = "Task driver: raw_exec (the dev cluster's) or exec."
}

variable "consul_addr" {
  type        = string
  default     = "127.0.0.1:8500"
  description = "Consul HTTP API, host:port or http(s)://host:port (CONSUL_HTTP_ADDR), as seen from the node."
}

# TLS to Consul and to the planners: the variables the router reads
# (router/settings.py), under the `consul` CLI's names. Paths of PEM files on the
# node; empty: not set.

variable "consul_ssl" {
  type        = bool
  default     = false
  description = "CONSUL_HTTP_SSL: https to Consul even when consul_addr has no scheme."
}

variable "consul_cacert" {
  type        = string
  default     = ""
  description = "CONSUL_CACERT: CA file (PEM, a path on the node) that verifies an https Consul's certificate; empty: the system's CAs."
}

variable "consul_client_cert" {
  type        = string
  default     = ""
  description = "CONSUL_CLIENT_CERT: client certificate (PEM, a path on the node) for a Consul with verify_incoming_https; with consul_client_key."
}

variable "consul_client_key" {
  type        = string
  default     = ""
  description = "CONSUL_CLIENT_KEY: the client certificate's private key (PEM, a path on the node)."
}

variable "planner_cacert" {
  type        = string
  default     = ""
  description = "LLMGW_PLANNER_CACERT: CA file (PEM, a path on the node) that verifies planners serving HTTPS; set, the llmgw-planner instances Consul lists are called over https."
}

variable "serves_https" {
  type        = bool
  default     = false
  description = "The router serves HTTPS (LLMGW_TLS_CERT and LLMGW_TLS_KEY in its settings): its Consul check asks /health over https."
}

variable "planner_url" {
  type        = string
  default     = ""
  description = "A planner's admin API tried before Consul names the leader (LLMGW_PLANNER_URL); empty: only the leader and the llmgw-planner instances Consul lists."
}

variable "config_prefix" {
  type        = string
  default     = "llmgw-config"
  description = "Consul KV folder of the settings: <config_prefix>/<job_name>/<VARIABLE>."
}

variable "settings_version" {
  type        = string
  default     = "0"
  description = "Any string; change it to roll the settings and tokens out to every instance (a deployment)."
}

variable "canaries" {
  type        = number
  default     = 1
  description = "New instances started beside the old ones at an update, before any old one stops."
}

variable "max_parallel" {
  type        = number
  default     = 1
  description = "Old instances replaced at a time once the canaries are promoted."
}

variable "min_healthy_time" {
  type        = string
  default     = "10s"
  description = "How long a new instance must pass its check before it counts as healthy."
}

variable "healthy_deadline" {
  type        = string
  default     = "10m"
  description = "How long a new instance may take (venv install included) to become healthy before the update is reverted."
}

variable "shutdown_delay" {
  type        = string
  default     = "5s"
  description = "Time between leaving Consul and the stop signal, for clients and load balancers to drop the instance."
}

variable "drain_timeout_s" {
  type        = number
  default     = 30
  description = "Seconds a stopping router lets its requests finish (--drain-timeout); the kill timeout is 5 s more."
}

variable "cpu" {
  type        = number
  default     = 500
  description = "MHz for the router task."
}

variable "memory_mb" {
  type        = number
  default     = 512
  description = "MiB for the router task."
}

variable "install_cpu" {
  type        = number
  default     = 200
  description = "MHz for the install task (pip), which runs before the router task and frees its share when done."
}

variable "install_memory_mb" {
  type        = number
  default     = 512
  description = "MiB for the install task (pip)."
}

variable "args" {
  type        = list(string)
  default     = []
  description = "Extra `router serve` arguments, one argv element each."
}

variable "log_level" {
  type        = string
  default     = "info"
  description = "debug, info, warning or error."
}

locals {
  # pip's sources: a wheelhouse alone, or an index, or the node's own pip configuration.
  pip_sources = concat(
    var.wheelhouse_url != "" ? ["--no-index", "--find-links", var.wheelhouse_url] : [],
    var.pip_index_url != "" ? ["--index-url", var.pip_index_url] : [],
  )

  # Run as `sh -c SCRIPT install PYTHON PIP-ARGS...`, so no value is quoted into
  # shell code. The venv lives in the allocation directory, shared by the tasks.
  # The PEM files an item <VARIABLE>_PEM of the Nomad variable may carry (written to
  # secrets/, the variable pointed at it); what the router reads (router/settings.py).
  tls_files = ["CONSUL_CACERT", "CONSUL_CLIENT_CERT", "CONSUL_CLIENT_KEY", "LLMGW_TLS_CERT", "LLMGW_TLS_KEY", "LLMGW_PLANNER_CACERT"]

  install_script = <<-EOT
  set -eu
  python="$1"; shift
  venv="$NOMAD_ALLOC_DIR/venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check --no-compile --quiet "$@" local/dist/*.whl
  EOT

  # Consul's address and TLS files and the planners', as the router reads them; an
  # empty one is left out (the router's default). No planner_url: "none", the router's
  # word for no fixed planner (only the leader and the instances Consul lists).
  agent_env = { for name, value in {
    CONSUL_HTTP_ADDR     = var.consul_addr
    CONSUL_HTTP_SSL      = var.consul_ssl ? "true" : ""
    CONSUL_CACERT        = var.consul_cacert
    CONSUL_CLIENT_CERT   = var.consul_client_cert
    CONSUL_CLIENT_KEY    = var.consul_client_key
    LLMGW_PLANNER_CACERT = var.planner_cacert
    LLMGW_PLANNER_URL    = var.planner_url != "" ? var.planner_url : "none"
  } : name => value if value != "" }
}

job "router" {
  id          = var.job_name
  name        = var.job_name
  type        = "service"
  datacenters = var.datacenters
  node_pool   = var.node_pool

  group "router" {
    count = var.instances

    spread {
      attribute = "$${node.unique.id}"
    }

    meta {
      llmgw_settings_version = var.settings_version
    }

    network {
      port "http" {
        static = var.port
      }
    }

    update {
      max_parallel      = var.max_parallel
      canary            = var.canaries
      auto_promote      = var.canaries > 0
      auto_revert       = true
      health_check      = "checks"
      min_healthy_time  = var.min_healthy_time
      healthy_deadline  = var.healthy_deadline
      progress_deadline = "15m"
    }

    restart {
      attempts = 3
      interval = "5m"
      delay    = "5s"
      mode     = "delay"
    }

    task "install" {
      driver = var.driver

      lifecycle {
        hook    = "prestart"
        sidecar = false
      }

      artifact {
        source      = var.wheel_url
        destination = "local/dist"

        dynamic "options" {
          for_each = var.wheel_sha256 != "" ? [var.wheel_sha256] : []
          content {
            checksum = "sha256:${options.value}"
          }
        }
      }

      config {
        command = "/bin/sh"
        args    = concat(["-c", local.install_script, "install", var.python], local.pip_sources)
      }

      resources {
        cpu    = var.install_cpu
        memory = var.install_memory_mb
      }
    }

    task "router" {
      driver = var.driver

      # Out of Consul first, then SIGTERM: the router stops accepting, drains its
      # open requests for up to drain_timeout_s, and exits 0.
      shutdown_delay = var.shutdown_delay
      kill_signal    = "SIGTERM"
      kill_timeout   = "${var.drain_timeout_s + 5}s"

      config {
        command = "$${NOMAD_ALLOC_DIR}/venv/bin/router"
        args = concat([
          "serve",
          "--host", "$${NOMAD_IP_http}",
          "--port", "$${NOMAD_PORT_http}",
          "--drain-timeout", format("%d", var.drain_timeout_s),
          "--log-level", var.log_level,
        ], var.args)
      }

      # The request bodies held at once: half the task's memory. Under raw_exec the
      # router sees no cgroup limit, so its own default (a quarter of the node's
      # memory, at most 1 GiB) could exceed what the task reserves. A KV setting of
      # the same name (local/settings.env, rendered later) still wins.
      env = merge(local.agent_env, {
        LLMGW_ROUTER_MAX_BODIES_BYTES = format("%d", var.memory_mb * 524288)
      })

      # In the task, so Nomad deregisters it when the task stops (before the
      # shutdown delay) and registers it again at each start. The name is
      # llmgw_contract's ROUTER_SERVICE: planner and router never take it for a
      # model's service.
      service {
        name     = "llmgw-router"
        port     = "http"
        provider = "consul"
        tags     = ["llmgw", "router"]

        # Over https when the router serves it, without verifying the certificate: the
        # check asks only whether it answers; clients verify it.
        check {
          type            = "http"
          protocol        = var.serves_https ? "https" : "http"
          tls_skip_verify = var.serves_https
          path            = "/health"
          interval        = "2s"
          timeout         = "2s"
        }
      }

      # A PEM file from an item <VARIABLE>_PEM, and <VARIABLE> pointing at it (only for
      # the items there are: the files of the others stay empty and unnamed).
      dynamic "template" {
        for_each = local.tls_files
        content {
          destination = "secrets/${lower(template.value)}.pem"
          perms       = "0600"
          change_mode = "noop"
          data        = <<-EOT
          {{- with nomadVar "nomad/jobs/${var.job_name}" }}{{ range .Tuples }}{{ if eq .K "${template.value}_PEM" }}{{ .V }}{{ end }}{{ end }}{{ end }}
          EOT
        }
      }

      template {
        destination = "secrets/tls.env"
        env         = true
        change_mode = "noop"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/${var.job_name}" }}{{ range .Tuples }}{{ if .K | regexMatch "^(CONSUL_CACERT|CONSUL_CLIENT_CERT|CONSUL_CLIENT_KEY|LLMGW_TLS_CERT|LLMGW_TLS_KEY|LLMGW_PLANNER_CACERT)_PEM$" }}
        {{ .K | trimSuffix "_PEM" }}={{ env "NOMAD_SECRETS_DIR" }}/{{ .K | trimSuffix "_PEM" | toLower }}.pem{{ end }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "secrets/tokens.env"
        env         = true
        change_mode = "noop"
        data        = <<-EOT
        {{- with nomadVar "nomad/jobs/${var.job_name}" }}{{ range .Tuples }}{{ if .K | regexMatch "_TOKEN$" }}
        {{ .K }}={{ .V | toJSON }}{{ end }}{{ end }}{{ end }}
        EOT
      }

      template {
        destination = "local/settings.env"
        env         = true
        change_mode = "noop"
        data        = <<-EOT
        {{- range ls "${var.config_prefix}/${var.job_name}" }}{{ if .Key | regexMatch "^LLMGW_[A-Z0-9_]+$" }}{{ if not (.Key | regexMatch "_TOKEN$") }}
        {{ .Key }}={{ .Value | toJSON }}{{ end }}{{ end }}{{ end }}
        EOT
      }

      resources {
        cpu    = var.cpu
        memory = var.memory_mb
      }
    }
  }
}
