"""validate/render/status/logs/doctor logic with FakeSlurm (no Slurm, no sleeping)."""

from __future__ import annotations

import argparse
import io
import re
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from ray_slurm_provider.cli import doctor, logs, status, validate
from ray_slurm_provider.cli import findings as checks
from ray_slurm_provider.cli.common import Cluster, load_cluster, report
from ray_slurm_provider.cluster import ClusterConfig, parse_cluster
from ray_slurm_provider.jobs import encode_tags, job_name
from ray_slurm_provider.ports import port_block
from ray_slurm_provider.slurm.client import Node
from ray_slurm_provider.slurm.script import JobSpec
from ray_slurm_provider.state import ClusterDir, HeadInfo, RayUp
from ray_slurm_provider.units import fmt_duration as duration
from tests.fakes import FakeSlurm

SANDBOX_YAML = Path(__file__).resolve().parents[2] / "cluster-configs" / "sandbox.yaml"


def cluster(tmp_path: Path, fake: FakeSlurm, **provider: Any) -> Cluster:
    config = yaml.safe_load(SANDBOX_YAML.read_text())
    config["provider"].update({"state_dir": str(tmp_path / "state"), **provider})
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    c = load_cluster(str(path))
    c.client_factory = lambda pcfg: fake
    c.sleep = lambda s: None  # a command asks a throttled Slurm again: never really wait
    return c


def levels(findings: list[Any]) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for f in findings:
        out.setdefault(f.level, set()).add(f.what)
    return out


def test_validate_passes_on_the_sandbox_shape(tmp_path: Path) -> None:
    findings = validate.validate_findings(cluster(tmp_path, FakeSlurm()))
    assert "fail" not in levels(findings), findings
    out = io.StringIO()
    assert report(findings, out) == 0 and "0 failed" in out.getvalue()


def cluster_of(node_types: dict[str, Any]) -> ClusterConfig:
    return parse_cluster({"cluster_name": "c", "available_node_types": node_types})


@pytest.mark.parametrize(("node_config", "resources", "match"), [
    ({"partition": "nope"}, {"CPU": 1}, "'nope' is not a partition"),
    ({"partition": "cpu", "time": "3:00:00"}, {"CPU": 1}, "longer than partition 'cpu' allows"),
    ({"partition": "gpu", "gpus": 3}, {"CPU": 1}, "more than the 2 GPUs of any node"),
    ({"partition": "gpu", "gpus": 1, "gpu_type": "a100"}, {"CPU": 1}, "not a GPU type"),
    ({"partition": "cpu"}, {"CPU": 8}, "more than the 2 CPUs per node"),
    ({"partition": "cpu", "mem": "64G"}, {"CPU": 1}, "more than the 4000M per node"),
])
def test_node_type_checks_fail(node_config: dict[str, Any], resources: dict[str, int],
                               match: str) -> None:
    fake = FakeSlurm(partitions={"cpu": {"default": True, "max_time_s": 7200}, "gpu": {}})
    config = cluster_of({"w": {"resources": resources, "node_config": node_config}})
    found = checks.node_type_findings(config, "w", fake.cluster_info())
    fails = [f.message for f in found if f.level == "fail"]
    assert fails and match in fails[0], found


def test_no_default_partition_and_unlimited_time() -> None:
    nodes = [Node("a", "1.1.1.1", cpus=4, memory_mb=8000, gres="gpu:2")]
    fake = FakeSlurm(nodes=nodes, partitions={"p": {}, "q": {}})
    found = checks.node_type_findings(cluster_of({"w": {"resources": {"CPU": 2}}}), "w",
                                      fake.cluster_info())
    assert [f.level for f in found] == ["fail"] and "no default partition" in found[0].message
    found = checks.node_type_findings(
        cluster_of({"w": {"resources": {"CPU": 2}, "node_config": {"partition": "p"}}}), "w",
        fake.cluster_info())
    assert any(f.level == "warn" and "no time limit" in f.message for f in found)


def test_validate_reports_slurm_unreachable(tmp_path: Path) -> None:
    fake = FakeSlurm()
    fake.set_outage(True)
    findings = validate.validate_findings(cluster(tmp_path, fake))
    assert any(f.level == "fail" and "Unable to contact" in f.message for f in findings)
    assert "fail" not in levels(validate.validate_findings(cluster(tmp_path, fake), live=False))


def test_render_builds_every_node_types_script_and_submits_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeSlurm()
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info",
                        lambda *_: fake.cluster_info())
    scripts = validate.rendered_scripts(cluster(tmp_path, fake))
    assert [(t, k) for t, k, _ in scripts] == [
        ("head", "head"), ("cpu_worker", "worker"), ("gpu_worker", "worker")]
    head, _, gpu = (s for _, _, s in scripts)
    assert "#SBATCH --job-name=ray-sandbox" in head and "#SBATCH --mem=1500M" in head
    assert "#SBATCH --gres=gpu:1" in gpu and "-m ray_slurm_provider.agent " in gpu
    assert fake.calls["submit"] == 0 and not (tmp_path / "state").exists()


def in_order(text: str, *parts: str) -> bool:
    """Each of `parts` occurs in `text`, after the one before it."""
    at = 0
    for part in parts:
        at = text.find(part, at)
        if at < 0:
            return False
        at += len(part)
    return True


def test_render_shows_the_commands_each_job_runs_in_the_order_they_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26.17: the docs say render shows exactly what runs; the commands the head's job
    runs (handed in by `ray up`) and a worker's start commands (run by its node agent) were
    not in the batch scripts render printed, and a worker's script lacked `setup_commands`
    (Ray puts them in front of worker_setup_commands before the provider sees the config)."""
    fake = FakeSlurm()
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info",
                        lambda *_: fake.cluster_info())
    config = yaml.safe_load(SANDBOX_YAML.read_text())
    config["provider"]["state_dir"] = str(tmp_path / "state")
    config.update(initialization_commands=["echo init-1"], setup_commands=["echo setup-1"],
                  head_setup_commands=["echo head-setup-1"],
                  worker_setup_commands=["echo worker-setup-1"],
                  worker_start_ray_commands=["echo before-start-1",
                                             "ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT"])
    config["available_node_types"]["cpu_worker"]["node_config"]["prologue"] = ["echo pro-1"]
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    assert validate.cmd_render(argparse.Namespace(config=str(path), node_type=None)) == 0
    out = capsys.readouterr().out
    head, cpu, gpu = re.split(r"(?m)^# ===== (?=\w+ node type)", out)[1:]
    assert in_order(head, "run inside the job", "initialization_commands", "by `ray up`",
                    "echo init-1", "setup_commands + head_setup_commands", "echo setup-1",
                    "echo head-setup-1", "head_start_ray_commands", "by the node agent",
                    "ray start --head --autoscaling-config=~/ray_bootstrap_config.yaml")
    assert "worker-setup-1" not in head and "before-start-1" not in head
    # A worker: its script's own lines, then its agent's start commands.
    assert in_order(cpu, "echo pro-1\necho init-1\necho setup-1\necho worker-setup-1\n",
                    "run inside the job", "prologue", "in the batch script",
                    "initialization_commands", "setup_commands + worker_setup_commands",
                    "worker_start_ray_commands", "by the node agent", "echo before-start-1",
                    "ray start --address=$RAY_HEAD_IP:$RAY_GCS_PORT")
    assert "head-setup-1" not in cpu and "echo setup-1" in gpu


def gang_cluster(tmp_path: Path) -> Cluster:
    """The sandbox's cluster with `cpu_worker` a gang of 2 and no `upscaling_speed`."""
    config = yaml.safe_load(SANDBOX_YAML.read_text())
    config["provider"]["state_dir"] = str(tmp_path / "state")
    del config["upscaling_speed"]
    config["available_node_types"]["cpu_worker"]["node_config"]["nodes"] = 2
    config["available_node_types"]["cpu_worker"]["max_workers"] = 2
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return load_cluster(str(path))


SPEED_NOTE = ("upscaling_speed: not set in the YAML, so `ray up` sets it to 2, the largest "
              "gang `nodes` (available_node_types.cpu_worker.node_config.nodes)")


def test_validate_and_render_say_they_set_upscaling_speed_for_a_gang(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 26.5: the speed `ray up` sets is named, and that it speeds up other types too."""
    fake = FakeSlurm()
    monkeypatch.setattr("ray_slurm_provider.provider.bootstrap._cluster_info",
                        lambda *_: fake.cluster_info())
    c = gang_cluster(tmp_path)
    c.client_factory = lambda pcfg: fake
    found = validate.validate_findings(c)
    assert "fail" not in levels(found), found
    (note,) = [f for f in found if f.what == "upscaling_speed"]
    assert note.level == "info" and f"upscaling_speed: {note.message}".startswith(SPEED_NOTE)
    assert "other node types scale up faster too" in note.message
    assert validate.cmd_render(argparse.Namespace(config=c.path, node_type=None)) == 0
    out = capsys.readouterr().out
    assert f"# {SPEED_NOTE}" in out and "other node types scale up faster too" in out


def test_status_rows_from_one_listing(tmp_path: Path) -> None:
    fake = FakeSlurm()
    c = cluster(tmp_path, fake)
    head = fake.submit(JobSpec("ray-sandbox", ["true"], time="30"),
                       comment=encode_tags({"ray-node-type": "head",
                                            "ray-user-node-type": "head"}))
    worker = fake.submit(JobSpec("ray-sandbox", ["true"]),
                         comment=encode_tags({"ray-node-type": "worker",
                                              "ray-user-node-type": "cpu_worker"}))
    fake.submit(JobSpec("ray-sandbox", ["true"]), comment="not ours")
    fake.start(head, "n2")
    fake.set_state(worker, "PENDING", "Resources")
    fake.clock.advance(60)
    c.cdir.create()
    c.cdir.node(head).write_ray_up(RayUp(ip="127.0.0.3", job_id=head))
    c.cdir.write_head(HeadInfo(job_id=head, ip="127.0.0.3", gcs_port=1, dashboard_port=8265))
    data = status.status_data(c)
    assert fake.calls["list_jobs"] == 1 and data["other_jobs"] == 1
    rows = {r["job_id"]: r for r in data["nodes"]}
    assert rows[head]["ray_up"] and rows[head]["address"] == "127.0.0.3"
    assert rows[head]["time_left_s"] == 1740 and rows[head]["kind"] == "head"
    assert rows[worker]["reason"] == "Resources" and rows[worker]["node_type"] == "cpu_worker"
    assert rows[worker]["resources"] == "CPU=1,memory=700000000"
    text = "\n".join(status.status_lines(data))
    assert "29:00" in text and "Resources (start unknown)" in text
    assert "dashboard: http://127.0.0.3:8265" in text and "1 other jobs" in text
    assert "the cluster is down" in status.status_lines(
        {"cluster": "x", "job_name": "ray-x", "nodes": [], "other_jobs": 0, "head": None})[0]


def test_status_shows_a_gang_as_one_job_with_its_nodes_beneath(tmp_path: Path) -> None:
    """Issue 16.5: one row for the group's job, one per member (released ones marked)."""
    from ray_slurm_provider.jobs import GROUP_TAG

    fake = FakeSlurm()
    c = cluster(tmp_path, fake)
    gang = fake.submit(JobSpec("ray-sandbox", ["true"], nodes=2, ntasks=2),
                       comment=encode_tags({"ray-node-type": "worker", GROUP_TAG: "2",
                                            "ray-user-node-type": "cpu_worker"}))
    fake.start(gang, "n[2-3]")
    c.cdir.create()
    c.cdir.node(f"{gang}.0").write_ray_up(RayUp(ip="127.0.0.3", job_id=gang))
    c.cdir.node(f"{gang}.1").path.mkdir(parents=True)
    c.cdir.node(f"{gang}.1").release()
    data = status.status_data(c)
    (row,) = data["nodes"]
    assert row["job_id"] == gang and row["node"] == "n[2-3]"
    assert row["ray_up"]  # every member not released is up
    assert row["members"] == [
        {"node_id": f"{gang}.0", "node": "n2", "address": "127.0.0.3", "ray_up": True,
         "released": False},
        {"node_id": f"{gang}.1", "node": "n3", "address": "", "ray_up": False,
         "released": True}]
    lines = status.status_lines(data)
    job_line = next(i for i, ln in enumerate(lines) if f" {gang} (gang of 2) " in ln)
    first, second = lines[job_line + 1].split(), lines[job_line + 2].split()
    assert first == ["\u2514", f"{gang}.0", "n2", "127.0.0.3", "up"]
    assert second == ["\u2514", f"{gang}.1", "n3", "-", "released"]


def test_status_shows_the_address_each_nodes_ray_bound(tmp_path: Path) -> None:
    """Issue 26.7: with `node_ip_interface` a node's Ray binds that interface's address (its
    ray.json): status shows it; Slurm's NodeAddr only until the node's Ray is up. A gang's
    job row leaves the address to its members, each of which has its own."""
    from ray_slurm_provider.jobs import GROUP_TAG

    fake = FakeSlurm()
    c = cluster(tmp_path, fake, node_ip_interface="ib0")
    tags = {"ray-node-type": "worker", "ray-user-node-type": "cpu_worker"}
    up = fake.submit(JobSpec("ray-sandbox", ["true"]), comment=encode_tags(tags))
    starting = fake.submit(JobSpec("ray-sandbox", ["true"]), comment=encode_tags(tags))
    gang = fake.submit(JobSpec("ray-sandbox", ["true"], nodes=2, ntasks=2),
                       comment=encode_tags({**tags, GROUP_TAG: "2"}))
    fake.start(up, "n1")
    fake.start(starting, "n2")
    fake.start(gang, "n[2-3]")
    c.cdir.create()
    c.cdir.node(up).write_ray_up(RayUp(ip="10.1.2.3", job_id=up))
    c.cdir.node(f"{gang}.1").write_ray_up(RayUp(ip="10.1.2.5", job_id=gang))
    rows = {r["job_id"]: r for r in status.status_data(c)["nodes"]}
    assert (rows[up]["address"], rows[up]["ray_up"]) == ("10.1.2.3", True)  # NodeAddr .2
    assert (rows[starting]["address"], rows[starting]["ray_up"]) == ("127.0.0.3", False)
    assert rows[gang]["address"] == ""
    assert [m["address"] for m in rows[gang]["members"]] == ["", "10.1.2.5"]
    lines = status.status_lines(status.status_data(c))
    assert next(ln for ln in lines if f" {up} " in ln).split()[4:6] == ["n1", "10.1.2.3"]
    assert next(ln for ln in lines if f" {gang} (gang" in ln).split()[7:9] == ["n[2-3]", "-"]


def test_follow_prints_until_the_job_is_gone(tmp_path: Path) -> None:
    log = tmp_path / "1.out"
    out = io.StringIO()
    writes = iter(["a\n", "b\n", "", "c\n"])
    state = {"alive": 3}

    def sleep(_: float) -> None:
        chunk = next(writes, "")
        with log.open("a") as f:
            f.write(chunk)

    def alive() -> bool:
        state["alive"] -= 1
        return state["alive"] > 0

    logs.follow(log, alive, out, sleep=sleep, check_every=2)
    assert out.getvalue() == "a\nb\nc\n"


def test_resolve_job_and_list_logs(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeSlurm())
    assert logs.list_logs(c)[0].startswith("no logs yet")
    c.cdir.create()
    c.cdir.log("42").write_text("hello\n")
    assert "42" in logs.list_logs(c)[1]
    assert logs.resolve_job(c, "42") == "42" and logs.resolve_job(c, None) is None
    assert logs.resolve_job(c, "42_3") == "42_3"  # an array task
    assert logs.resolve_job(c, "42_3.1") == "42_3.1"  # a gang member (its own Ray logs)
    with pytest.raises(logs.CliError):
        logs.resolve_job(c, "42.x")
    with pytest.raises(Exception, match="no head recorded"):
        logs.resolve_job(c, "head")
    with pytest.raises(Exception, match="not a Slurm job id"):
        logs.resolve_job(c, "n1")


def test_the_head_log_outlives_the_head_and_runs_stay_apart(tmp_path: Path) -> None:
    """Issue 14.19: `ray-slurm logs CONFIG head` failed after `ray down` or a head crash,
    exactly when it is needed; sandbox job ids restart at 1, so one `1.out` mixed runs."""
    from ray_slurm_provider.provider.provider import SlurmNodeProvider
    from tests.unit.test_provider import HEAD_TAGS

    c = cluster(tmp_path, FakeSlurm())
    p = SlurmNodeProvider({"type": "external", "state_dir": str(tmp_path / "state"),
                           "python": "/py"}, c.name)
    p._client = FakeSlurm()
    (first,) = p.create_node({}, HEAD_TAGS, 1)
    c.cdir.log(first).write_text("run one\n")
    c.cdir.write_head(HeadInfo(job_id=first, ip="127.0.0.2", gcs_port=24000))
    c.cdir.clear_head()  # `ray down`, or the head's crash
    assert logs.resolve_job(c, "head") == first  # the last head's log, after it is gone
    p._client = FakeSlurm()  # a new sandbox: job ids start again
    (second,) = p.create_node({}, HEAD_TAGS, 1)
    assert second == first and not c.cdir.log(second).exists()  # a fresh log for the new run
    (old,) = c.cdir.logs.glob(f"runs/*/{first}.out")
    assert old.read_text() == "run one\n"
    assert any(str(old) in line for line in logs.list_logs(c))


def test_doctor_token_file_and_temp_dir(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeSlurm(), temp_dir_root="/" + "x" * 60)
    c.cdir.create()
    token = c.cdir.root / "auth_token"
    token.write_text("t")
    token.chmod(0o644)
    found = doctor.files_findings(c)
    bad = {f.what: f for f in found if f.level != "ok"}
    assert bad["Ray auth token"].level == "fail" and "chmod 600" in bad["Ray auth token"].fix
    assert bad["Ray temp dir"].level == "warn"
    token.chmod(0o600)
    assert "Ray auth token" not in {f.what for f in doctor.files_findings(c) if f.level != "ok"}


def test_doctor_ports_sees_a_listener(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        base = s.getsockname()[1]
        fake = FakeSlurm(nodes=[Node("n1", "127.0.0.1", cpus=2, memory_mb=4000)],
                         partitions={"cpu": {"default": True}, "gpu": {}})
        c = cluster(tmp_path, fake, ports={"base": base})
        (f,) = doctor.ports_findings(c, fake.cluster_info())
        assert f.level == "warn" and f"n1:{base} (GCS)" in f.message
    assert port_block("x", base).gcs == base


def test_duration() -> None:
    assert [duration(s) for s in (None, 59, 3600, 90061)] == [
        "UNLIMITED", "00:59", "01:00:00", "1-01:01:01"]


def test_cluster_dir_of_loaded_config(tmp_path: Path) -> None:
    c = cluster(tmp_path, FakeSlurm())
    assert c.cdir.root == ClusterDir(str(tmp_path / "state"), "sandbox").root
    assert c.job_name == "ray-sandbox" and c.parsed.head_type == "head"


def test_validate_runs_rays_own_checks_and_the_ranges_ray_lacks(tmp_path: Path) -> None:
    """Issue 14.17: `min_workers: lots`, `idle_timeout_minutes: soon` and `max_workers: -3`
    used to pass `ray-slurm validate`."""
    for key, value, match in [
        ("min_workers", "lots", "available_node_types.cpu_worker.min_workers: expected an "
                                "integer, got 'lots'"),
        ("max_workers", -3, "available_node_types.cpu_worker.max_workers: -3 is negative"),
        (None, "soon", "idle_timeout_minutes: expected a number, got 'soon'"),
        ("resources", {"CPU": "two"}, "available_node_types.cpu_worker.resources.CPU: "
                                      "expected a whole number >= 0, got 'two'"),
        ("", 5, "(top level): Additional properties are not allowed ('idle_timout_minutes' "
                "was unexpected)"),  # Ray's own schema
    ]:
        c = cluster(tmp_path, FakeSlurm())
        if key == "":
            c.config["idle_timout_minutes"] = value
        elif key is None:
            c.config["idle_timeout_minutes"] = value
        else:
            c.config["available_node_types"]["cpu_worker"][key] = value
        fails = [f"{f.what}: {f.message}" for f in validate.validate_findings(c)
                 if f.level == "fail"]
        assert len(fails) == 1 and match in fails[0], fails


def test_env_exports_what_each_ray_tool_reads(tmp_path: Path) -> None:
    """Issue 14.16: RAY_ADDRESS was the dashboard URL, which ray.init() and `ray status`
    cannot use; the jobs CLI reads RAY_API_SERVER_ADDRESS first."""
    from ray_slurm_provider.cli.env import env_lines

    c = cluster(tmp_path, FakeSlurm())
    c.cdir.write_head(HeadInfo(job_id="5", ip="10.0.0.7", gcs_port=24000, dashboard_port=24001,
                               client_port=24002))
    exports = dict(line.removeprefix("export ").split("=", 1) for line in env_lines(c.path)
                   if line.startswith("export "))
    assert exports["RAY_ADDRESS"] == "10.0.0.7:24000"
    assert exports["RAY_API_SERVER_ADDRESS"] == "http://10.0.0.7:24001"
    assert exports["RAY_AUTH_MODE"] == "token"


# --- issue 29: a throttled controller is asked again, a refusal is not ------------------------
THROTTLED = "squeue: error: slurm_load_jobs: Socket timed out on send/recv operation"


def test_status_asks_a_throttled_controller_again(tmp_path: Path) -> None:
    from ray_slurm_provider.slurm.client import TransientSlurmError

    fake = FakeSlurm()
    c = cluster(tmp_path, fake)
    waits: list[float] = []
    c.sleep = waits.append
    head = fake.submit(JobSpec("ray-sandbox", ["true"]),
                       comment=encode_tags({"ray-node-type": "head"}))
    for _ in range(2):
        fake.fail_next("list_jobs", TransientSlurmError(THROTTLED, THROTTLED, "squeue"))
    data = status.status_data(c)
    assert [r["job_id"] for r in data["nodes"]] == [head]  # not "the cluster is down"
    assert fake.calls["list_jobs"] == 3 and len(waits) == 2


def test_status_gives_up_on_a_refusal_and_after_three_tries(tmp_path: Path) -> None:
    from ray_slurm_provider.slurm.client import PermanentSlurmError, SlurmError

    fake = FakeSlurm()
    c = cluster(tmp_path, fake)
    waits: list[float] = []
    c.sleep = waits.append
    fake.fail_next("list_jobs", PermanentSlurmError("squeue: error: Invalid user"))
    with pytest.raises(PermanentSlurmError):
        status.status_data(c)
    assert fake.calls["list_jobs"] == 1 and waits == []
    fake.set_outage(True)
    with pytest.raises(SlurmError):
        status.status_data(c)
    assert fake.calls["list_jobs"] == 4 and len(waits) == 2


def test_status_sweep_of_one_shot_runs_asks_again(tmp_path: Path) -> None:
    """A run's listing that Slurm did not answer must not end the run (its dir removed)."""
    from ray_slurm_provider.cli import oneshots
    from ray_slurm_provider.slurm.client import TransientSlurmError

    fake = FakeSlurm()
    c = cluster(tmp_path, fake)
    seen: list[str] = []

    def fake_runs(cl: Cluster) -> list[Any]:
        seen.append("runs")
        return [oneshots.Run(run_id="r1", name=f"{c.name}-r1", config_name=c.name,
                             created=0.0, head="1000")]

    head = fake.submit(JobSpec(job_name(f"{c.name}-r1"), ["true"]))
    assert head == "1000"
    fake.fail_next("list_jobs", TransientSlurmError(THROTTLED, THROTTLED, "squeue"))
    import unittest.mock
    with unittest.mock.patch.object(oneshots, "runs_of", fake_runs), \
            unittest.mock.patch.object(oneshots, "save", lambda *a: seen.append("save")):
        live = oneshots.sweep(c)
    assert [j.job_id for _, j in live] == [head] and "save" not in seen


def test_validate_and_doctor_ask_a_throttled_controller_again(tmp_path: Path) -> None:
    from ray_slurm_provider.slurm.client import TransientSlurmError

    fake = FakeSlurm()
    c = cluster(tmp_path, fake)
    fake.fail_next("cluster_info", TransientSlurmError("sinfo: error: rate limit exceeded"))
    assert "fail" not in levels(validate.validate_findings(c))
    assert fake.calls["cluster_info"] == 2
    fake.fail_next("cluster_info", TransientSlurmError("scontrol: no answer within 30s"))
    _, info = doctor.slurm_findings(cluster(tmp_path, fake, slurm_api="pyslurm"))
    assert info is not None and fake.calls["cluster_info"] == 4
    fake.fail_next("list_jobs", TransientSlurmError(THROTTLED))
    (f,) = doctor.ports_findings(c, info)
    assert f.level != "fail" and fake.calls["list_jobs"] == 2


def test_validate_asks_accounting_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slurmdbd that did not answer once is no "account and qos not checked" warning."""
    from ray_slurm_provider.slurm.client import TransientSlurmError
    from ray_slurm_provider.slurm.sacct import Association

    asked: list[str] = []

    class Acct:
        def __init__(self, **kw: Any) -> None:
            pass

        def associations(self) -> list[Association]:
            asked.append("sacctmgr")
            if len(asked) == 1:
                raise TransientSlurmError("sacctmgr: error: Socket timed out")
            return [Association("lab", "", ("normal",), "normal")]

    monkeypatch.setattr(validate, "Accounting", Acct)
    fake = FakeSlurm()
    c = cluster(tmp_path, fake)
    c.config["available_node_types"]["head"]["node_config"]["account"] = "lab"
    found = validate.validate_findings(c)
    assert len(asked) == 2
    assert not [f for f in found if "not checked" in f.message], found


def test_logs_follow_keeps_following_while_slurm_does_not_answer(tmp_path: Path) -> None:
    from ray_slurm_provider.slurm.client import PermanentSlurmError

    fake = FakeSlurm()
    c = cluster(tmp_path, fake)
    job = fake.submit(JobSpec("ray-sandbox", ["true"]))
    fake.set_outage(True)
    assert logs.job_alive(c, job)  # not answered: the job is not gone, ask again later
    fake.set_outage(False)
    fake.fail_next("list_jobs", PermanentSlurmError("squeue: error: Invalid user"))
    with pytest.raises(PermanentSlurmError):
        logs.job_alive(c, job)
    assert logs.job_alive(c, job)
    fake.finish(job, "COMPLETED")
    assert not logs.job_alive(c, job)
