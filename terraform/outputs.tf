output "router_service_name" {
  description = "Consul service of the routers: point clients or the load balancer at its passing instances."
  value       = local.router_service
}

output "planner_service_name" {
  description = "Consul service of the planners' admin APIs (the leader is named in Consul KV llmgw/leader)."
  value       = "llmgw-planner"
}

output "planner_job_id" {
  description = "Nomad job ID of the planner."
  value       = nomad_job.planner.id
}

output "router_job_id" {
  description = "Nomad job ID of the router."
  value       = nomad_job.router.id
}

output "admin_token" {
  description = "The planner's admin API token (LLMGW_ADMIN_TOKEN), for `planner retry` and the admin API."
  value       = random_password.admin_token.result
  sensitive   = true
}

output "settings_version" {
  description = "Hash of the settings and settings_revision, as in both jobs' meta (llmgw_settings_version)."
  value       = local.settings_version
}
