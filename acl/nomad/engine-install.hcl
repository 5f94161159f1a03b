# Nomad ACL policy of an engine's install job (`llmgw-engine-<name>`, planner/jobspecs/
# engine.nomad.hcl), attached to that job, so its tasks' workload identity carries it:
#
#   nomad acl policy apply -namespace default -job llmgw-engine-llama.cpp \
#     -description "llmgw engine install: llama.cpp" llmgw-engine-install-llama-cpp \
#     acl/nomad/engine-install.hcl
#
# One policy per engine job (Nomad 1.6 attaches a policy to one job; policy names
# allow only letters, digits and "-", so "llama.cpp" becomes "llama-cpp").
#
# The install task records the checked engine in its node's dynamic metadata:
# POST /v1/client/metadata (through the Task API socket, or LLMGW_ENGINE_NOMAD_ADDR
# with ?node_id=), which Nomad 1.6 allows with node write (client/meta_endpoint.go:
# AllowNodeWrite). Nothing else: the job's identity already reads its own variables
# and the service registrations (the implicit workload policy).

node {
  policy = "write"
}
