"""`ray up` ... `ray down` with `provider.slurm_api: rest`, and on a sandbox started with
`--pyslurm` (25.11) also with `slurm_api: pyslurm`: every job the provider submits, lists and
cancels (on the login node and in the head's autoscaler) goes through the sandbox's real
slurmrestd, or the real pyslurm. One small cluster per transport, one scale-up, then down.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ray_slurm_provider.cli import main as cli
from ray_slurm_provider.jobs import temp_dir
from ray_slurm_provider.sandbox import Sandbox, roots
from tests.e2e.harness import ROOT, RayCluster, apis, squeue, wait_for

pytestmark = [pytest.mark.e2e]
CONFIG = ROOT / "cluster-configs" / "sandbox-rest.yaml"


@pytest.fixture(scope="module", params=apis())
def cluster(sandbox: object, tmp_path_factory: pytest.TempPathFactory,
            request: pytest.FixtureRequest) -> Iterator[RayCluster]:
    api = request.param
    config = yaml.safe_load(CONFIG.read_text())
    config["provider"]["slurm_api"] = api
    c = RayCluster(tmp_path_factory.mktemp(f"e2e-{api}"), f"e2e-{api}", config)
    try:
        t0 = time.monotonic()
        c.up()
        print(f"TIMINGS ray up ({api}): {time.monotonic() - t0:.1f}s")
        yield c
    finally:
        c.down()
        c.cleanup()


def api(cluster: RayCluster) -> str:
    return str(yaml.safe_load(cluster.path.read_text())["provider"]["slurm_api"])


def test_head_autoscaler_uses_the_transport(cluster: RayCluster) -> None:
    boot = yaml.safe_load(cluster.cdir.bootstrap_config.read_text())
    assert boot["provider"]["slurm_api"] == api(cluster)
    if api(cluster) == "rest":
        rest = boot["provider"]["rest"]
        assert rest["url"].startswith("http://127.0.0.1:")
        assert rest["jwt_file"].endswith("jwt.token")


def test_scale_up_through_the_transport(cluster: RayCluster, sandbox: Sandbox,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    head = cluster.head()["job_id"]
    t0 = time.monotonic()
    out = cluster.submit(
        "import ray; ray.init();"
        "f = ray.remote(num_cpus=1)(lambda: ray.get_runtime_context().get_node_id());"
        "print('NODES', len(set(ray.get([f.remote() for _ in range(2)]))))", timeout=600)
    print(f"TIMINGS demand -> task done on a worker submitted over {api(cluster)}: "
          f"{time.monotonic() - t0:.1f}s")
    assert re.search(r"NODES [12]", out), out
    workers = [j for j, _ in cluster.jobs() if j != head]
    assert workers
    # The head's autoscaler used the transport (its provider logs to monitor.*): it
    # negotiated slurmrestd's API, or loaded the real pyslurm.
    logs = Path(temp_dir("/tmp", head)) / "session_latest" / "logs"
    text = "".join(p.read_text(errors="replace") for p in logs.glob("monitor*"))
    if api(cluster) == "rest":
        # The newest version both sides know: v0.0.38 on 22.05, v0.0.42 on 24.11, v0.0.44
        # on 25.11 and 26.05.
        assert f"speaks {roots.rest_version(sandbox.spec.slurm)}" in text
    else:
        assert f"pyslurm {sandbox.spec.slurm}." in text
    capsys.readouterr()
    assert cli.main(["status", str(cluster.path), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["nodes"]
    assert {r["kind"] for r in rows} >= {"head", "worker"}
    assert [r["ray_up"] for r in rows if r["kind"] == "head"] == [True]


def test_down_through_the_transport_leaves_nothing(cluster: RayCluster) -> None:
    cluster.down()
    wait_for(lambda: squeue(f"ray-{cluster.name}") == [], 60, "jobs to leave squeue")
