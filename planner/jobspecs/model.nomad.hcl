# One llama.cpp model server as a Nomad service job.
#
# The planner renders this file through Nomad's own parser (/v1/jobs/parse)
# with one variable file per model; an operator can run the same file by hand:
#
#   nomad job run \
#     -var model=tiny -var source_path=/models/tiny.gguf \
#     -var engine_command=/usr/local/bin/llama-server jobspecs/model.nomad.hcl
#
# (the planner passes the engine's own arguments, alias and context included, as
# engine_args: planner/engines/llama_cpp.py)
#
# Health: llama-server answers 503 on every route while it loads the model
# and 200 on /health once ready, so the Consul check below is critical during
# a load. check_restart.grace keeps those failures from restarting the task
# until `load_grace` has passed (the profile's load_timeout).

variable "model" {
  type        = string
  description = "Model name: the job ID, and the Consul service is llmgw-<model>."
}

variable "definition_hash" {
  type        = string
  default     = "manual"
  description = "Hash of the model's source and profile, as the planner computes it."
}

variable "engine_command" {
  type        = string
  default     = "llama-server"
  description = "Path to the llama-server binary on the node."
}

variable "engine_args" {
  type        = list(string)
  default     = ["--model", "{model_file}", "--host", "$${NOMAD_IP_http}", "--port", "$${NOMAD_PORT_http}", "--parallel", "1"]
  description = "The engine's own arguments (planner/engines/<kind>.py), the slot count and context included (llama.cpp: --parallel N and --ctx-size context x N); {model_file} stands for the model file."
}

variable "health_path" {
  type        = string
  default     = "/health"
  description = "HTTP path the engine answers 200 on once the model is loaded."
}

variable "engine_meta_key" {
  type        = string
  default     = ""
  description = "Node metadata key that records the engine's installed version (llmgw_engine_<name>)."
}

variable "engine_version" {
  type        = string
  default     = ""
  description = "Run only on nodes whose engine_meta_key is this version; empty: no constraint."
}

variable "driver" {
  type        = string
  default     = "raw_exec"
  description = "Task driver. raw_exec in dev; exec or a container driver in production."
}

variable "user" {
  type        = string
  default     = ""
  description = "User the server runs as on the node (LLMGW_TASK_USER); empty: the Nomad client's own, root under raw_exec. raw_exec and exec need the client to run as root to switch users; raw_exec is no sandbox. The user must read the model file and run the engine."
}

variable "source_path" {
  type        = string
  default     = ""
  description = "Model file already on the node (file:// sources). Empty when downloading."
}

variable "artifacts" {
  type        = list(object({ url = string, sha256 = string, file = string }))
  default     = []
  description = "Files Nomad downloads into local/model/ (https:// and hf:// sources): one, or every shard of a split GGUF under its own name; llama-server is given the first. An empty sha256 skips the check."
}

variable "context" {
  type        = number
  default     = 4096
  description = "Tokens each request can use (profile.context); engine_args carry it to the engine."
}

variable "gpus" {
  type        = number
  default     = 0
  description = "Count of nvidia/gpu devices."
}

variable "gpu_memory" {
  type        = string
  default     = ""
  description = "Minimum memory per GPU, e.g. \"24 GiB\"; empty for no constraint."
}

variable "cpu" {
  type        = number
  default     = 1000
  description = "MHz."
}

variable "memory_mb" {
  type    = number
  default = 1024
}

variable "args" {
  type        = list(string)
  default     = []
  description = "Extra llama-server arguments, each one argv element."
}

variable "replicas" {
  type    = number
  default = 1
}

variable "defined_replicas" {
  type        = number
  default     = 1
  description = "The model's replicas as defined (an on-demand model's while active)."
}

variable "scaling" {
  type        = string
  default     = ""
  description = "The model's scaling bounds as JSON (llmgw_contract.ScalingBounds), empty for a fixed count."
}

variable "on_demand" {
  type        = bool
  default     = false
  description = "Registered with 0 instances; the planner scales it up when asked for."
}

variable "load_grace" {
  type        = string
  default     = "10m"
  description = "How long a start may take before failed health checks restart the task."
}

variable "canaries" {
  type        = number
  default     = 1
  description = "New replicas started beside the old ones when the definition changes: the replica count (0 for an idle on-demand model)."
}

variable "healthy_deadline" {
  type        = string
  default     = "40m"
  description = "How long a new replica may take (download and load) to pass its check before the update is rolled back."
}

variable "shutdown_delay" {
  type        = string
  default     = "30s"
  description = "How long a stopping replica, already out of Consul, keeps serving what it has before its signal (the definition's shutdown_delay)."
}

variable "restart_delay" {
  type        = string
  default     = "5s"
  description = "How long Nomad waits after a failed start before starting the server again, plus up to 25 % jitter (the definition's restart_delay)."
}

variable "datacenters" {
  type    = list(string)
  default = ["*"]
}

locals {
  service    = "llmgw-${var.model}"
  model_file = length(var.artifacts) > 0 ? "local/model/${var.artifacts[0].file}" : var.source_path
}

job "model" {
  id          = var.model
  name        = var.model
  type        = "service"
  datacenters = var.datacenters

  meta {
    llmgw_model           = var.model
    llmgw_definition_hash = var.definition_hash
    llmgw_on_demand       = var.on_demand ? "true" : "false"
  }

  group "server" {
    count = var.replicas

    # Only nodes where the engine's install job recorded this version
    # (planner/jobspecs/engine.nomad.hcl): a node without it is filtered by the
    # scheduler, never tried and failed 5 times.
    dynamic "constraint" {
      for_each = var.engine_version != "" ? [var.engine_version] : []
      content {
        attribute = "$${meta.${var.engine_meta_key}}"
        value     = constraint.value
      }
    }

    network {
      port "http" {}
    }

    # Failures must surface as Nomad events promptly, and each replica stops
    # failing on its own: restart in place restart_delay apart (5 s unless the
    # definition says), and after the 5th start fail the allocation and leave it
    # failed. So a replica that cannot start (a file missing on its node, a GPU
    # taken) is tried exactly 5 times while the other replicas go on serving, and
    # the planner, counting the same starts from the event stream, parks the model
    # only when no replica of its definition is healthy (docs/architecture.md,
    # "Failures"). The 30 m interval covers four delays (restart_delay is at most
    # 4 m, 5 m with Nomad's jitter) and five crash-after-ready runs of up to the
    # 2 min stability window, so Nomad's count of starts and the planner's count
    # of failures stay one count.
    restart {
      attempts = 4
      interval = "30m"
      delay    = var.restart_delay
      mode     = "fail"
    }

    # Nomad never reschedules a failed replica by itself (its next attempt
    # would be 10 years away), but rescheduling stays enabled: Nomad honours a
    # forced reschedule (`planner retry`, an activation, re-applying a stopped
    # job) only for a group whose policy allows one (nomad/job_endpoint.go,
    # ReschedulePolicy.Enabled). `attempts = 0` would leave a failed replica
    # holding its place in the count for good, even across a job stop.
    reschedule {
      attempts       = 1
      interval       = "87600h"
      delay          = "87600h"
      delay_function = "constant"
      unlimited      = false
    }

    # A changed definition rolls out beside the old one (planner/model/rollout.py):
    # one canary per replica, promoted once every canary has passed its check
    # for 5 s (then the old replicas stop), and the job reverted to its last
    # stable version if a canary does not become healthy. A canary turns
    # unhealthy only when its task is dead, after the 5 starts above that the
    # planner counts too, or at the healthy deadline (a load that hangs, or a
    # download that never ends). progress_deadline = 0: the first unhealthy
    # allocation fails the deployment (with a deadline, Nomad would wait for it
    # and only mark the allocation for a replacement, which never comes:
    # nomad/deploymentwatcher, handleAllocUpdate). A count change alone updates
    # in place and starts only the replicas added.
    update {
      max_parallel      = 1
      canary            = var.canaries
      auto_promote      = var.canaries > 0
      auto_revert       = true
      health_check      = "checks"
      min_healthy_time  = "5s"
      healthy_deadline  = var.healthy_deadline
      progress_deadline = "0s"
    }

    task "llama-server" {
      # An empty user (the default) is Nomad's own default: the client's user.
      driver = var.driver
      user   = var.user

      # A replica being stopped (a scale-down, an update's old version, an idle
      # model's last, a job stop) leaves Consul first: the routers drop it from
      # their tables within one blocking query and send it nothing new. What it
      # still serves has shutdown_delay to finish, then it gets its signal:
      # llama-server stops at once on SIGINT/SIGTERM, cutting any request left
      # (tests/integration/test_drain.py). Nomad waits the whole delay, busy or
      # not, and updates it in place (scheduler/util.go, tasksUpdated).
      #
      # kill_timeout counts from the signal, not from the stop: it only has to
      # cover llama-server's own exit (about 1 s for Gemma 270M with a request
      # in flight; a large model's teardown longer) before Nomad sends SIGKILL.
      # A client caps it at its max_kill_timeout (30 s by default).
      shutdown_delay = var.shutdown_delay
      kill_timeout   = "15s"

      dynamic "artifact" {
        for_each = var.artifacts
        content {
          source      = artifact.value.url
          destination = "local/model/${artifact.value.file}"
          mode        = "file"

          dynamic "options" {
            for_each = artifact.value.sha256 != "" ? [artifact.value.sha256] : []
            content {
              checksum = "sha256:${options.value}"
            }
          }
        }
      }

      # In the task, not the group: Nomad registers a task's services (and
      # starts watching its check_restart, grace included) at every start of
      # the task and removes them when it exits, so a restarted server gets
      # its load grace again and is out of the router's table while it
      # reloads. A group service stays registered across task restarts and
      # keeps the grace of the first start: a healthy server killed once was
      # killed again by the check while it reloaded (issue "Model state done
      # right", item 8).
      service {
        name     = local.service
        port     = "http"
        provider = "consul"
        tags     = ["llmgw", "model-server"]

        # The model's replicas live here, not in the job's meta: Nomad compares job
        # meta (it is part of every task's meta) and replaces every allocation when
        # it changes, while service meta is updated in place. So a replica count
        # change starts or stops only the replicas added or removed. The scaling
        # bounds live here for the same reason: a change of bounds is not a rollout.
        meta {
          llmgw_model           = var.model
          llmgw_definition_hash = var.definition_hash
          llmgw_replicas        = format("%d", var.defined_replicas)
          llmgw_scaling         = var.scaling
        }

        # Every second: an on-demand request waits for this check to pass, so
        # its interval is most of what activation adds to the model's own load
        # time (bench/cold_start.py: p50 0.87 s overhead at 2 s). One GET of
        # /health a second per instance costs llama-server nothing.
        #
        # A busy server must not be restarted: only 20 failed checks in a row
        # after the load grace (20 s of /health not answering within 5 s)
        # restart it. The router caps requests in flight per replica at its
        # slots, so /health always finds a free HTTP thread
        # (tests/integration/test_model_state.py, C18, measures it).
        check {
          type     = "http"
          path     = var.health_path
          interval = "1s"
          timeout  = "5s"

          check_restart {
            limit = 20
            grace = var.load_grace
          }
        }
      }

      # GPU isolation under raw_exec/exec: CUDA reads CUDA_VISIBLE_DEVICES, while
      # Nomad's nvidia plugin reserves devices by setting NVIDIA_VISIBLE_DEVICES
      # (for container runtimes), so without this every GPU model on a node sees
      # every GPU. The reservation holds GPU UUIDs, which CUDA accepts as they are.
      # A template, not an env block: Nomad interpolates `env` before the device
      # hook's variables exist (client/taskenv/env.go, buildEnv), while a template
      # renders after that hook, from the task's whole environment.
      dynamic "template" {
        for_each = var.gpus > 0 ? ["gpu.env"] : []
        content {
          destination = "local/${template.value}"
          env         = true
          change_mode = "noop"
          data        = "CUDA_VISIBLE_DEVICES={{ env \"NVIDIA_VISIBLE_DEVICES\" }}\n"
        }
      }

      config {
        command = var.engine_command
        args = concat([for arg in var.engine_args : replace(arg, "{model_file}", local.model_file)],
        var.args)
      }

      resources {
        cpu    = var.cpu
        memory = var.memory_mb

        dynamic "device" {
          for_each = var.gpus > 0 ? ["nvidia/gpu"] : []
          labels   = [device.value]
          content {
            count = var.gpus

            dynamic "constraint" {
              for_each = var.gpu_memory != "" ? [var.gpu_memory] : []
              content {
                attribute = "$${device.attr.memory}"
                operator  = ">="
                value     = constraint.value
              }
            }
          }
        }
      }

      # llama-server logs its load progress and errors to stderr; keep enough
      # to read the last error after a failed start.
      logs {
        max_files     = 3
        max_file_size = 10
      }
    }
  }
}
