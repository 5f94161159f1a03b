# Consul ACL policy of the llmgw router (`router serve`): it reads, and writes only the
# per-key limits every router shares.
#
#   consul acl policy create -name llmgw-router -rules @acl/consul/router.hcl
#   consul acl token create -description "llmgw router" -policy-name llmgw-router
#
# Give the token's secret to the router as CONSUL_HTTP_TOKEN. What each rule is for:
#
#   key_prefix "llmgw/" read      model records (llmgw/models/), the parked and
#                                 unplaceable states (llmgw/routing/), the leading planner
#                                 (llmgw/leader)
#   service_prefix "llmgw-" read  the passing replicas of llmgw-<model>, the passing
#                                 planners (llmgw-planner), the catalog's service list
#   node_prefix "" read           Consul hides a service instance on a node the token
#                                 cannot read: without it no replica ever passes
#   key "llmgw-router/api-keys"   the router's API keys, when it reads them from Consul
#     read                        (LLMGW_API_KEYS_CONSUL); outside llmgw/ so the
#                                 planner's token cannot write them: give write on it
#                                 to operators only (`router keys --consul` edits it)
#   key_prefix                    the per-key limits every router shares (one small
#     "llmgw-router/limits/"      document per key and kind, compare-and-set), with API
#     write                       keys and LLMGW_ROUTER_SHARED_LIMITS on (the default)
#   session_prefix "" read        the session holding llmgw/leader: its node and the
#                                 llmgw-planner check it is bound to say where the
#                                 leader registered (the key's text alone is not trusted)
#
# The router needs no Nomad token: it never calls Nomad (it finds replicas in Consul
# and asks the planner's admin API, with LLMGW_PLANNER_TOKEN, to start a model).
# Reads Consul filters by these rules answer "nothing" rather than "denied", so the
# router asks Consul first (/v1/internal/acl/authorize) and refuses to start when a
# rule is missing, naming it.

key_prefix "llmgw/" {
  policy = "read"
}

service_prefix "llmgw-" {
  policy = "read"
}

node_prefix "" {
  policy = "read"
}

key "llmgw-router/api-keys" {
  policy = "read"
}

session_prefix "" {
  policy = "read"
}

key_prefix "llmgw-router/limits/" {
  policy = "write"
}
