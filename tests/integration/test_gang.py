"""The launcher on a real (in-process) 2-node Ray cluster with fake GPUs; no Slurm, no torch.

`ray.cluster_utils.Cluster` starts two raylets on this machine with 2 CPUs and 2 fake GPUs each:
Ray hands out GPU ids and sets per-actor CUDA_VISIBLE_DEVICES exactly as on a GPU node. Both
raylets share one IP, so rank order falls back on the node id, as it does for two Slurm jobs on
one host. Every wait is a condition with a deadline inside the launcher (no sleeps here).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from ray_slurm_provider.gang import FaultSpec, GangFailed, GangSpec, run_gang  # noqa: E402
from tests.integration.moto_s3 import moto_s3  # noqa: E402

FNS = Path(__file__).with_name("gang_fns.py")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto on 127.0.0.1; started before the cluster so its raylets inherit the fake creds."""
    with moto_s3(tmp_path_factory.mktemp("moto")) as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def cluster(s3: str) -> Iterator[Cluster]:
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("RAY_ADDRESS")}
    os.environ["SLURM_JOB_ID"] = "4242"  # inherited by the raylets, as under sbatch
    os.environ["SLURM_LOCALID"] = "7"
    c = start_cluster()
    try:
        ray.init(address=c.address, runtime_env={"py_modules": [str(FNS)]},
                 log_to_driver=False)
        yield c
    finally:
        ray.shutdown()
        c.shutdown()
        os.environ.pop("SLURM_JOB_ID", None)
        os.environ.pop("SLURM_LOCALID", None)
        os.environ.update(saved)


def start_cluster(tries: int = 3) -> Cluster:
    """Two raylets. Ray gives a raylet a fixed 30 s to register, which a loaded machine can
    miss ("The current node timed out during startup"): then start again, as the node agent
    retries `ray start`."""
    for i in range(tries):
        c = Cluster()
        try:
            for _ in range(2):
                c.add_node(num_cpus=2, num_gpus=2, include_dashboard=False)
            c.wait_for_nodes()
            return c
        except Exception as e:
            c.shutdown()
            if "timed out during startup" not in str(e) or i + 1 == tries:
                raise
    raise AssertionError("unreachable")


def spec(**kw: Any) -> GangSpec:
    base: dict[str, Any] = dict(nodes=2, ranks_per_node=2, device="gpu", cpus_per_rank=1,
                                backend="gloo", max_attempts=1, pg_timeout_s=60,
                                start_timeout_s=60, stall_timeout_s=60, answer_timeout_s=60,
                                poll_interval_s=0.2)
    base.update(kw)
    return GangSpec(**base)


def results(res: Any) -> dict[int, dict[str, Any]]:
    return {int(r): v["result"] for r, v in res.last.results.items()}


def pg_states() -> set[str]:
    return {v["state"] for v in ray.util.placement_group_table().values()}


def test_layout_env_and_node_policy(cluster: Cluster, tmp_path: Path) -> None:
    res = run_gang(spec(profiles=("efa", "socket=^docker,lo")), "gang_fns:steps", {"steps": 3})
    assert res.ok and len(res.attempts) == 1
    out = results(res)
    assert sorted(out) == [0, 1, 2, 3]
    layout = {d["rank"]: d for d in res.last.layout}
    nodes = [layout[r]["node_id"] for r in range(4)]
    assert nodes[0] == nodes[1] != nodes[2] == nodes[3]  # 2 ranks on each of 2 nodes
    assert nodes[0] < nodes[2]  # same IP: node id breaks the tie
    for r, o in out.items():
        env = o["env"]
        assert env["RANK"] == str(r) and env["WORLD_SIZE"] == "4"
        assert env["LOCAL_RANK"] == str(r % 2) and env["NODE_RANK"] == str(r // 2)
        assert env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == str(r // 2)
        assert env["MASTER_ADDR"] == layout[0]["node_ip"]
        assert env["MASTER_PORT"] == res.last.master.rsplit(":", 1)[1]
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(sorted(
            (layout[x]["gpu_ids"][0] for x in range(4) if x // 2 == r // 2), key=int))
        assert env["RSP_DEVICE_INDEX"] == str(r % 2)
        assert env["FI_PROVIDER"] == "efa" and env["NCCL_SOCKET_IFNAME"] == "^docker,lo"
        assert o["slurm"] == []  # SLURM_* scrubbed from the rank
    gpus = [layout[r]["gpu_ids"][0] for r in range(4)]
    assert int(gpus[0]) < int(gpus[1]) and int(gpus[2]) < int(gpus[3])
    assert "CREATED" not in pg_states()


@pytest.mark.parametrize("policy", ["ray", "pop"])
def test_other_cvd_policies(cluster: Cluster, policy: str) -> None:
    res = run_gang(spec(cvd_policy=policy), "gang_fns:steps", {"steps": 1})
    layout = {d["rank"]: d for d in res.last.layout}
    for r, o in results(res).items():
        gpu = layout[r]["gpu_ids"][0]
        if policy == "ray":
            assert o["env"]["CUDA_VISIBLE_DEVICES"] == gpu
            assert o["env"]["RSP_DEVICE_INDEX"] == "0" and o["env"]["LOCAL_RANK"] == str(r % 2)
        else:
            assert o["env"]["CUDA_VISIBLE_DEVICES"] is None
            assert o["env"]["LOCAL_RANK"] == gpu == o["env"]["RSP_DEVICE_INDEX"]


@pytest.mark.parametrize("kind", ["crash", "stall"])
def test_one_rank_failing_restarts_the_gang_from_the_checkpoint(
        cluster: Cluster, tmp_path: Path, kind: str) -> None:
    # The stall timeout must outlast a healthy rank's heartbeat gap on a loaded 2-core box
    # (3 s was once exceeded by rank 0 while it waited at the collective).
    s = spec(max_attempts=2, checkpoint_dir=str(tmp_path), fault=FaultSpec(kind, 3, 4),
             stall_timeout_s=10.0)
    res = run_gang(s, "gang_fns:steps", {"steps": 8, "step_s": 0.2})
    first, second = res.attempts
    assert not first.ok and second.ok
    assert first.failed_rank == 3, first.failure
    if kind == "stall":
        assert "no heartbeat" in (first.failure or "")
    # The others wait at the step-4 "collective" for rank 3, so the checkpoint says 4.
    assert {o["start"] for o in results(res).values()} == {4}
    assert first.master != second.master  # a fresh port per attempt
    # Reports reach the driver through two channels (heartbeat polls and the final result),
    # so their order across them is not the step order.
    assert sorted(r["step"] for r in second.reports if r["rank"] == 0) == [4, 5, 6, 7]
    assert "CREATED" not in pg_states()


def test_fatal_error_is_not_retried(cluster: Cluster) -> None:
    with pytest.raises(GangFailed, match="restart cannot fix") as ei:
        run_gang(spec(max_attempts=3), "gang_fns:fatal", {})
    assert len(ei.value.result.attempts) == 1


def test_placement_timeout_reports_what_is_missing(cluster: Cluster) -> None:
    with pytest.raises(GangFailed) as ei:
        run_gang(spec(nodes=3, pg_timeout_s=2.0), "gang_fns:steps", {"steps": 1})
    msg = str(ei.value)
    assert "need 3 node(s) x {CPU: 2, GPU: 2}" in msg
    assert "alive nodes big enough for one bundle: 2 of 3 needed" in msg
    assert "CREATED" not in pg_states() and "PENDING" not in pg_states()


def test_checkpoints_staged_through_s3(cluster: Cluster, s3: str, tmp_path: Path) -> None:
    import boto3

    boto3.client("s3", endpoint_url=s3).create_bucket(Bucket="gang")
    uri = "s3://gang/run"
    run_gang(spec(checkpoint_dir=str(tmp_path / "a"), s3_uri=uri, s3_endpoint=s3),
             "gang_fns:steps", {"steps": 3, "saved": True})
    # A fresh local directory (another cluster, node-local disks): it all comes back from S3.
    res = run_gang(spec(checkpoint_dir=str(tmp_path / "b"), s3_uri=uri, s3_endpoint=s3),
                   "gang_fns:steps", {"steps": 5, "saved": True})
    assert {o["start"] for o in results(res).values()} == {3}
    assert (tmp_path / "b" / "state.json").read_text() == '{"next": 5}'
