# llmgw's planner as a Nomad service job: `planner serve`, two instances by
# default. They elect a leader through a Consul session lock on `llmgw/leader`
# (planner/daemon/leader.py); the other stands by, answers reads and forwards writes,
# and takes over within about 8 s when the leader's allocation is lost.
#
#   nomad job run -var wheel_url=https://pkgs.example.com/llmgw-0.1.0-py3-none-any.whl \
#     jobspecs/planner.nomad.hcl
#
# Install: a prestart task fetches the llmgw wheel (an artifact) and pip-installs
# it into a venv in the allocation directory, with its dependencies from the
# package index (or only from a wheelhouse, `wheelhouse_url`); the planner runs
# from that venv. So the node needs a Python >= 3.11 (`python`, default `python3`), nothing else.
#
# Tokens never appear here. They are the items of the Nomad variable
# `nomad/jobs/<job_name>` (which the job's tasks may read without any policy),
# named as the environment variables the planner reads:
#
#   nomad var put nomad/jobs/llmgw-planner NOMAD_TOKEN=... CONSUL_HTTP_TOKEN=... \
#     LLMGW_ADMIN_TOKEN=...
#
# PEM files can travel the same way, for nodes that do not hold them: an item
# <VARIABLE>_PEM (one of NOMAD_CACERT_PEM, NOMAD_CLIENT_CERT_PEM, NOMAD_CLIENT_KEY_PEM,
# ...; see `tls_files` below) holds the PEM text; the job writes it to
# secrets/<variable>.pem and sets <VARIABLE> to that file. Give each file one way
# only: a _PEM item or the path variable (or, for LLMGW_*, the KV setting).
#
#   nomad var put nomad/jobs/llmgw-planner CONSUL_CACERT_PEM=@consul-ca.pem ...
#
# The variable must exist (with at least one item) before the job starts: the
# template waits for it. Other settings (LLMGW_ENGINES, LLMGW_TASK_DRIVER,
# LLMGW_DATACENTERS...) are Consul KV keys under `<config_prefix>/<job_name>/`,
# one key per environment variable; only LLMGW_* keys not ending in _TOKEN are
# taken:
#
#   consul kv put llmgw-config/llmgw-planner/LLMGW_ENGINES llama.cpp=/opt/llmgw/bin/llama-server
#
# Both are read when an allocation starts (change_mode noop): restarting every
# instance at once on a change would leave no leader for a while. A change
# reaches the instances through a deployment: change `settings_version` (the
# Terraform module in terraform/ passes a hash of the settings and the tokens'
# accessor IDs), and Nomad replaces the instances one at a time.

variable "job_name" {
  type        = string
  default     = "llmgw-planner"
  description = "The job ID; also names the Nomad variable (nomad/jobs/<job_name>) and the settings' KV folder."
}

variable "datacenters" {
  type        = list(string)
  default     = ["*"]
  description = "Datacenters the planner may run in."
}

variable "node_pool" {
  type        = string
  default     = "default"
  description = "Nomad node pool the planner runs in."
}

variable "instances" {
  type        = number
  default     = 2
  description = "Planner instances: one leader, the others standing by."
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

variable "nomad_addr" {
  type        = string
  default     = "http://127.0.0.1:4646"
  description = "Nomad HTTP API the planner talks to (NOMAD_ADDR), as seen from the node."
}

variable "consul_addr" {
  type        = string
  default     = "127.0.0.1:8500"
  description = "Consul HTTP API, host:port or http(s)://host:port (CONSUL_HTTP_ADDR), as seen from the node: the agent the planner registers its service and leadership check with."
}

# TLS to the agents: the variables the planner reads (planner/spec/settings.py), under the
# names of the `nomad` and `consul` CLIs. Paths of PEM files on the node (e.g. the
# client agent's own certificates, for an exec task mounted into the task's view);
# empty: not set. With `verify_https_client`/`verify_incoming_https` on the agents,
# give the client certificate and key too.

variable "nomad_cacert" {
  type        = string
  default     = ""
  description = "NOMAD_CACERT: CA file (PEM, a path on the node) that verifies an https nomad_addr's certificate; empty: the system's CAs."
}

variable "nomad_client_cert" {
  type        = string
  default     = ""
  description = "NOMAD_CLIENT_CERT: client certificate (PEM, a path on the node) for a Nomad agent that asks for one; with nomad_client_key."
}

variable "nomad_client_key" {
  type        = string
  default     = ""
  description = "NOMAD_CLIENT_KEY: the client certificate's private key (PEM, a path on the node)."
}

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

variable "config_prefix" {
  type        = string
  default     = "llmgw-config"
  description = "Consul KV folder of the settings: <config_prefix>/<job_name>/<VARIABLE>. Outside llmgw/, the planner's own state."
}

variable "settings_version" {
  type        = string
  default     = "0"
  description = "Any string; change it to roll the settings and tokens out to every instance (job meta)."
}

variable "cpu" {
  type        = number
  default     = 200
  description = "MHz for the planner task (mostly waiting on the agents' HTTP APIs)."
}

variable "memory_mb" {
  type        = number
  default     = 512
  description = "MiB for the planner task."
}

variable "install_cpu" {
  type        = number
  default     = 200
  description = "MHz for the install task (pip), which runs before the planner task and frees its share when done."
}

variable "install_memory_mb" {
  type        = number
  default     = 512
  description = "MiB for the install task (pip)."
}

variable "args" {
  type        = list(string)
  default     = []
  description = "Extra `planner serve` arguments, one argv element each, e.g. [\"--park-after\", \"5\"]."
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
  # The agents' addresses and TLS files, as the planner reads them; an empty one is
  # left out (the planner's default).
  agent_env = { for name, value in {
    NOMAD_ADDR         = var.nomad_addr
    NOMAD_CACERT       = var.nomad_cacert
    NOMAD_CLIENT_CERT  = var.nomad_client_cert
    NOMAD_CLIENT_KEY   = var.nomad_client_key
    CONSUL_HTTP_ADDR   = var.consul_addr
    CONSUL_HTTP_SSL    = var.consul_ssl ? "true" : ""
    CONSUL_CACERT      = var.consul_cacert
    CONSUL_CLIENT_CERT = var.consul_client_cert
    CONSUL_CLIENT_KEY  = var.consul_client_key
  } : name => value if value != "" }

  # The PEM files an item <VARIABLE>_PEM of the Nomad variable may carry (written to
  # secrets/, the variable pointed at it); what the planner reads (planner/spec/settings.py).
  tls_files = ["NOMAD_CACERT", "NOMAD_CLIENT_CERT", "NOMAD_CLIENT_KEY", "CONSUL_CACERT", "CONSUL_CLIENT_CERT", "CONSUL_CLIENT_KEY", "LLMGW_TLS_CERT", "LLMGW_TLS_KEY", "LLMGW_PLANNER_CACERT"]

  install_script = <<-EOT
  set -eu
  python="$1"; shift
  venv="$NOMAD_ALLOC_DIR/venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --disable-pip-version-check --no-compile --quiet "$@" local/dist/*.whl
  EOT
}

job "planner" {
  id          = var.job_name
  name        = var.job_name
  type        = "service"
  datacenters = var.datacenters
  node_pool   = var.node_pool

  group "planner" {
    count = var.instances

    # Two instances on two nodes when there are two: a lost node costs the
    # leader at most, and the standby takes over.
    spread {
      attribute = "$${node.unique.id}"
    }

    meta {
      llmgw_settings_version = var.settings_version
    }

    network {
      port "admin" {}
    }

    # One instance at a time, each healthy for 10 s before the next: the other
    # keeps (or takes) the lock meanwhile. The deadline covers the venv install.
    update {
      max_parallel      = 1
      health_check      = "task_states"
      min_healthy_time  = "10s"
      healthy_deadline  = "10m"
      progress_deadline = "15m"
      auto_revert       = true
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

    task "planner" {
      driver = var.driver

      # The leader releases its lock on SIGINT, so the standby takes over at once.
      kill_signal  = "SIGINT"
      kill_timeout = "20s"

      config {
        command = "$${NOMAD_ALLOC_DIR}/venv/bin/planner"
        args = concat([
          "serve",
          "--host", "$${NOMAD_IP_admin}",
          "--port", "$${NOMAD_PORT_admin}",
          # No scheme: the planner adds https when it serves TLS (LLMGW_TLS_CERT,
          # maybe from the settings in KV), else http.
          "--advertise", "$${NOMAD_ADDR_admin}",
          "--log-level", var.log_level,
        ], var.args)
      }

      env = local.agent_env

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
        {{- with nomadVar "nomad/jobs/${var.job_name}" }}{{ range .Tuples }}{{ if .K | regexMatch "^(NOMAD_CACERT|NOMAD_CLIENT_CERT|NOMAD_CLIENT_KEY|CONSUL_CACERT|CONSUL_CLIENT_CERT|CONSUL_CLIENT_KEY|LLMGW_TLS_CERT|LLMGW_TLS_KEY|LLMGW_PLANNER_CACERT)_PEM$" }}
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
