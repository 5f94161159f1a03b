# Nomad ACL policy of the llmgw planner (`planner apply`, `status`, `models`, `retry`,
# `serve`): every capability below is one the planner's calls need, and nothing else.
#
#   nomad acl policy apply -description "llmgw planner" llmgw-planner acl/nomad/planner.hcl
#   nomad acl token create -name llmgw-planner -policy llmgw-planner
#
# Give the token's secret to the planner as NOMAD_TOKEN. Each call and the capability
# Nomad 1.6 checks for it (nomad/job_endpoint.go, command/agent/job_endpoint.go,
# client/fs_endpoint.go, nomad/stream/event_broker.go):
#
#   list-jobs   GET /v1/jobs (apply, the leader's reconcile, the Raft index)
#   read-job    GET /v1/job/:id, its versions, allocations, evaluations, deployments;
#               GET /v1/allocations, /v1/evaluation/:id; the event stream's Job,
#               Allocation, Evaluation and Deployment topics (the leader's watcher)
#   parse-job   POST /v1/jobs/parse (rendering a model's job; submit-job implies it)
#   submit-job  register, plan (`apply --dry-run`), deregister (`--prune`), evaluate
#               (`retry`), revert (a rolled-back update retried), parking (a stop)
#   scale-job   POST /v1/job/:id/scale (on-demand activation, idle scale-down;
#               submit-job implies it)
#   read-logs   GET /v1/client/fs/logs (a failed start's stderr: the last error)
#   node read   GET /v1/nodes (the GPUs of the nodes, for an unplaceable reason)
#
# Not needed: variables (the planner reads none), alloc-exec/lifecycle, read-fs (logs
# are enough), agent, operator, dispatch, CSI, host volumes. The Consul services of the
# model jobs are registered by the Nomad agents with their own Consul token: with
# Consul ACLs, keep `consul { allow_unauthenticated = true }` (Nomad's default) on
# the servers, or the job submitter would have to pass a Consul token too.
#
# Models run in the one namespace the planner manages, NOMAD_NAMESPACE (default
# "default"; docs/definitions.md, "Namespace"): for another, write its name in the
# block below. Every call, the event stream included, is made in it, and the checks
# before acting ask for these capabilities there.

namespace "default" {
  capabilities = [
    "list-jobs",
    "read-job",
    "parse-job",
    "submit-job",
    "scale-job",
    "read-logs",
  ]
}

# list-jobs in every other namespace: `planner apply` lists llmgw's jobs there
# (GET /v1/jobs?namespace=*&meta=true) and refuses a model whose name one of them
# already has (its Consul service llmgw-<name> has no namespace: two copies would be
# counted as one). Nomad lists only the namespaces a token may list-jobs in, so
# without this block that check sees the planner's own namespace alone. The block
# above, more specific, still decides the planner's own namespace.
namespace "*" {
  capabilities = ["list-jobs"]
}

node {
  policy = "read"
}
