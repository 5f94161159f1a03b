# Install one engine on every node, and record it in the node's metadata.
#
# A sysbatch job: one allocation per eligible node, run once per job version
# (Nomad places a node's allocation again only when the job changes:
# scheduler/system_util.go). The planner renders this file through Nomad's
# parser (`planner engines apply`, planner/daemon/engine_install.py); by hand:
#
#   nomad job run -var engine=llama.cpp -var version=11434 \
#     -var path=/opt/llmgw/bin/llama-server planner/jobspecs/engine.nomad.hcl
#
# The task checks the engine (an artifact is downloaded and its sha256 checked
# by Nomad, then copied into `install_dir`; a `path` must exist, be executable
# and match its sha256 when given), runs it once (`<command> <check_args>`,
# e.g. `llama-server --version`: a build that dies of SIGILL on a CPU lacking
# its instructions dies here, and is recorded nowhere it cannot run; with a
# `check_model`, it also serves that model on the `http` port and completes
# one token: a build that dies on its first graph compute dies here), then
# sets the node's dynamic metadata
# `<meta_key> = <version>` through the agent's /v1/client/metadata (Nomad
# >= 1.5), which model jobs constrain on. Only a checked engine is recorded: a
# node where the check fails keeps what it had, and the task fails with the
# reason on stderr (`planner status --nodes` shows it).
#
# The metadata call goes to the Task API socket in the task's secrets dir,
# authenticated with the task's workload identity (NOMAD_TOKEN from
# `identity { env = true }`); or, when `nomad_addr` is set, to that agent with
# `?node_id=` (Nomad forwards it to the node). With ACLs on, the identity
# needs a policy with `node { policy = "write" }` attached to this job
# (docs/operations.md, "Engines").

variable "engine" {
  type        = string
  description = "Engine name: models name it in profile.engine."
}

variable "version" {
  type        = string
  description = "The build being installed; recorded as the node's <meta_key> value."
}

variable "meta_key" {
  type        = string
  default     = ""
  description = "Node metadata key; empty: llmgw_engine_<engine>."
}

variable "artifact_url" {
  type        = string
  default     = ""
  description = "https URL of the engine's executable; empty when it is already on the nodes (path)."
}

variable "artifact_sha256" {
  type        = string
  default     = ""
  description = "sha256 of the artifact (Nomad's downloader checks it) or of the file at path."
}

variable "command_file" {
  type        = string
  default     = "engine"
  description = "File name the artifact is installed under, in install_dir."
}

variable "install_dir" {
  type        = string
  default     = ""
  description = "Where an artifact is installed on the node: <engine root>/<engine>/<version>."
}

variable "path" {
  type        = string
  default     = ""
  description = "Where the engine already is on every node (instead of an artifact)."
}

variable "check_args" {
  type        = string
  default     = "--version"
  description = "Arguments of the engine's run-once check before it is recorded (words split on blanks)."
}

variable "check_timeout_s" {
  type        = number
  default     = 60
  description = "Seconds the run-once check may take."
}

variable "check_model" {
  type        = string
  default     = ""
  description = "A small GGUF on every node the engine serves once, completing one token; empty: --version only."
}

variable "check_serve_args" {
  type        = string
  default     = ""
  description = "The engine's arguments serving check_model on the http port (words split on blanks)."
}

variable "check_health_path" {
  type    = string
  default = "/health"
}

variable "check_request_path" {
  type    = string
  default = "/completion"
}

variable "check_request_body" {
  type    = string
  default = ""
}

variable "memory_mb" {
  type        = number
  default     = 64
  description = "The install task's memory: more when it serves check_model."
}

variable "nomad_addr" {
  type        = string
  default     = ""
  description = "Agent address for the metadata call; empty: the Task API socket."
}

variable "driver" {
  type    = string
  default = "raw_exec"
}

variable "datacenters" {
  type    = list(string)
  default = ["*"]
}

locals {
  meta_key = var.meta_key != "" ? var.meta_key : "llmgw_engine_${var.engine}"

  # POSIX sh, sha256sum and curl, which a Linux node has. `$NAME` only: `$${`
  # would be Nomad's interpolation.
  script = <<-EOT
    set -u
    fail() { echo "llmgw engine install: $NODE_NAME: $*" >&2; exit 1; }
    if [ -n "$ENGINE_ARTIFACT" ]; then
      target="$INSTALL_DIR/$COMMAND_FILE"
      tmp="$target.tmp.$NOMAD_ALLOC_ID"
      mkdir -p "$INSTALL_DIR" || fail "cannot create $INSTALL_DIR"
      # A rename replaces the file even while a model server runs it.
      cp "$NOMAD_TASK_DIR/engine/$COMMAND_FILE" "$tmp" && chmod 0755 "$tmp" &&
        mv -f "$tmp" "$target" || fail "cannot install $target"
    else
      target="$ENGINE_PATH"
      [ -f "$target" ] || fail "$target: no such file"
      [ -x "$target" ] || fail "$target: not executable"
      if [ -n "$ENGINE_SHA256" ]; then
        actual=$(sha256sum "$target" | cut -d ' ' -f 1)
        [ "$actual" = "$ENGINE_SHA256" ] ||
          fail "$target: sha256 is $actual, expected $ENGINE_SHA256"
      fi
    fi
    # Run it once before recording it. The planner reads "exited with status N" of the
    # last line and names a signal's death (planner/daemon/engine_install.py, check_crash).
    out="$NOMAD_TASK_DIR/check.out"
    timeout -k 5 "$CHECK_TIMEOUT_S" "$target" $CHECK_ARGS </dev/null >"$out" 2>&1
    status=$?
    if [ "$status" -eq 124 ]; then
      tail -n 3 "$out" >&2
      fail "$target $CHECK_ARGS did not finish within $CHECK_TIMEOUT_S s"
    elif [ "$status" -ne 0 ]; then
      tail -n 3 "$out" >&2
      fail "$target $CHECK_ARGS exited with status $status"
    fi
    if [ -n "$CHECK_MODEL" ]; then
      [ -f "$CHECK_MODEL" ] || fail "check model $CHECK_MODEL: no such file"
      base="http://$NOMAD_IP_http:$NOMAD_PORT_http"
      ended="$NOMAD_TASK_DIR/check.status"
      serving="$target serving $CHECK_MODEL"
      rm -f "$ended" "$ended.pid"
      # The server's exit status lands in a file when it ends: a child that died but
      # was not waited for still answers kill -0.
      (
        "$target" $CHECK_SERVE_ARGS </dev/null >"$out" 2>&1 &
        echo "$!" >"$ended.pid"
        wait "$!"
        echo "$?" >"$ended"
      ) &
      died() {
        tail -n 3 "$out" >&2
        fail "$serving exited with status $(cat "$ended")"
      }
      stop() {
        [ -s "$ended.pid" ] && kill -9 "$(cat "$ended.pid")" 2>/dev/null
      }
      waited=0
      until [ -s "$ended.pid" ] && curl -sf -o /dev/null --max-time 2 "$base$CHECK_HEALTH"; do
        [ -s "$ended" ] && died
        if [ "$waited" -ge "$CHECK_TIMEOUT_S" ]; then
          stop; tail -n 3 "$out" >&2
          fail "$serving: not ready within $CHECK_TIMEOUT_S s"
        fi
        sleep 1
        waited=$((waited + 1))
      done
      if ! curl -sf -o /dev/null --max-time "$CHECK_TIMEOUT_S" \
          -H "Content-Type: application/json" --data "$CHECK_BODY" "$base$CHECK_PATH"; then
        # A crash mid-completion resets the connection: give its status a moment to land.
        for _ in 1 2 3 4 5; do [ -s "$ended" ] && died; sleep 1; done
        stop
        fail "$serving: the one-token completion failed"
      fi
      stop
    fi
    body="{\"Meta\":{\"$META_KEY\":\"$ENGINE_VERSION\"}}"
    if [ -n "$NOMAD_API" ]; then
      set -- "$NOMAD_API/v1/client/metadata?node_id=$NODE_ID"
    else
      set -- --unix-socket "$NOMAD_SECRETS_DIR/api.sock" http://localhost/v1/client/metadata
    fi
    # No -w: Nomad reads the task's arguments as an HCL template, where a percent
    # sign before a brace starts a directive.
    answer=$(curl -sS -f --max-time 30 -X POST -H "X-Nomad-Token: $NOMAD_TOKEN" \
      --data "$body" "$@" 2>&1) || {
      case "$answer" in
        *403*) answer="$answer: Permission denied; this job's workload identity needs node write: attach acl/nomad/engine-install.hcl to job $NOMAD_JOB_ID (acl/README.md)" ;;
      esac
      fail "could not record $META_KEY=$ENGINE_VERSION in the node's metadata: $answer"
    }
    echo "llmgw engine install: $NODE_NAME: $ENGINE $ENGINE_VERSION at $target; node meta $META_KEY=$ENGINE_VERSION"
  EOT
}

job "engine" {
  id          = "llmgw-engine-${var.engine}"
  name        = "llmgw-engine-${var.engine}"
  type        = "sysbatch"
  datacenters = var.datacenters

  meta {
    llmgw_engine         = var.engine
    llmgw_engine_version = var.version
  }

  group "install" {
    # Where the engine serves `check_model` for its one-token check.
    network {
      port "http" {}
    }

    # One try per node and job version: a failed check is an answer (a wrong
    # sha256 does not get right by retrying); `planner engines apply` runs the
    # install again on the nodes where it failed.
    restart {
      attempts = 0
      mode     = "fail"
    }

    task "install" {
      driver = var.driver

      identity {
        env = true
      }

      dynamic "artifact" {
        for_each = var.artifact_url != "" ? [var.artifact_url] : []
        content {
          source      = artifact.value
          destination = "local/engine/${var.command_file}"
          mode        = "file"
          options {
            checksum = "sha256:${var.artifact_sha256}"
          }
        }
      }

      env {
        ENGINE          = var.engine
        ENGINE_VERSION  = var.version
        META_KEY        = local.meta_key
        ENGINE_ARTIFACT = var.artifact_url
        ENGINE_PATH     = var.path
        ENGINE_SHA256   = var.artifact_url != "" ? "" : var.artifact_sha256
        COMMAND_FILE    = var.command_file
        INSTALL_DIR     = var.install_dir
        NOMAD_API       = var.nomad_addr
        CHECK_ARGS      = var.check_args
        CHECK_TIMEOUT_S = var.check_timeout_s
        CHECK_MODEL      = var.check_model
        CHECK_SERVE_ARGS = var.check_serve_args
        CHECK_HEALTH     = var.check_health_path
        CHECK_PATH       = var.check_request_path
        CHECK_BODY       = var.check_request_body
        NODE_ID         = "$${node.unique.id}"
        NODE_NAME       = "$${node.unique.name}"
      }

      config {
        command = "/bin/sh"
        args    = ["-c", local.script]
      }

      resources {
        cpu    = 100
        memory = var.memory_mb
      }
    }
  }
}
