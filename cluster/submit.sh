#!/usr/bin/env bash
# Submit memra-dist to a Ray cluster with `ray job submit`.
#
#   RAY_ADDRESS=http://127.0.0.1:8265 \
#   OTEL_EXPORTER_OTLP_ENDPOINT=http://<collector>:4317 \
#   cluster/submit.sh                                  # runs: memra-dist demo --pp 2
#   cluster/submit.sh generate --model /models/x --prompt "..." --pp 2
#
# Arguments after the script name are memra-dist's (default: demo --pp 2). Extra flags for
# `ray job submit` itself go in RAY_SUBMIT_ARGS (e.g. "--no-wait --submission-id my-run").
#
# Ray token authentication (on by default in Ray 2.60; never turned off here): the job API
# needs the cluster's token. Give it in ONE of these ways on the submitting machine:
#   export RAY_AUTH_TOKEN=...              (e.g. from your secret manager)
#   export RAY_AUTH_TOKEN_PATH=/path/file  (a file holding the token)
#   ~/.ray/auth_token                      (what `ray get-auth-token --generate` writes)
# The token is read by the ray CLI locally; it is never put into the runtime env.
#
# Every OTEL_* variable set here (endpoint, protocol, headers, service name, TLS certificate
# paths as seen ON THE CLUSTER) is passed to the driver and every actor through env_vars.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
: "${RAY_ADDRESS:=http://127.0.0.1:8265}"
export RAY_ADDRESS

if [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ] && [ ! -s "$HOME/.ray/auth_token" ]; then
  echo "submit.sh: no Ray token: set RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH, or run 'ray get-auth-token' (see cluster/README.md)" >&2
  exit 2
fi
export RAY_AUTH_MODE=token

# the merged runtime env goes to a private temp file, not the command line (OTEL headers may
# hold an exporter's auth header; `ps` would show a command-line argument)
umask 077
RUNTIME_ENV_FILE="$(mktemp "${TMPDIR:-/tmp}/memra-runtime-env.XXXXXX")"
trap 'rm -f "$RUNTIME_ENV_FILE"' EXIT
python3 - "$HERE/runtime_env.yaml" "$ROOT" > "$RUNTIME_ENV_FILE" <<'PY'
import json, os, sys
import yaml
env = yaml.safe_load(open(sys.argv[1]))
env["working_dir"] = sys.argv[2]
env.setdefault("env_vars", {}).update({k: v for k, v in os.environ.items() if k.startswith("OTEL_")})
print(json.dumps(env))
PY

if [ "$#" -eq 0 ]; then set -- demo --pp 2; fi
# shellcheck disable=SC2086  # RAY_SUBMIT_ARGS is a list of flags by design
ray job submit --address "$RAY_ADDRESS" --runtime-env "$RUNTIME_ENV_FILE" ${RAY_SUBMIT_ARGS:-} \
  -- python -m memra_dist.cli "$@"
