#!/usr/bin/env bash
# README command 1: the whole lifecycle of a Ray cluster on the local Slurm sandbox.
# Installs what is missing, starts the sandbox, `ray up`, runs a sample Ray job with visible
# output, `ray down`, and stops the sandbox. Needs root (the sandbox runs Slurm's daemons).
#   RAY_SLURM_SANDBOX_DIR          the sandbox's state dir (default /tmp/rsp-sandbox)
#   RAY_SLURM_SANDBOX_PORT_OFFSET  shift the sandbox's ports, to run beside another sandbox
#                                  (default 0), as scripts/test.sh does
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${RAY_SLURM_SANDBOX_DIR:-/tmp/rsp-sandbox}"
OFFSET="${RAY_SLURM_SANDBOX_PORT_OFFSET:-0}"

if [ ! -x .venv/bin/ray-slurm ]; then
  python3 -m venv .venv
  .venv/bin/pip install -q -e .  # the package alone: the demo needs no test tools
fi
export PATH="$PWD/.venv/bin:$PATH"

ray-slurm sandbox up --install --port-offset "$OFFSET" --state-dir "$DIR"
# shellcheck disable=SC1091
source "$DIR/env.sh"
# On the way out (an error, Ctrl-C): take the cluster down unless that already happened.
cluster_up=0
trap '[ "$cluster_up" = 0 ] || ray down -y cluster-configs/sandbox.yaml || true
      ray-slurm sandbox down --state-dir "$DIR"' EXIT

sinfo -N -o '%N %P %T %c %m %G'
cluster_up=1
time ray up -y cluster-configs/sandbox.yaml
eval "$(ray-slurm env cluster-configs/sandbox.yaml)"
ray job submit --working-dir examples -- python hello.py
squeue --name=ray-sandbox -o '%i %j %T %N %L'
time ray down -y cluster-configs/sandbox.yaml
cluster_up=0
