"""The controller-outage scenario over the REST and pyslurm transports: the daemon the head's
autoscaler talks to is stopped for 30 s while it scales up (slurmrestd for REST; slurmctld
for pyslurm, which speaks to it directly) -> no duplicate job, no Ray node terminated,
scaling resumes within two ticks of the restart. The CLI half is in test_hardening.py
(slurmctld down for 60 s). Six failed ticks show a client's handling as well as twelve: the
shorter outage keeps the suite's time down. pyslurm runs on a sandbox started with
--pyslurm (25.11; CI names its case there, `[pyslurm]`)."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ray_slurm_provider.sandbox import Sandbox
from tests.e2e.harness import RAY_DEFAULT_TICK, ROOT, RayCluster, apis, brought_up
from tests.e2e.outage import outage

pytestmark = [pytest.mark.e2e]
#: The daemon each transport needs, and what the head's provider logs while it is down.
DOWN = {"rest": ("slurmrestd", r"ERROR .*slurmrestd"),
        "pyslurm": ("slurmctld", r"Unable to contact slurm controller")}


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rsp-hard-rest-"))  # outside pytest's rotated basetemp
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module", params=apis())
def cluster(sandbox: Sandbox, workdir: Path,
            request: pytest.FixtureRequest) -> Iterator[RayCluster]:
    cfg = yaml.safe_load((ROOT / "cluster-configs" / "sandbox-rest.yaml").read_text())
    cfg["provider"]["slurm_api"] = request.param
    del cfg["available_node_types"]["gpu_worker"]
    cfg["available_node_types"]["cpu_worker"]["max_workers"] = 2
    c = RayCluster(workdir, f"hard-{request.param}", cfg)
    c.extra_env.update(RAY_DEFAULT_TICK)  # its tests count ticks
    with brought_up(c):
        yield c


def test_outage_loses_nothing(cluster: RayCluster, sandbox: Sandbox, workdir: Path) -> None:
    api = yaml.safe_load(cluster.path.read_text())["provider"]["slurm_api"]
    daemon, failure = DOWN[api]
    figures = outage(cluster, sandbox, daemon, Path(tempfile.mkdtemp(dir=workdir)), failure,
                     down_s=30)
    print("HARDENING", json.dumps({f"outage ({daemon}, {api})": figures}))
