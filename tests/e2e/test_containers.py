"""Ray in Docker and in Podman containers on the sandbox, live:
`cluster-configs/sandbox-docker.yaml` and `cluster-configs/sandbox-podman.yaml`.

The image is built here without a registry (`ray-slurm sandbox image`). Checks: `ray up`,
`ray exec` runs inside the head's container, an autoscaled worker runs in its own container,
`ray job submit`, a worker job cancelled by hand loses its container within 15 s, `ray down`
leaves no container of the cluster.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator

import pytest
import yaml

from ray_slurm_provider.provider.defaults import ENV as DEFAULTS_ENV
from ray_slurm_provider.sandbox.image import PODMAN_ARGS
from tests.e2e.harness import ROOT, RayCluster, wait_for

pytestmark = [pytest.mark.e2e]
TIMINGS: dict[str, float] = {}
CLI = {"docker": ["docker"], "podman": ["podman", *PODMAN_ARGS]}
LABEL = {"docker": '{{.Label "slurm.job_id"}}', "podman": '{{index .Labels "slurm.job_id"}}'}


def containers(cluster: RayCluster) -> dict[str, str]:
    """name -> slurm job id of the cluster's containers (running or not)."""
    rt = cluster.name.rsplit("-", 1)[1]
    out = subprocess.run([*CLI[rt], "ps", "-a", "--filter",
                          f"label=ray-slurm.cluster={cluster.name}",
                          "--format", "{{.Names}} " + LABEL[rt]],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


@pytest.fixture(scope="module", params=["docker", "podman"])
def cluster(request: pytest.FixtureRequest, sandbox: object,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[RayCluster]:
    rt = request.param
    if rt == "docker" and not os.environ.get("DOCKER_HOST"):
        pytest.fail("the sandbox runs no dockerd: start it with `ray-slurm sandbox up --docker`")
    t0 = time.monotonic()
    subprocess.run([str(ROOT / ".venv" / "bin" / "ray-slurm"), "sandbox", "image", "--runtime",
                    rt], check=True, timeout=300)
    TIMINGS[f"{rt}: image build"] = time.monotonic() - t0
    config = ROOT / "cluster-configs" / f"sandbox-{rt}.yaml"
    tmp = tmp_path_factory.mktemp(rt)
    c = RayCluster.from_file(tmp, f"e2e-{rt}", config)
    # Issue 17.4: a site defaults file supplies the container mounts (the example's own plus
    # one) and a partition, which the YAML overrides.
    raw = yaml.safe_load(c.path.read_text())
    mounts = [*raw["available_node_types"]["head"]["node_config"]["container"].pop("mounts"),
              f"{tmp / 'site'}:/site:ro"]
    for nt in raw["available_node_types"].values():
        nt["node_config"]["container"].pop("mounts", None)
    c.path.write_text(yaml.safe_dump(raw))
    (tmp / "site").mkdir()
    (tmp / "site" / "marker").write_text("from the site mount\n")
    site = tmp / "defaults.yaml"
    site.write_text(yaml.safe_dump({"node_config": {"partition": "gpu",
                                                    "container": {"mounts": mounts}}}))
    c.extra_env[DEFAULTS_ENV] = str(site)
    try:
        TIMINGS[f"{rt}: ray up"] = c.up()
        yield c
    finally:
        c.down()
        c.cleanup()
        print("TIMINGS", json.dumps({k: round(v, 1) for k, v in TIMINGS.items()}))


def test_head_runs_in_its_container(cluster: RayCluster) -> None:
    head = cluster.head()["job_id"]
    assert containers(cluster) == {f"rsp-{cluster.name}-{head}": head}
    out = cluster.ray("exec", str(cluster.path),
                      "(test -f /.dockerenv || test -f /run/.containerenv) && echo IN_CONTAINER;"
                      " echo JOB=$SLURM_JOB_ID").stdout
    assert "IN_CONTAINER" in out and f"JOB={head}" in out
    log = cluster.cdir.log(head).read_text()
    assert "Slurm is reachable from inside the head's container" in log


def test_site_defaults_supply_the_mounts_and_the_yaml_its_partition(
        cluster: RayCluster) -> None:
    head = str(cluster.head()["job_id"])
    part = subprocess.run(["squeue", "-h", "-j", head, "-o", "%P"], capture_output=True,
                          text=True, timeout=30, check=True).stdout.strip()
    assert part == "cpu"  # the YAML's, over the defaults file's gpu
    out = cluster.ray("exec", str(cluster.path), "cat /site/marker").stdout
    assert "from the site mount" in out
    cp = subprocess.run([str(ROOT / ".venv" / "bin" / "ray-slurm"), "validate", "--offline",
                         str(cluster.path)], capture_output=True, text=True, timeout=120,
                        env=cluster.env(), check=False)
    site = cluster.extra_env[DEFAULTS_ENV]
    assert "node_config.container.mounts = " in cp.stdout and site in cp.stdout, cp.stdout
    assert "node_config.partition" not in cp.stdout  # every node type sets its own


def test_autoscaled_worker_runs_in_a_container(cluster: RayCluster) -> None:
    t0 = time.monotonic()
    out = cluster.submit(
        "import ray, os; ray.init();"
        "f = ray.remote(num_cpus=1)(lambda: os.path.exists('/.dockerenv') or"
        " os.path.exists('/run/.containerenv'));"
        "print('IN_CONTAINER', ray.get(f.remote()))", timeout=600)
    TIMINGS[f"{cluster.name}: demand -> task done in new worker container"] = time.monotonic() - t0
    assert "IN_CONTAINER True" in out
    assert len(containers(cluster)) >= 2


def test_cancelled_worker_loses_its_container(cluster: RayCluster) -> None:
    head = cluster.head()["job_id"]
    workers = {n: j for n, j in containers(cluster).items() if j != head}
    assert workers
    name, job = next(iter(workers.items()))
    t0 = time.monotonic()
    subprocess.run(["scancel", job], check=True, timeout=30)
    wait_for(lambda: name not in containers(cluster), 15, f"container {name} to go",
             every=0.2)
    TIMINGS[f"{cluster.name}: scancel -> container gone"] = time.monotonic() - t0


def test_down_leaves_no_container(cluster: RayCluster) -> None:
    t0 = time.monotonic()
    cluster.down()
    wait_for(lambda: containers(cluster) == {}, 30, "no container of the cluster",
             every=0.2)
    TIMINGS[f"{cluster.name}: ray down -> no container"] = time.monotonic() - t0
    assert cluster.jobs() == []  # `ray down` returned once Slurm had ended them (issue 18)
