# llmgw on an existing Nomad + Consul cluster: ACL policies and tokens for the
# planner and the router, their tokens in Nomad variables, their settings in
# Consul KV, and the two jobs from ../jobspecs (see README.md).

locals {
  policy_dir  = coalesce(var.policy_dir, "${path.module}/../acl")
  jobspec_dir = coalesce(var.jobspec_dir, "${path.module}/../jobspecs")

  # The jobspecs' defaults: the job IDs name the Nomad variables their tasks may read
  # (nomad/jobs/<job>) and their settings' KV folders; the router's service is
  # llmgw_contract's ROUTER_SERVICE.
  planner_job    = "llmgw-planner"
  router_job     = "llmgw-router"
  router_service = "llmgw-router"

  # The jobs read settings and tokens when an instance starts; a change reaches them
  # as a deployment through this value in the jobs' meta. Known at plan time (HCL2
  # job variables must be): the settings and the revision, not the tokens.
  # The planner's settings: the model task ones from their own variables (empty: not
  # set), then planner_settings, which wins where it names them too.
  model_settings = {
    LLMGW_TASK_USER   = var.model_task_user
    LLMGW_MODELS_ROOT = var.models_root
  }

  planner_settings = merge({ for name, value in local.model_settings : name => value if value != "" }, var.planner_settings)

  settings_version = substr(sha256(jsonencode({
    planner  = local.planner_settings
    router   = var.router_settings
    revision = var.settings_revision
  })), 0, 16)

  # Each job's variables (`nomad_job` takes strings: numbers and lists as HCL text).
  planner_vars = {
    datacenters        = jsonencode(var.datacenters)
    node_pool          = var.node_pool
    driver             = var.driver
    instances          = tostring(var.planner_instances)
    cpu                = tostring(var.planner_cpu)
    memory_mb          = tostring(var.planner_memory_mb)
    install_cpu        = tostring(var.install_cpu)
    wheel_url          = var.wheel_url
    wheel_sha256       = var.wheel_sha256
    pip_index_url      = var.pip_index_url
    wheelhouse_url     = var.wheelhouse_url
    python             = var.python
    nomad_addr         = var.nomad_addr
    consul_addr        = var.consul_addr
    config_prefix      = var.config_prefix
    settings_version   = local.settings_version
    nomad_cacert       = var.nomad_cacert
    nomad_client_cert  = var.nomad_client_cert
    nomad_client_key   = var.nomad_client_key
    consul_ssl         = tostring(var.consul_ssl)
    consul_cacert      = var.consul_cacert
    consul_client_cert = var.consul_client_cert
    consul_client_key  = var.consul_client_key
  }

  router_vars = {
    datacenters        = jsonencode(var.datacenters)
    node_pool          = var.node_pool
    driver             = var.driver
    instances          = tostring(var.router_instances)
    port               = tostring(var.router_port)
    cpu                = tostring(var.router_cpu)
    memory_mb          = tostring(var.router_memory_mb)
    install_cpu        = tostring(var.install_cpu)
    wheel_url          = var.wheel_url
    wheel_sha256       = var.wheel_sha256
    pip_index_url      = var.pip_index_url
    wheelhouse_url     = var.wheelhouse_url
    python             = var.python
    consul_addr        = var.consul_addr
    config_prefix      = var.config_prefix
    settings_version   = local.settings_version
    planner_cacert     = var.planner_cacert
    serves_https       = tostring(contains(concat(keys(var.router_settings), nonsensitive(keys(var.router_tls_pem))), "LLMGW_TLS_CERT"))
    consul_ssl         = tostring(var.consul_ssl)
    consul_cacert      = var.consul_cacert
    consul_client_cert = var.consul_client_cert
    consul_client_key  = var.consul_client_key
  }
}

# --- ACL policies and tokens ---------------------------------------------------------
# The router never calls Nomad (it reads Consul only), so it has no Nomad policy or
# token: acl/README.md.

resource "nomad_acl_policy" "planner" {
  count       = var.acl_enabled ? 1 : 0
  name        = local.planner_job
  description = "llmgw planner: submit and read model jobs, allocations and logs, scale, nodes"
  rules_hcl   = file("${local.policy_dir}/nomad/planner.hcl")
}

resource "nomad_acl_token" "planner" {
  count    = var.acl_enabled ? 1 : 0
  name     = local.planner_job
  type     = "client"
  policies = [nomad_acl_policy.planner[0].name]
}

# Each engine's install job (llmgw-engine-<name>, `planner engines apply`) records the
# engine in its node's metadata with its workload identity, which needs node write: the
# policy is attached to that job (one policy per job; names allow letters, digits, "-").
resource "nomad_acl_policy" "engine_install" {
  for_each    = var.acl_enabled ? toset(var.engines) : toset([])
  name        = "llmgw-engine-install-${replace(each.key, "/[^A-Za-z0-9-]/", "-")}"
  description = "llmgw engine install job llmgw-engine-${each.key}: its node's metadata"
  rules_hcl   = file("${local.policy_dir}/nomad/engine-install.hcl")

  job_acl {
    namespace = "default"
    job_id    = "llmgw-engine-${each.key}"
  }
}

resource "consul_acl_policy" "planner" {
  count       = var.acl_enabled ? 1 : 0
  name        = local.planner_job
  description = "llmgw planner: KV llmgw/ write, session write, service read"
  rules       = file("${local.policy_dir}/consul/planner.hcl")
}

resource "consul_acl_policy" "router" {
  count       = var.acl_enabled ? 1 : 0
  name        = local.router_job
  description = "llmgw router: service read, KV llmgw/ read"
  rules       = file("${local.policy_dir}/consul/router.hcl")
}

resource "consul_acl_token" "planner" {
  count       = var.acl_enabled ? 1 : 0
  description = "llmgw planner"
  policies    = [consul_acl_policy.planner[0].name]
}

resource "consul_acl_token" "router" {
  count       = var.acl_enabled ? 1 : 0
  description = "llmgw router"
  policies    = [consul_acl_policy.router[0].name]
}

data "consul_acl_token_secret_id" "planner" {
  count       = var.acl_enabled ? 1 : 0
  accessor_id = consul_acl_token.planner[0].id
}

data "consul_acl_token_secret_id" "router" {
  count       = var.acl_enabled ? 1 : 0
  accessor_id = consul_acl_token.router[0].id
}

# The planner's admin API token (LLMGW_ADMIN_TOKEN), which the router presents
# (LLMGW_PLANNER_TOKEN) to activate on-demand models and report usage.
resource "random_password" "admin_token" {
  length  = 40
  special = false
}

# --- tokens (Nomad variables) and settings (Consul KV) ----------------------------------

# Each job's tasks read nomad/jobs/<job> without any policy (workload identity);
# items are named as the environment variables they become.
resource "nomad_variable" "planner" {
  path = "nomad/jobs/${local.planner_job}"
  items = merge(
    { LLMGW_ADMIN_TOKEN = random_password.admin_token.result },
    { for token in nomad_acl_token.planner : "NOMAD_TOKEN" => token.secret_id },
    { for token in data.consul_acl_token_secret_id.planner : "CONSUL_HTTP_TOKEN" => token.secret_id },
    { for name, pem in var.planner_tls_pem : "${name}_PEM" => pem },
  )
}

resource "nomad_variable" "router" {
  path = "nomad/jobs/${local.router_job}"
  items = merge(
    { LLMGW_PLANNER_TOKEN = random_password.admin_token.result },
    { for token in data.consul_acl_token_secret_id.router : "CONSUL_HTTP_TOKEN" => token.secret_id },
    { for name, pem in var.router_tls_pem : "${name}_PEM" => pem },
  )
}

resource "consul_key_prefix" "planner_settings" {
  path_prefix = "${var.config_prefix}/${local.planner_job}/"
  subkeys     = local.planner_settings
}

resource "consul_key_prefix" "router_settings" {
  path_prefix = "${var.config_prefix}/${local.router_job}/"
  subkeys     = var.router_settings
}

# --- the jobs -----------------------------------------------------------------------------

# detach = false: an apply returns once the deployment is healthy (or fails with it).
resource "nomad_job" "planner" {
  jobspec          = file("${local.jobspec_dir}/planner.nomad.hcl")
  detach           = false
  purge_on_destroy = true

  hcl2 {
    vars = local.planner_vars
  }

  timeouts {
    create = "15m"
    update = "15m"
  }

  depends_on = [nomad_variable.planner, consul_key_prefix.planner_settings]
}

resource "nomad_job" "router" {
  jobspec          = file("${local.jobspec_dir}/router.nomad.hcl")
  detach           = false
  purge_on_destroy = true

  hcl2 {
    vars = local.router_vars
  }

  timeouts {
    create = "15m"
    update = "15m"
  }

  # The router follows the planner leader; without one it serves, but cannot
  # activate on-demand models.
  depends_on = [nomad_variable.router, consul_key_prefix.router_settings, nomad_job.planner]
}
