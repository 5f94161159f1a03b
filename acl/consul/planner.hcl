# Consul ACL policy of the llmgw planner (`planner apply`, `status`, `models`, `retry`,
# `serve`, `engines apply`): every rule below is one the planner's calls need, and
# nothing else.
#
#   consul acl policy create -name llmgw-planner -rules @acl/consul/planner.hcl
#   consul acl token create -description "llmgw planner" -policy-name llmgw-planner
#
# Give the token's secret to the planner as CONSUL_HTTP_TOKEN. What each rule is for
# (Consul 1.8 names; `service_prefix`, `key_prefix` ... are unchanged since):
#
#   key_prefix "llmgw/" write     model records (apply), engine records (engines apply,
#                                 check-and-set), state documents (every write a
#                                 check-and-set, in a transaction with check-session),
#                                 usage, and the leader lock llmgw/leader (acquire,
#                                 release)
#   session_prefix "" write       the leadership session, created on the local agent's
#                                 node (any node: the planner runs where Nomad puts it)
#   service "llmgw-planner" write the planner's own service and its TTL check (register,
#                                 pass, deregister)
#   service_prefix "llmgw-" read  the health of the model services llmgw-<model> (the
#                                 watcher, `planner status`)
#   node_prefix "" read           Consul hides a service instance, or a check, on a node
#                                 the token cannot read: without it every model reads as
#                                 having no passing replica
#
# Reads Consul filters by these rules answer "nothing" rather than "denied", so the
# planner asks Consul first (/v1/internal/acl/authorize) and refuses to start when a
# rule is missing, naming it.

key_prefix "llmgw/" {
  policy = "write"
}

session_prefix "" {
  policy = "write"
}

service "llmgw-planner" {
  policy = "write"
}

service_prefix "llmgw-" {
  policy = "read"
}

node_prefix "" {
  policy = "read"
}
