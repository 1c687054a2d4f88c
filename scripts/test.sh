#!/usr/bin/env bash
# The README test command: lint, type-check, then every test not needing a real GPU against
# real local Slurm sandboxes (needs root), in phases:
#   1. Slurm 22.05 (the host's), docker + podman, enroot + pyxis, two users: the whole suite
#      but accounting (--pyxis builds enroot and pyxis once into the cache, from the tarballs
#      in $RAY_SLURM_VENDOR_DIR, default ../shared/vendor); the unit tests run while its
#      sandbox comes up; then, on the same sandbox, the core `ray up` lifecycle (autoscaler
#      v2 and v1) on the lowest Ray that pyproject.toml declares, from a venv of its own
#      ($RSP_FLOOR_VENV, default .venv-ray-floor) that pip builds while the sandbox comes up
#   2. Slurm 25.11 (built once from its tarball in $RAY_SLURM_VENDOR_DIR, with pyslurm
#      built once against it) and 26.05 (a Debian root), both built once into the cache: the
#      Slurm integration suites (CLI and REST; on 25.11 pyslurm too) and the core `ray up`
#      lifecycle (on 25.11 also over pyslurm); on 26.05 also Ray in Apptainer as an
#      ordinary user (tests/e2e/test_apptainer.py); then 25.11 --strict --accounting (rate
#      limits, MinJobAge=30, PrivateData=jobs, slurmdbd): a cluster of its sandbox user
#      (tests/e2e/test_strict.py)
#   3. Slurm 22.05 with accounting (slurmdbd on MariaDB, QOSes, typed GPUs): tests/accounting
# Extra arguments go to pytest in every phase (and to phase 1's unit run).
#   RAY_SLURM_SANDBOX_DIR  phase 1's sandbox state dir (default /tmp/rsp-sandbox; phases 2-3
#                          use it with a suffix)
#   RAY_SLURM_SANDBOX_PORT_OFFSET  shift the sandboxes' ports (to run beside another sandbox;
#                          25.11, 26.05, accounting and strict add 100, 200, 300, 400: no
#                          two phases meet)
#   RSP_PHASES             which phases to run (default "1 2 3")
#   PYTEST_TIMEOUT         per-test timeout in seconds (default 900)
#   RSP_FLOOR_VENV         the venv of the lowest declared Ray (default .venv-ray-floor)
# A sandbox this script starts is always taken down on exit; one that already ran before it
# (someone else's) is reused and left running.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN="${VENV:-$PWD/.venv}/bin"
export PATH="$BIN:$PATH"
MAIN_DIR="${RAY_SLURM_SANDBOX_DIR:-/tmp/rsp-sandbox}"
OFFSET="${RAY_SLURM_SANDBOX_PORT_OFFSET:-0}"
PHASES="${RSP_PHASES:-1 2 3}"
PYTEST=(python -m pytest -p no:cacheprovider --import-mode=importlib
        --timeout="${PYTEST_TIMEOUT:-900}")
# The core of each Slurm release: its back ends, the sandbox, and `ray up` ... `ray down`.
MATRIX=(tests/integration/test_slurm_cli_sandbox.py tests/integration/test_slurm_rest_sandbox.py
        tests/integration/test_job_arrays_sandbox.py tests/integration/test_sandbox.py
        tests/integration/test_cmds_sandbox.py tests/e2e/test_ray_up.py
        tests/e2e/test_ray_up_rest.py)
# The core lifecycle on the lowest Ray the package declares. The login side is that venv's
# `ray`, and so are the nodes: the provider runs them with the Python of `ray up`
# (provider.python), and test_job_submit_scales_up_from_zero checks that they match.
FLOOR_TESTS=(tests/e2e/test_ray_up.py tests/e2e/test_autoscaler_v1.py)
FLOOR_VENV="${RSP_FLOOR_VENV:-$PWD/.venv-ray-floor}"
EXTRA=("$@")

echo "== ruff"
ruff check .
echo "== mypy --strict"
mypy --strict

FAILED=()

# phase NAME STATE_DIR "UP ARGS" PYTEST ARGS...: in a subshell (its own environment and exit
# trap), start (or reuse) a sandbox, run pytest on it, take down what it started. Any failing
# step fails the phase, never the later phases. (Called in a `||` list, where bash ignores
# `set -e`: every step says `|| exit 1` itself.)
phase() (
  local name="$1" dir="$2" up_args="$3"
  shift 3
  echo "== sandbox ($name)"
  export RAY_SLURM_SANDBOX_DIR="$dir"
  if ray-slurm sandbox status --state-dir "$dir" >/dev/null 2>&1; then
    echo "reusing the sandbox already running at $dir (left running)"
  else
    trap 'echo "== sandbox down ($name)"; ray-slurm sandbox down --state-dir "$dir"' EXIT
    # shellcheck disable=SC2086
    if ! ray-slurm sandbox up --install $up_args --state-dir "$dir"; then
      # The EXIT trap's `down` removes the state dir: show its daemons' logs first.
      for f in "$dir"/log/*; do [ -f "$f" ] && { echo "== $f"; tail -n 40 "$f"; }; done
      exit 1
    fi
  fi
  # shellcheck disable=SC1091
  source "$dir/env.sh" || exit 1
  ray-slurm sandbox status --state-dir "$dir" | head -1
  sinfo -N -o '%N %P %T %c %m %G' || exit 1
  echo "== pytest ($name)"
  # Under CI a skipped test fails (tests/conftest.py), so "all passed" means all ran.
  local rc=0
  "${PYTEST[@]}" "$@" || rc=1
  # More tests for this sandbox before it goes down (phase 1: floor_e2e).
  if [ -n "${AFTER_PYTEST:-}" ]; then "$AFTER_PYTEST"; fi
  exit "$rc"
)

# The lowest Ray version pyproject.toml declares (`ray[default]>=X,...`).
floor_ray() { sed -n 's/^ *"ray\[default\]>=\([0-9.]*\),.*/\1/p' pyproject.toml; }

# floor_venv: the venv of the lowest declared Ray, with this package (editable) and its test
# tools; pip keeps Ray at that version (a constraint, as a pin in pyproject.toml would not).
floor_venv() {
  local want c rc=0
  want="$(floor_ray)"
  if [ -z "$want" ]; then echo "no ray[default]>=X,... in pyproject.toml"; return 1; fi
  if [ ! -x "$FLOOR_VENV/bin/python" ]; then python3 -m venv "$FLOOR_VENV" || return 1; fi
  c="$(mktemp)"
  echo "ray==$want" >"$c"
  "$FLOOR_VENV/bin/pip" install -q -c "$c" -e '.[dev]' || rc=1
  rm -f "$c"
  return "$rc"
}

# floor_e2e (phase 1's AFTER_PYTEST, on its sandbox): wait for the venv that pip built
# meanwhile, run FLOOR_TESTS with it, leave the outcome in $floor_rc for the failure list.
floor_e2e() {
  echo "== pytest (Ray $(floor_ray), the lowest pyproject.toml declares)"
  while [ ! -s "$floor_built" ]; do sleep 2; done
  if [ "$(cat "$floor_built")" != 0 ]; then
    echo "the venv of Ray $(floor_ray) could not be built:"
    tail -n 40 "$floor_log"
    echo 1 >"$floor_rc"
    return
  fi
  "$FLOOR_VENV/bin/ray" --version
  if "$FLOOR_VENV/bin/python" -m pytest -p no:cacheprovider --import-mode=importlib \
      --timeout="${PYTEST_TIMEOUT:-900}" -m 'not gpu' "${FLOOR_TESTS[@]}" "${EXTRA[@]}"; then
    echo 0 >"$floor_rc"
  else
    echo 1 >"$floor_rc"
  fi
}

for p in $PHASES; do
  case "$p" in
    1) # The unit tests need no sandbox: they run while phase 1's sandbox comes up (mostly
       # waiting on apt, image builds and daemons), their output shown after the phase.
       unit_log="$(mktemp)"
       "${PYTEST[@]}" -m 'not gpu' tests/unit "$@" >"$unit_log" 2>&1 &
       unit_pid=$!
       # pip builds the lowest Ray's venv while the sandbox comes up too (floor_e2e).
       floor_log="$(mktemp)" floor_built="$(mktemp)" floor_rc="$(mktemp)"
       # (`|| rc=$?`: under `set -e` a failed build would end the group before it says so.)
       { rc=0; floor_venv >"$floor_log" 2>&1 || rc=$?; echo "$rc" >"$floor_built"; } &
       floor_pid=$!
       # --users 2: two throwaway Unix users for the shared-cluster tests (test_two_users.py);
       # --login: their login node over SSH, for `ray up` from a "laptop" (test_laptop_tunnels.py).
       name="Slurm 22.05, docker, podman, pyxis, 2 users"
       AFTER_PYTEST=floor_e2e phase "$name" "$MAIN_DIR" \
         "--docker --pyxis --users 2 --login --port-offset $OFFSET" \
         -m 'not gpu and not accounting and not apptainer and not strict and not cgroups' \
         --ignore=tests/unit tests/ "$@" \
         || FAILED+=("$name")
       wait "$floor_pid"  # when the sandbox failed before floor_e2e waited for the venv
       [ "$(cat "$floor_rc")" = 0 ] || FAILED+=("Ray $(floor_ray) (lowest declared), Slurm 22.05")
       rm -f "$floor_log" "$floor_built" "$floor_rc"
       echo "== pytest (unit tests, run while phase 1's sandbox came up)"
       cat "$unit_log"
       rm -f "$unit_log"
       wait "$unit_pid" || FAILED+=("unit tests") ;;
    2) # 25.11 replaces 24.11 (`--slurm 24.11` stays available), with pyslurm built against it
       # (the pyslurm transport runs in its integration and lifecycle suites); one sandbox user.
       # The REST outage runs in phase 1; here the head's autoscaler speaks pyslurm.
       phase "Slurm 25.11, pyslurm" "$MAIN_DIR-25.11" \
         "--slurm 25.11 --pyslurm --users 1 --port-offset $((OFFSET + 100))" \
         -m 'not gpu' "${MATRIX[@]}" \
         "tests/e2e/test_outage_transports.py::test_outage_loses_nothing[pyslurm]" "$@" \
         || FAILED+=("Slurm 25.11, pyslurm")
       # 26.05's root packages Apptainer, which runs as an ordinary user: one sandbox user.
       phase "Slurm 26.05, apptainer" "$MAIN_DIR-26.05" \
         "--slurm 26.05 --users 1 --port-offset $((OFFSET + 200))" \
         -m 'not gpu' "${MATRIX[@]}" tests/e2e/test_apptainer.py "$@" \
         || FAILED+=("Slurm 26.05")
       # A strict controller (issue 29): rate limiting, MinJobAge and PrivateData exempt root,
       # so its module runs the cluster as the one sandbox user; 4 CPUs a node: 8 workers
       # beside the head and a drained worker. Its own sandbox: the matrix above runs as root
       # on a plain one. With accounting (slurmdbd 25.11): sacct knows the jobs MinJobAge
       # purged from the controller.
       phase "Slurm 25.11 strict, accounting" "$MAIN_DIR-strict" \
         "--slurm 25.11 --accounting --users 1 --strict --cpus-per-node 4 \
          --port-offset $((OFFSET + 400))" \
         -m 'not gpu' tests/e2e/test_strict.py "$@" \
         || FAILED+=("Slurm 25.11 strict, accounting") ;;
    3) name="Slurm 22.05 with accounting"
       phase "$name" "$MAIN_DIR-acct" "--accounting --users 2 --port-offset $((OFFSET + 300))" \
         -m accounting tests/accounting "$@" || FAILED+=("$name")
       # Slurm's cgroups (cgroup v1 here; 22.05 only): a task on the job's cores, a full
       # object store without an OOM kill (issue 29.3).
       name="Slurm 22.05 with task/cgroup"
       phase "$name" "$MAIN_DIR-cgroups" "--cgroups --port-offset $((OFFSET + 500))" \
         -m cgroups tests/e2e/test_cgroups.py "$@" || FAILED+=("$name") ;;
    *) echo "unknown phase $p (phases: 1 2 3)" >&2; exit 2 ;;
  esac
done

if [ ${#FAILED[@]} -gt 0 ]; then
  printf '== FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "== all phases passed: $PHASES"
