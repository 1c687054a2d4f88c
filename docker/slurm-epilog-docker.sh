#!/bin/sh
# Slurm Epilog for ray-slurm-provider's Docker runtime: remove every container of the job that
# just ended. Each Ray node container carries the label `slurm.job_id=<job id>`, and Slurm runs
# the Epilog as root on each node of the job after the job ends, also after a SIGKILL at the end
# of KillWait or a time-limit kill, which no trap inside the job survives.
#
# Install on every compute node (root-owned, mode 0755), then `scontrol reconfigure`:
#   install -m 0755 docker/slurm-epilog-docker.sh /etc/slurm/epilog.d/50-docker-containers.sh
#   slurm.conf:  Epilog=/etc/slurm/epilog.d/*   (a glob runs every matching script; see
#                slurm.conf(5), 22.05)  or  Epilog=/etc/slurm/epilog.d/50-docker-containers.sh
# An Epilog that exits non-zero drains the node, so this script always exits 0; what it could
# not do goes to syslog (tag slurm-epilog-docker).
#
# Site settings (edit here; slurmd gives the Epilog a minimal environment):
#   DOCKER_HOST     the daemon's socket, when it is not the default unix:///var/run/docker.sock
#   DOCKER          the docker executable
#   EPILOG_TIMEOUT  seconds for each of the two docker calls; keep twice this well under
#                   slurm.conf's PrologEpilogTimeout, if set: an Epilog that times out drains
#                   the node
PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
DOCKER=${DOCKER:-docker}
EPILOG_TIMEOUT=${EPILOG_TIMEOUT:-30}
export PATH
[ -n "${DOCKER_HOST:-}" ] && export DOCKER_HOST

log() {
    logger -t slurm-epilog-docker -- "job ${SLURM_JOB_ID:-?}: $*" 2>/dev/null || true
}

# Not run by slurmd for a job, or Docker is not installed on this node: nothing to do.
case "${SLURM_JOB_ID:-}" in
    ''|*[!0-9]*) exit 0 ;;
esac
command -v "$DOCKER" >/dev/null 2>&1 || exit 0

if ! ids=$(timeout "$EPILOG_TIMEOUT" "$DOCKER" ps -aq \
        --filter "label=slurm.job_id=${SLURM_JOB_ID}" 2>/dev/null); then
    log "could not list containers (docker ps failed or took over ${EPILOG_TIMEOUT}s)"
    exit 0
fi
[ -n "$ids" ] || exit 0
list=$(printf '%s\n' "$ids" | tr '\n' ' ')

# shellcheck disable=SC2086  # one argument per container id
if ! out=$(timeout "$EPILOG_TIMEOUT" "$DOCKER" rm -f $ids 2>&1); then
    log "could not remove containers ${list}: $out"
    exit 0
fi
log "removed containers ${list}"
exit 0
