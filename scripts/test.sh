#!/usr/bin/env bash
# The README test command: lint, type-check, then every test not needing a real GPU against
# real local Slurm sandboxes (needs root), in phases:
#   1. Slurm 22.05 (the host's), docker + podman, enroot + pyxis, two users: the whole suite
#      but accounting (--pyxis builds enroot and pyxis once into the cache, from the tarballs
#      in $RAY_SLURM_VENDOR_DIR, default ../shared/vendor); the unit tests run while its
#      sandbox comes up
#   2. Slurm 25.11 (built once from its tarball in $RAY_SLURM_VENDOR_DIR) and 26.05 (a
#      Debian root), both built once into the cache: the Slurm
#      integration suites (CLI and REST) and the core `ray up` lifecycle; on 26.05 also
#      Ray in Apptainer as an ordinary user (tests/e2e/test_apptainer.py)
#   3. Slurm 22.05 with accounting (slurmdbd on MariaDB, QOSes, typed GPUs): tests/accounting
# Extra arguments go to pytest in every phase (and to phase 1's unit run).
#   RAY_SLURM_SANDBOX_DIR  phase 1's sandbox state dir (default /tmp/rsp-sandbox; phases 2-3
#                          use it with a suffix)
#   RAY_SLURM_SANDBOX_PORT_OFFSET  shift the sandboxes' ports (to run beside another sandbox;
#                          25.11, 26.05 and accounting add 100, 200, 300: no two phases meet)
#   RSP_PHASES             which phases to run (default "1 2 3")
#   PYTEST_TIMEOUT         per-test timeout in seconds (default 900)
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
  "${PYTEST[@]}" "$@"
)

for p in $PHASES; do
  case "$p" in
    1) # The unit tests need no sandbox: they run while phase 1's sandbox comes up (mostly
       # waiting on apt, image builds and daemons), their output shown after the phase.
       unit_log="$(mktemp)"
       "${PYTEST[@]}" -m 'not gpu' tests/unit "$@" >"$unit_log" 2>&1 &
       unit_pid=$!
       # --users 2: two throwaway Unix users for the shared-cluster tests (test_two_users.py);
       # --login: their login node over SSH, for `ray up` from a "laptop" (test_laptop_tunnels.py).
       name="Slurm 22.05, docker, podman, pyxis, 2 users"
       phase "$name" "$MAIN_DIR" "--docker --pyxis --users 2 --login --port-offset $OFFSET" \
         -m 'not gpu and not accounting and not apptainer' --ignore=tests/unit tests/ "$@" \
         || FAILED+=("$name")
       echo "== pytest (unit tests, run while phase 1's sandbox came up)"
       cat "$unit_log"
       rm -f "$unit_log"
       wait "$unit_pid" || FAILED+=("unit tests") ;;
    2) # 25.11 replaces 24.11 (`--slurm 24.11` stays available); one sandbox user.
       phase "Slurm 25.11" "$MAIN_DIR-25.11" \
         "--slurm 25.11 --users 1 --port-offset $((OFFSET + 100))" \
         -m 'not gpu' "${MATRIX[@]}" "$@" || FAILED+=("Slurm 25.11")
       # 26.05's root packages Apptainer, which runs as an ordinary user: one sandbox user.
       phase "Slurm 26.05, apptainer" "$MAIN_DIR-26.05" \
         "--slurm 26.05 --users 1 --port-offset $((OFFSET + 200))" \
         -m 'not gpu' "${MATRIX[@]}" tests/e2e/test_apptainer.py "$@" \
         || FAILED+=("Slurm 26.05") ;;
    3) name="Slurm 22.05 with accounting"
       phase "$name" "$MAIN_DIR-acct" "--accounting --users 2 --port-offset $((OFFSET + 300))" \
         -m accounting tests/accounting "$@" || FAILED+=("$name") ;;
    *) echo "unknown phase $p (phases: 1 2 3)" >&2; exit 2 ;;
  esac
done

if [ ${#FAILED[@]} -gt 0 ]; then
  printf '== FAILED: %s\n' "${FAILED[@]}"
  exit 1
fi
echo "== all phases passed: $PHASES"
