"""The sandbox's rendered files, its shape checks, the pid registry and `down` by pid
(dummy processes stand in for daemons; no Slurm needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ray_slurm_provider import proc
from ray_slurm_provider.cli.main import main
from ray_slurm_provider.sandbox import Sandbox, SandboxError, prereq
from ray_slurm_provider.sandbox.config import (
    SandboxSpec,
    render_env_sh,
    render_epilog,
    render_gres_conf,
    render_slurm_conf,
)
from ray_slurm_provider.sandbox.layout import Layout
from ray_slurm_provider.sandbox.procs import (
    OWNER_ENV,
    Entry,
    Registry,
    exists,
    is_ours,
    owned_processes,
)

ROOT = "/tmp/rsp-unit"


def conf(**kw: object) -> dict[str, list[str]]:
    """slurm.conf as key -> values (NodeName/PartitionName lines keep their whole text)."""
    text = render_slurm_conf(Layout(ROOT), SandboxSpec(**kw))  # type: ignore[arg-type]
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out.setdefault(key, []).append(value)
    return out


def test_default_nodes_have_own_address_and_port() -> None:
    nodes = conf()["NodeName"]
    assert nodes == [
        f"n{k} NodeHostname=localhost NodeAddr=127.0.0.{k + 1} Port={6830 + k} CPUs=2 "
        "RealMemory=4000 Gres=gpu:2 State=UNKNOWN"
        for k in (1, 2, 3)
    ]


def test_partitions_and_scheduling() -> None:
    c = conf()
    assert c["PartitionName"] == [
        "cpu Nodes=n[1-3] Default=YES MaxTime=INFINITE State=UP",
        "gpu Nodes=n[1-3] MaxTime=INFINITE State=UP",
    ]
    assert c["SelectTypeParameters"] == ["CR_CPU_Memory"]
    assert c["DefMemPerCPU"] == ["2000"]
    assert c["SlurmdParameters"] == ["config_overrides"]
    assert c["ProctrackType"] == ["proctrack/linuxproc"]
    assert c["TaskPlugin"] == ["task/none"]
    assert c["KillWait"] == ["10"] and c["MinJobAge"] == ["600"]
    assert c["ReturnToService"] == ["2"] and c["ClusterName"] == ["sandbox"]


def test_everything_lives_in_the_state_dir() -> None:
    c = conf()
    assert c["AuthInfo"] == [f"socket={ROOT}/munge/munge.socket"]
    assert c["AuthAltTypes"] == ["auth/jwt"]
    assert c["AuthAltParameters"] == [f"jwt_key={ROOT}/ctld/jwt_hs256.key"]
    for key in (
        "StateSaveLocation",
        "SlurmdSpoolDir",
        "SlurmctldPidFile",
        "SlurmdPidFile",
        "SlurmctldLogFile",
        "SlurmdLogFile",
    ):
        assert c[key][0].startswith(ROOT + "/"), key


def test_ports_stay_out_of_rays_ranges() -> None:
    c = conf(nodes=64, port_offset=500)
    ports = [int(c["SlurmctldPort"][0])]
    ports += [int(n.split("Port=")[1].split()[0]) for n in c["NodeName"]]
    assert ports[0] == 7317 and ports[1] == 7331 and len(set(ports)) == 65
    assert all(p < 10002 for p in ports)
    lo, hi = (int(x) for x in c["SrunPortRange"][0].split("-"))
    assert lo > 33000 and hi < 65536
    assert SandboxSpec(port_offset=500).rest_url == "http://127.0.0.1:7320"


def test_no_gpus_means_no_gres_and_no_gpu_partition() -> None:
    c = conf(gpus_per_node=0)
    assert all("Gres=" not in n for n in c["NodeName"])
    assert [p.split()[0] for p in c["PartitionName"]] == ["cpu"]
    assert render_gres_conf(Layout(ROOT), SandboxSpec(gpus_per_node=0)).count("NodeName") == 0


def test_epilog_only_with_docker() -> None:
    assert "Epilog" not in conf()
    assert conf(docker=True)["Epilog"] == [f"{ROOT}/etc/epilog.sh"]
    script = render_epilog(Layout(ROOT))
    assert script.startswith("#!/bin/sh\n")
    assert f"DOCKER_HOST=unix://{ROOT}/docker/docker.sock" in script
    assert "label=slurm.job_id=$SLURM_JOB_ID" in script
    assert script.rstrip().endswith("exit 0")  # a failing Epilog would drain the node


def test_gres_conf_points_at_fake_devices() -> None:
    lines = render_gres_conf(Layout(ROOT), SandboxSpec(nodes=2)).splitlines()
    assert "AutoDetect=off" in lines
    assert f"NodeName=n1 Name=gpu File={ROOT}/fakegpu/n1/nvidia[0-1]" in lines
    assert f"NodeName=n2 Name=gpu File={ROOT}/fakegpu/n2/nvidia[0-1]" in lines
    one = render_gres_conf(Layout(ROOT), SandboxSpec(nodes=1, gpus_per_node=1))
    assert f"NodeName=n1 Name=gpu File={ROOT}/fakegpu/n1/nvidia0" in one.splitlines()


def test_single_node_hostlist_and_big_nodes() -> None:
    c = conf(nodes=1, cpus_per_node=64, memory_mb_per_node=512000)
    assert c["PartitionName"][0].startswith("cpu Nodes=n1 ")
    assert "CPUs=64 RealMemory=512000" in c["NodeName"][0]
    assert c["DefMemPerCPU"] == ["8000"]


@pytest.mark.parametrize(
    "kw",
    [
        {"nodes": 0},
        {"nodes": 251},
        {"cpus_per_node": 0},
        {"gpus_per_node": -1},
        {"memory_mb_per_node": 0},
        {"port_offset": -1},
        {"port_offset": 5000},
    ],
)
def test_bad_shapes_are_rejected(kw: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        SandboxSpec(**kw)  # type: ignore[arg-type]


def test_spec_round_trips_through_json() -> None:
    spec = SandboxSpec(nodes=5, gpus_per_node=0, docker=True, port_offset=100)
    assert SandboxSpec.from_json(spec.to_json()) == spec
    old = json.loads(spec.to_json())
    del old["port_offset"]
    assert SandboxSpec.from_json(json.dumps(old)).port_offset == 0


def test_layout_rejects_relative_and_too_long_dirs() -> None:
    with pytest.raises(ValueError):
        Layout("relative/dir")
    with pytest.raises(ValueError):
        Layout("/tmp/" + "x" * 100)


def test_env_sh_quotes_values() -> None:
    text = render_env_sh({"B": "it's", "A": "/p q"})
    assert text.splitlines()[1:] == ["export A='/p q'", "export B='it'\\''s'"]


def test_env_never_exports_slurm_jwt() -> None:
    env = Sandbox(ROOT, docker=True, port_offset=10).env()
    assert "SLURM_JWT" not in env
    assert env == {
        "SLURM_CONF": f"{ROOT}/etc/slurm.conf",
        "RAY_SLURM_REST_URL": "http://127.0.0.1:6830",
        "RAY_SLURM_JWT_FILE": f"{ROOT}/jwt.token",
        "RAY_SLURM_SANDBOX_DIR": ROOT,
        "DOCKER_HOST": f"unix://{ROOT}/docker/docker.sock",
    }


def test_state_dir_defaults_to_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_SLURM_SANDBOX_DIR", "/tmp/somewhere")
    assert Sandbox().state_dir == "/tmp/somewhere"
    monkeypatch.delenv("RAY_SLURM_SANDBOX_DIR")
    assert Sandbox().state_dir == "/tmp/rsp-sandbox"


def test_missing_packages_name_the_apt_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prereq, "_present", lambda probe: False)
    with pytest.raises(SandboxError) as ei:
        prereq.ensure_packages(prereq.Needs(docker=True), install=False)
    # Issue 14.21: the container suites run over podman too, so --docker brings podman.
    assert ("apt-get install -y slurm-wlm slurmrestd slurm-wlm-jwt-plugin munge docker.io "
            "podman catatonit") in str(ei.value)


def test_the_readme_test_command_sets_up_what_its_tests_need() -> None:
    """Issue 14.21: README command 2 on a fresh machine failed every podman test, because only
    .ci/run installed podman: scripts/test.sh now has the sandbox install what is missing."""
    root = Path(__file__).resolve().parents[2]
    script = (root / "scripts" / "test.sh").read_text()
    assert "ray-slurm sandbox up --install" in script
    assert "python3 -m venv .venv" in (root / "README.md").read_text()


# -- processes by pid ---------------------------------------------------------------------

SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


def _spawn(tmp: str, marker: str | None = None, extra: str = "") -> Entry:
    argv = [*SLEEPER, extra] if extra else SLEEPER
    env = dict(os.environ)
    if marker is not None:
        env[OWNER_ENV] = marker
    pid = proc.spawn(argv, env=env, log_path=os.path.join(tmp, "spawn.log"))
    _wait_for_argv(pid, argv)
    return Entry(pid, tuple(argv))


def _wait_for_argv(pid: int, argv: list[str]) -> None:
    """Wait until the kernel shows the new program's argv. Popen returns once exec closed the
    error pipe (close-on-exec), which happens before the new argv pages are set up: under load
    /proc/<pid>/cmdline can still be empty then."""
    want = ("\0".join(argv) + "\0").encode()
    for _ in range(1000):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read() == want:
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never showed argv {argv}")


def test_registry_trusts_a_pid_only_with_its_argv(tmp_path: Path) -> None:
    tmp = str(tmp_path)
    e = _spawn(tmp)
    try:
        assert is_ours(e)
        assert not is_ours(Entry(e.pid, ("/usr/sbin/slurmd", "-D")))  # a reused pid
        reg = Registry(os.path.join(tmp, "pids.json"))
        reg.record("x", e)
        assert reg.load() == {"x": e}
        reg.forget("x")
        assert reg.load() == {}
    finally:
        os.kill(e.pid, 9)


def test_down_stops_recorded_and_descendant_processes(tmp_path: Path) -> None:
    state = os.path.join(str(tmp_path), "sb")
    os.makedirs(state)
    with open(os.path.join(state, "sandbox.json"), "w") as f:
        f.write(SandboxSpec(nodes=2).to_json())
    recorded = [_spawn(state, marker=state, extra=str(i)) for i in range(3)]
    stray = _spawn(str(tmp_path), marker=state, extra="stray")  # e.g. an orphaned slurmstepd
    bystander = _spawn(str(tmp_path), marker="/tmp/another-sandbox", extra="other")
    reg = Registry(os.path.join(state, "pids.json"))
    for name, e in zip(["munged", "slurmd:n1", "slurmd:n2"], recorded, strict=True):
        reg.record(name, e)
    try:
        sb = Sandbox(state, nodes=2)
        assert sb.status().daemons == {
            "munged": recorded[0].pid,
            "slurmctld": None,
            "slurmd:n1": recorded[1].pid,
            "slurmd:n2": recorded[2].pid,
            "slurmrestd": None,
        }
        sb.down()
        assert not any(exists(e.pid) for e in [*recorded, stray])
        assert exists(bystander.pid)
        assert not os.path.exists(state)
        sb.down()  # again: nothing to do
    finally:
        for e in [*recorded, stray, bystander]:
            if exists(e.pid):
                os.kill(e.pid, 9)


def test_down_refuses_a_dir_that_is_not_a_sandbox(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(SandboxError, match="not a sandbox state dir"):
        Sandbox(str(tmp_path)).down()
    assert (tmp_path / "precious.txt").read_text() == "keep me"


def test_cli_status_without_a_sandbox(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sandbox", "status", "--state-dir", str(tmp_path)]) == 1
    assert "no sandbox at" in capsys.readouterr().out
    assert main(["sandbox", "down", "--state-dir", os.path.join(str(tmp_path), "none")]) == 0


FORKS_ON_TERM = [sys.executable, "-c",
                 "import os, signal, subprocess, sys, time\n"
                 "def bye(*_):\n"
                 "    subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],\n"
                 "                     start_new_session=True)\n"
                 "    time.sleep(0.3)\n"
                 "    sys.exit(0)\n"
                 "signal.signal(signal.SIGTERM, bye)\n"
                 "print('ready', flush=True)\n"
                 "time.sleep(120)\n"]


def test_down_returns_only_when_what_stopping_processes_forked_is_gone(tmp_path: Path) -> None:
    """Issue 14.20: `sandbox down` said "down" while processes were still exiting: a stray
    that forks while it stops (as a slurmstepd does) left a child behind the first sweep."""
    state = os.path.join(str(tmp_path), "sb")
    os.makedirs(state)
    with open(os.path.join(state, "sandbox.json"), "w") as f:
        f.write(SandboxSpec(nodes=1).to_json())
    env = {**os.environ, OWNER_ENV: state}
    stray = subprocess.Popen(FORKS_ON_TERM, env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert stray.stdout is not None and stray.stdout.readline() == "ready\n"  # handler set
        Sandbox(state, nodes=1).down()
        assert owned_processes(state) == []  # nothing of the sandbox runs once `down` returns
    finally:
        for pid in owned_processes(state):
            os.kill(pid, 9)
        stray.kill()
        stray.wait()
