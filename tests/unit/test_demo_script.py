"""scripts/demo.sh (README command 1) run against recording stand-ins for `ray-slurm`, `ray`,
`sinfo` and `squeue`: no sandbox, no Slurm, no Ray."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FAKE_RAY_SLURM = r"""#!/bin/bash
echo "ray-slurm $*" >> "$DEMO_LOG"
if [ "$1 $2" = "sandbox up" ]; then
  dir="${RAY_SLURM_SANDBOX_DIR:-/nonexistent/default}"
  args=("$@")
  for i in "${!args[@]}"; do [ "${args[$i]}" = --state-dir ] && dir="${args[$((i + 1))]}"; done
  mkdir -p "$dir" && echo "export SANDBOX_ENV=$dir" > "$dir/env.sh"
fi
"""
FAKE = '#!/bin/bash\necho "$(basename "$0") $* env=${SANDBOX_ENV:-}" >> "$DEMO_LOG"\n'


def run_demo(tmp_path: Path, env: dict[str, str]) -> list[str]:
    """Run a copy of demo.sh whose venv holds the stand-ins; the commands it ran."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "demo.sh", repo / "scripts" / "demo.sh")
    venv = repo / ".venv" / "bin"
    venv.mkdir(parents=True)
    for name, text in [("ray-slurm", FAKE_RAY_SLURM), ("ray", FAKE), ("sinfo", FAKE),
                       ("squeue", FAKE)]:
        (venv / name).write_text(text)
        (venv / name).chmod(0o755)
    log = tmp_path / "log"
    subprocess.run(["bash", str(repo / "scripts" / "demo.sh")], check=True, timeout=60,
                   env={"PATH": os.environ["PATH"], "DEMO_LOG": str(log), **env},
                   capture_output=True)
    return log.read_text().splitlines()


def test_demo_takes_the_sandbox_state_dir_and_port_offset(tmp_path: Path) -> None:
    """Issue 26.18: as scripts/test.sh does, demo.sh honours RAY_SLURM_SANDBOX_DIR and
    RAY_SLURM_SANDBOX_PORT_OFFSET (to run beside another sandbox), and says so in its header."""
    state = tmp_path / "sbx"
    ran = run_demo(tmp_path, {"RAY_SLURM_SANDBOX_DIR": str(state),
                              "RAY_SLURM_SANDBOX_PORT_OFFSET": "7"})
    assert ran[0] == f"ray-slurm sandbox up --install --port-offset 7 --state-dir {state}"
    assert f"ray up -y cluster-configs/sandbox.yaml env={state}" in ran  # its env.sh
    assert f"ray down -y cluster-configs/sandbox.yaml env={state}" in ran
    assert ran[-1] == f"ray-slurm sandbox down --state-dir {state}"
    header = (ROOT / "scripts" / "demo.sh").read_text().split("\nset -euo")[0]
    assert "RAY_SLURM_SANDBOX_DIR" in header and "RAY_SLURM_SANDBOX_PORT_OFFSET" in header
