"""The controller-outage scenario over the REST transport: slurmrestd stopped for 30 s while
the autoscaler (speaking REST) scales up -> no duplicate job, no Ray node terminated, scaling
resumes within two ticks of the restart. The CLI half is in test_hardening.py (slurmctld
down for 60 s). Six failed ticks show the REST client's handling as well as twelve: the
shorter outage keeps the suite's time down."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ray_slurm_provider.sandbox import Sandbox
from tests.e2e.harness import RAY_DEFAULT_TICK, ROOT, RayCluster, brought_up
from tests.e2e.outage import outage

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="rsp-hard-rest-"))  # outside pytest's rotated basetemp
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(sandbox: Sandbox, workdir: Path) -> Iterator[RayCluster]:
    cfg = yaml.safe_load((ROOT / "cluster-configs" / "sandbox-rest.yaml").read_text())
    del cfg["available_node_types"]["gpu_worker"]
    cfg["available_node_types"]["cpu_worker"]["max_workers"] = 2
    c = RayCluster(workdir, "hard-rest", cfg)
    c.extra_env.update(RAY_DEFAULT_TICK)  # its tests count ticks
    with brought_up(c):
        yield c


def test_slurmrestd_outage_loses_nothing(cluster: RayCluster, sandbox: Sandbox,
                                         workdir: Path) -> None:
    figures = outage(cluster, sandbox, "slurmrestd", Path(tempfile.mkdtemp(dir=workdir)),
                     r"ERROR .*slurmrestd", down_s=30)
    print("HARDENING", json.dumps({"outage (slurmrestd)": figures}))
