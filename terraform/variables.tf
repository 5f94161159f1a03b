# Where the jobs reach the agents, from the node they run on.

variable "nomad_addr" {
  type        = string
  default     = "http://127.0.0.1:4646"
  description = "Nomad HTTP API as the planner reaches it from its node (NOMAD_ADDR): the local client agent by default."
}

variable "consul_addr" {
  type        = string
  default     = "127.0.0.1:8500"
  description = "Consul HTTP API as the planner and router reach it from their node (CONSUL_HTTP_ADDR): host:port or http(s)://host:port."
}

# TLS to the agents and the planners, for agents that serve https: paths of PEM files
# on the nodes (the jobs' tasks read them there), as the `nomad` and `consul` CLIs name
# them. Empty: not set.

variable "nomad_cacert" {
  type        = string
  default     = ""
  description = "NOMAD_CACERT of the planner: CA file (PEM, a path on the nodes) that verifies an https nomad_addr; empty: the system's CAs."
}

variable "nomad_client_cert" {
  type        = string
  default     = ""
  description = "NOMAD_CLIENT_CERT of the planner: client certificate (PEM, a path on the nodes) for Nomad agents with verify_https_client; with nomad_client_key."
}

variable "nomad_client_key" {
  type        = string
  default     = ""
  description = "NOMAD_CLIENT_KEY of the planner: the client certificate's key (PEM, a path on the nodes)."
}

variable "consul_ssl" {
  type        = bool
  default     = false
  description = "CONSUL_HTTP_SSL of both jobs: https to Consul even when consul_addr has no scheme."
}

variable "consul_cacert" {
  type        = string
  default     = ""
  description = "CONSUL_CACERT of both jobs: CA file (PEM, a path on the nodes) that verifies an https Consul; empty: the system's CAs."
}

variable "consul_client_cert" {
  type        = string
  default     = ""
  description = "CONSUL_CLIENT_CERT of both jobs: client certificate (PEM, a path on the nodes) for a Consul with verify_incoming_https; with consul_client_key."
}

variable "consul_client_key" {
  type        = string
  default     = ""
  description = "CONSUL_CLIENT_KEY of both jobs: the client certificate's key (PEM, a path on the nodes)."
}

variable "planner_cacert" {
  type        = string
  default     = ""
  description = "LLMGW_PLANNER_CACERT of the router: CA file (PEM, a path on the nodes) for planners serving HTTPS (LLMGW_TLS_CERT in planner_settings); set, the router calls them over https."
}

variable "planner_tls_pem" {
  type        = map(string)
  default     = {}
  sensitive   = true
  description = "PEM text instead of paths on the nodes: {VARIABLE = PEM} for NOMAD_CACERT, NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY, CONSUL_CACERT, CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY, LLMGW_TLS_CERT, LLMGW_TLS_KEY, LLMGW_PLANNER_CACERT; stored as <VARIABLE>_PEM items of the planner's Nomad variable, written to the task's secrets/ and pointed at."

  validation {
    condition     = alltrue([for k in keys(var.planner_tls_pem) : contains(["NOMAD_CACERT", "NOMAD_CLIENT_CERT", "NOMAD_CLIENT_KEY", "CONSUL_CACERT", "CONSUL_CLIENT_CERT", "CONSUL_CLIENT_KEY", "LLMGW_TLS_CERT", "LLMGW_TLS_KEY", "LLMGW_PLANNER_CACERT"], k)])
    error_message = "planner_tls_pem keys are NOMAD_CACERT, NOMAD_CLIENT_CERT, NOMAD_CLIENT_KEY, CONSUL_CACERT, CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY, LLMGW_TLS_CERT, LLMGW_TLS_KEY or LLMGW_PLANNER_CACERT."
  }
}

variable "router_tls_pem" {
  type        = map(string)
  default     = {}
  sensitive   = true
  description = "As planner_tls_pem, for the router: CONSUL_CACERT, CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY, LLMGW_TLS_CERT, LLMGW_TLS_KEY, LLMGW_PLANNER_CACERT."

  validation {
    condition     = alltrue([for k in keys(var.router_tls_pem) : contains(["CONSUL_CACERT", "CONSUL_CLIENT_CERT", "CONSUL_CLIENT_KEY", "LLMGW_TLS_CERT", "LLMGW_TLS_KEY", "LLMGW_PLANNER_CACERT"], k)])
    error_message = "router_tls_pem keys are CONSUL_CACERT, CONSUL_CLIENT_CERT, CONSUL_CLIENT_KEY, LLMGW_TLS_CERT, LLMGW_TLS_KEY or LLMGW_PLANNER_CACERT."
  }
}

# Where and how the jobs run.

variable "datacenters" {
  type        = list(string)
  default     = ["*"]
  description = "Datacenters both jobs may run in."
}

variable "node_pool" {
  type        = string
  default     = "default"
  description = "Nomad node pool both jobs run in."
}

variable "driver" {
  type        = string
  default     = "raw_exec"
  description = "Task driver of both jobs: raw_exec, or exec where raw_exec is disabled."
}

variable "planner_instances" {
  type        = number
  default     = 2
  description = "Planner instances: one leader, the others standing by (1 runs without a standby)."

  validation {
    condition     = var.planner_instances >= 1
    error_message = "planner_instances must be at least 1."
  }
}

variable "router_instances" {
  type        = number
  default     = 2
  description = "Router instances, each registered as the Consul service llmgw-router."

  validation {
    condition     = var.router_instances >= 1
    error_message = "router_instances must be at least 1."
  }
}

variable "router_port" {
  type        = number
  default     = 0
  description = "Static port of every router instance (then at most one per node); 0: dynamic ports, found through Consul."
}

variable "planner_cpu" {
  type        = number
  default     = 200
  description = "MHz for each planner instance."
}

variable "planner_memory_mb" {
  type        = number
  default     = 512
  description = "MiB for each planner instance."
}

variable "install_cpu" {
  type        = number
  default     = 200
  description = "MHz for each allocation's install task (pip, before the planner or router starts; its share is freed when it ends)."
}

variable "router_cpu" {
  type        = number
  default     = 500
  description = "MHz for each router instance."
}

variable "router_memory_mb" {
  type        = number
  default     = 512
  description = "MiB for each router instance."
}

# What the jobs install.

variable "wheel_url" {
  type        = string
  description = "URL of the llmgw wheel (dist/llmgw-<version>-py3-none-any.whl from `pip wheel --no-deps .`), fetched by Nomad's artifact downloader on each node."
}

variable "wheel_sha256" {
  type        = string
  default     = ""
  description = "Expected sha256 of the wheel; empty skips the check."
}

variable "pip_index_url" {
  type        = string
  default     = ""
  description = "Package index the nodes install the wheel's dependencies from; empty: pip's own configuration on the node."
}

variable "wheelhouse_url" {
  type        = string
  default     = ""
  description = "Folder of dependency wheels (`pip wheel -w DIR dist/llmgw-*.whl`) the nodes install from with --no-index; empty: the index."
}

variable "python" {
  type        = string
  default     = "python3"
  description = "Python >= 3.11 on the nodes, which creates each allocation's venv."
}

# Settings, tokens and policies.

variable "planner_settings" {
  type        = map(string)
  default     = {}
  description = "The planner's LLMGW_* environment (LLMGW_ENGINES, LLMGW_TASK_DRIVER, LLMGW_DATACENTERS...), written to Consul KV <config_prefix>/llmgw-planner/."

  validation {
    condition     = alltrue([for k in keys(var.planner_settings) : can(regex("^LLMGW_[A-Z0-9_]+$", k)) && !endswith(k, "_TOKEN")])
    error_message = "planner_settings keys are LLMGW_* variable names; tokens (*_TOKEN) are the module's to write."
  }
}

variable "model_task_user" {
  type        = string
  default     = ""
  description = "LLMGW_TASK_USER of the planner: the user model tasks (llama-server) run as on the nodes; empty: the Nomad client's own, root under raw_exec. It costs: the Nomad clients must run as root to switch users, raw_exec's user is no sandbox (exec adds a chroot and cgroups), and the user must run the engine and read every model file."

  validation {
    condition     = can(regex("^([a-z_][a-z0-9_-]{0,30}[$]?)?$", var.model_task_user))
    error_message = "model_task_user is a user name such as nobody or llmgw, or empty."
  }
}

variable "models_root" {
  type        = string
  default     = "/opt/llmgw/models"
  description = "LLMGW_MODELS_ROOT of the planner: the folder on the nodes every file:// model source must lie in (after symlinks, where the applying machine has the file)."

  validation {
    condition     = startswith(var.models_root, "/")
    error_message = "models_root is an absolute path on the nodes."
  }
}

variable "router_settings" {
  type        = map(string)
  default     = {}
  description = "The router's LLMGW_* environment (LLMGW_QUEUE_TIMEOUT, LLMGW_REPLICA_CONCURRENCY...), written to Consul KV <config_prefix>/llmgw-router/."

  validation {
    condition     = alltrue([for k in keys(var.router_settings) : can(regex("^LLMGW_[A-Z0-9_]+$", k)) && !endswith(k, "_TOKEN")])
    error_message = "router_settings keys are LLMGW_* variable names; tokens (*_TOKEN) are the module's to write."
  }
}

variable "config_prefix" {
  type        = string
  default     = "llmgw-config"
  description = "Consul KV folder of the settings (outside llmgw/, the planner's state)."
}

variable "settings_revision" {
  type        = string
  default     = "1"
  description = "Change it to roll both jobs (a deployment) with the current settings and tokens, e.g. after replacing a token."
}

variable "engines" {
  type        = list(string)
  default     = ["llama.cpp"]
  description = "Names of the engines `planner engines apply` installs (engines/*.yaml): each install job llmgw-engine-<name> gets acl/nomad/engine-install.hcl attached (node write, for the node metadata it records)."
}

variable "acl_enabled" {
  type        = bool
  default     = true
  description = "Create the ACL policies and tokens (Nomad and Consul with ACLs enabled); false for a cluster without ACLs, where only the admin token is written."
}

variable "policy_dir" {
  type        = string
  default     = null
  description = "Folder holding nomad/planner.hcl, nomad/engine-install.hcl, consul/planner.hcl and consul/router.hcl; null: the repository's acl/ beside this module."
}

variable "jobspec_dir" {
  type        = string
  default     = null
  description = "Folder holding planner.nomad.hcl and router.nomad.hcl; null: the repository's jobspecs/ beside this module."
}
