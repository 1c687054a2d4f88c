"""A new user's first steps, on the real sandbox (issue 14: 14, 15).

* The README's typed steps under command 1 work as typed, from the repository's root, in a
  shell that has nothing of ours on PATH yet (they used to start with `ray-slurm: command not
  found`). The sandbox's own steps (`ray-slurm sandbox up`/`down`) are left out: the suite's
  running sandbox stands in for them (it has another shape, so `up` would refuse it).
* Ray's config cache (`/tmp/ray-config-<hash>`, keyed on the YAML's contents) kept
  `provider.python` from another checkout, and `ray up` then ran the head on that checkout's
  venv, silently. A cache that names a Python that does not exist must not matter.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.harness import ROOT, RayCluster, squeue

pytestmark = [pytest.mark.e2e]
README = ROOT / "README.md"
CONFIG = ROOT / "cluster-configs" / "sandbox.yaml"


def typed_steps() -> list[str]:
    """The shell lines of the README's "type them yourself" block under command 1."""
    text = README.read_text()
    block = text.split("which you can also type yourself", 1)[1]
    body = block.split("```bash", 1)[1].split("```", 1)[0]
    return [line for line in body.splitlines() if line.strip()]


def test_the_readme_typed_steps_work_as_typed(sandbox: object) -> None:
    steps = typed_steps()
    assert steps[0].startswith("python3 -m venv .venv") and "export PATH" in steps[1]
    assert steps[-1].strip() == "ray-slurm sandbox down"
    assert steps[2].startswith("ray-slurm sandbox up --install")
    script = "set -euo pipefail\n" + "\n".join([*steps[:2], *steps[3:-1]]) + "\n"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RAY_", "SLURM_")) and k != "VIRTUAL_ENV"}
    venv_bin = str(ROOT / ".venv" / "bin")
    env["PATH"] = ":".join(p for p in env.get("PATH", "").split(":") if p != venv_bin)
    try:
        cp = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=900, check=False)
    finally:
        subprocess.run(["bash", "-c", f"export PATH={venv_bin}:$PATH; "
                        "ray down -y cluster-configs/sandbox.yaml"], cwd=ROOT, env=env,
                       capture_output=True, timeout=300, check=False)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out[-4000:]
    assert "command not found" not in out
    assert "task 3 ran on Ray node" in out  # examples/hello.py, on autoscaled workers
    assert squeue("ray-sandbox") == [], out[-3000:]


@pytest.fixture
def cache_cluster(sandbox: object) -> Iterator[RayCluster]:
    c = RayCluster.from_file(Path(tempfile.mkdtemp(prefix="rsp-cache-")), "e2e-cache", CONFIG)
    try:
        yield c
    finally:
        c.down()
        c.cleanup()


def test_a_cached_config_never_runs_another_checkouts_python(
        cache_cluster: RayCluster) -> None:
    c = cache_cluster
    t0 = time.time()
    c.ray("up", "-y", str(c.path))  # with Ray's config cache, as a user types it
    c.down()
    caches = [p for p in Path(tempfile.gettempdir()).glob("ray-config-*")
              if p.stat().st_mtime >= t0 - 1 and c.name in p.read_text()]
    assert len(caches) == 1, caches
    cache = caches[0]
    try:
        data = json.loads(cache.read_text())
        provider = data["config"]["provider"]
        assert provider.get("_python_auto") is True
        provider["python"] = "/nonexistent/other-checkout/.venv/bin/python"  # not ours
        cache.write_text(json.dumps(data))
        c.ray("up", "-y", str(c.path))  # the cached config: must still start the head
        head = c.head()
        agent = c.cdir.node(str(head["job_id"])).read_agent()
        assert agent is not None and agent.kind == "head"
        boot = json.loads(c.cdir.bootstrap_config.read_text())
        assert boot["provider"]["python"] != "/nonexistent/other-checkout/.venv/bin/python"
    finally:
        cache.unlink(missing_ok=True)
