"""From a laptop (provider.ssh): `ray up`, `ray exec`, a job through the tunnels of `ray-slurm
env`, `ray down`. The "laptop" is root in a private mount namespace where the login user's
home (and so the cluster directory) is hidden, every Slurm command on PATH is a stub that
fails loudly, and SLURM_CONF is unset; the login node is the sandbox's sshd (`up --login`).
The head is the login user's job; the stubs are never called; `ray down` leaves no job and
no process. One cluster for the module: the tests run in order."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml

from ray_slurm_provider.jobs import temp_dir
from ray_slurm_provider.sandbox import Sandbox, login
from ray_slurm_provider.slurm.ssh import SLURM_COMMANDS
from tests.e2e.harness import ROOT, wait_for
from tests.e2e.users import UserCluster, load_config, user_venv

pytestmark = pytest.mark.e2e

CONFIG = ROOT / "cluster-configs" / "sandbox-login.yaml"
STUBBED = (*SLURM_COMMANDS, "sacct", "sacctmgr", "salloc", "sstat", "munge")
#: Mount a tmpfs over the hidden home, then run the command ($0: the home).
HIDE = 'mount -t tmpfs -o size=1m rsp-hidden "$0" && exec "$@"'


class Laptop:
    """Root's commands in a namespace without the user's home or Slurm."""

    def __init__(self, sb: Sandbox, c: UserCluster) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="rsp-l-", dir="/tmp"))  # short: sockets
        self.hidden = c.user.home
        self.marker = self.dir / "stub-called"
        stubs = self.dir / "stubs"
        stubs.mkdir()
        for name in STUBBED:
            stub = stubs / name
            stub.write_text(f"#!/bin/sh\necho \"$0 $*\" >> {self.marker}\n"
                            f"echo 'stub {name}: the laptop has no Slurm' >&2\nexit 97\n")
            stub.chmod(0o755)
        self.env = {k: v for k, v in os.environ.items()
                    if not k.startswith(("SLURM_", "RAY_SLURM_SANDBOX", "RAY_ADDRESS"))}
        self.env["HOME"] = str(self.dir)
        self.env["PATH"] = f"{stubs}:{Path(sys.executable).parent}:/usr/bin:/bin"
        self.env["PYTHONPATH"] = str(ROOT)
        user = c.user.name
        config = yaml.safe_load(c.path.read_text())  # the login node's YAML, plus ssh
        provider = config["provider"]
        provider["python"] = str(c.venv / "bin" / "python")
        provider["ssh"] = {"host": login.LOGIN_HOST, "port": login.ssh_port(sb.spec.port_offset),
                           "user": user, "identity_file": login.user_key(sb.layout, user),
                           "known_hosts": login.known_hosts(sb.layout)}
        self.cluster = c
        self.config = self.dir / "cluster.yaml"
        self.config.write_text(yaml.safe_dump(config))

    def run(self, *argv: str, env: dict[str, str] | None = None,
            timeout: float = 300) -> tuple[int, str, str]:
        cp = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                             HIDE, self.hidden, *argv], capture_output=True, text=True,
                            env=env or self.env, timeout=timeout, stdin=subprocess.DEVNULL,
                            check=False)
        return cp.returncode, cp.stdout, cp.stderr

    def ray(self, *args: str, timeout: float = 300) -> tuple[int, str, str]:
        return self.run(str(Path(sys.executable).parent / "ray"), *args, timeout=timeout)

    def ray_slurm(self, *args: str) -> str:
        rc, out, err = self.run(sys.executable, "-m", "ray_slurm_provider.cli.main", *args)
        assert rc == 0, f"ray-slurm {' '.join(args)}: {err}"
        return out


@pytest.fixture(scope="module")
def laptop(login_sandbox: Sandbox) -> Iterator[Laptop]:
    """`ray up` from the laptop; `ray down` from it is the last test (and, should a test fail
    before it, here, then as the login user on the login node)."""
    user = login_sandbox.users()[0]
    venv = user_venv(login_sandbox)  # the login node's provider.python: this checkout
    config = load_config(CONFIG, idle_timeout_minutes=10)
    # The login node's copy (for the clean-up as its user) has no ssh; the laptop's has the
    # sandbox's (Laptop: this test's state dir and port offset).
    assert set(config["provider"].pop("ssh")) == {"host", "port", "user", "identity_file",
                                                  "known_hosts"}
    config["provider"].pop("python")
    c = UserCluster(user, venv, f"laptop-{uuid.uuid4().hex[:6]}", config, login_sandbox.env())
    lp = Laptop(login_sandbox, c)
    try:
        rc, out, err = lp.ray("up", "-y", "--no-config-cache", str(lp.config), timeout=600)
        assert rc == 0, (out + err)[-4000:]
        yield lp
    finally:
        lp.ray("down", "-y", str(lp.config), timeout=300)
        lp.run(sys.executable, "-m", "ray_slurm_provider.cli.main", "env", "--close",
               str(lp.config))
        c.down()
        c.cleanup()
        shutil.rmtree(lp.dir, ignore_errors=True)


def exports(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if line.startswith("export "):
            key, _, value = line.removeprefix("export ").partition("=")
            out[key] = shlex.split(value)[0]
    return out


def test_ray_up_from_the_laptop_starts_the_login_users_head(laptop: Laptop) -> None:
    jobs = laptop.cluster.jobs()  # squeue --user=<login user>
    assert len(jobs) == 1 and jobs[0][1] == "RUNNING", jobs
    head = laptop.cluster.head()  # head.json, in the login user's cluster directory
    assert head["job_id"] == jobs[0][0]
    assert not laptop.marker.exists(), laptop.marker.read_text()


def test_a_job_goes_through_the_tunnel_from_a_laptop(laptop: Laptop) -> None:
    cluster = laptop.cluster
    try:
        rc, out, _ = laptop.run("ls", "-A", laptop.hidden)  # the home is hidden there
        assert rc == 0
        assert out == ""
        rc, _, err = laptop.run("sbatch", "--wrap", "true")  # and Slurm is a failing stub
        assert rc == 97 and "stub sbatch" in err
        laptop.marker.unlink()

        env = exports(laptop.ray_slurm("env", str(laptop.config)))
        assert env["RAY_API_SERVER_ADDRESS"].startswith("http://127.0.0.1:")
        token = Path(env["RAY_AUTH_TOKEN_PATH"])
        assert token.parent == laptop.dir / ".ray_slurm" / cluster.name
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        assert token.read_text().strip() == cluster.token()
        ray = str(Path(sys.executable).parent / "ray")
        word = f"laptop-{uuid.uuid4().hex[:8]}"
        rc, out, err = laptop.run(
            ray, "job", "submit", "--", "python", "-c",
            f"import ray; ray.init(); print('{word}', ray.is_initialized())",
            env={**laptop.env, **env})
        assert rc == 0, err[-3000:]
        assert f"{word} True" in out
        assert "succeeded" in out
        assert cluster.token() not in out + err
        # Reopened after --close: the same ports, so the exports above stay valid.
        laptop.ray_slurm("env", "--close", str(laptop.config))
        assert not token.exists()
        again = exports(laptop.ray_slurm("env", str(laptop.config)))
        assert again["RAY_API_SERVER_ADDRESS"] == env["RAY_API_SERVER_ADDRESS"]
        assert again["RAY_ADDRESS"] == env["RAY_ADDRESS"]
        laptop.ray_slurm("env", "--close", str(laptop.config))
        assert not laptop.marker.exists(), laptop.marker.read_text()
    finally:
        laptop.run(sys.executable, "-m", "ray_slurm_provider.cli.main", "env", "--close",
                   str(laptop.config))


def test_ray_exec_from_the_laptop_runs_in_the_head_job(laptop: Laptop) -> None:
    rc, out, err = laptop.ray("exec", str(laptop.config), "echo JOB=$SLURM_JOB_ID; whoami")
    assert rc == 0, (out + err)[-3000:]
    assert f"JOB={laptop.cluster.head()['job_id']}" in out + err
    assert laptop.cluster.user.name in out + err
    rc, out, err = laptop.ray("get-head-ip", str(laptop.config))
    assert rc == 0 and laptop.cluster.head()["ip"] in out, (out + err)[-3000:]
    assert not laptop.marker.exists(), laptop.marker.read_text()


def test_status_and_logs_from_the_laptop(laptop: Laptop) -> None:
    """They run on the login node over the connection (cli/remote.py)."""
    head = str(laptop.cluster.head()["job_id"])
    rows = json.loads(laptop.ray_slurm("status", str(laptop.config), "--json"))["nodes"]
    assert [(r["job_id"], r["ray_up"]) for r in rows if r["kind"] == "head"] == [(head, True)]
    log = laptop.ray_slurm("logs", str(laptop.config), "head", "--lines", "50")
    assert "[ray-slurm " in log and head in log, log[-2000:]
    assert not laptop.marker.exists(), laptop.marker.read_text()


def test_ray_submit_from_the_laptop(laptop: Laptop) -> None:
    """The script goes to the login user's home in the archive of file mounts, then runs on
    the head."""
    script = laptop.dir / "hello_from_laptop.py"
    word = f"submitted-{uuid.uuid4().hex[:8]}"
    script.write_text(f"import ray\nray.init()\nprint('{word}', ray.is_initialized())\n")
    rc, out, err = laptop.ray("submit", str(laptop.config), str(script))
    assert rc == 0, (out + err)[-3000:]
    assert f"{word} True" in out + err
    assert not laptop.marker.exists(), laptop.marker.read_text()


def test_rsync_down_and_a_port_forward_from_the_laptop(laptop: Laptop) -> None:
    rc, out, err = laptop.ray("exec", str(laptop.config),
                              "mkdir -p ~/rsp-out/sub && echo hello > ~/rsp-out/sub/f.txt")
    assert rc == 0, (out + err)[-3000:]
    got = laptop.dir / "got"
    rc, out, err = laptop.ray("rsync-down", str(laptop.config), "~/rsp-out/", str(got))
    assert rc == 0, (out + err)[-3000:]
    assert (got / "sub" / "f.txt").read_text() == "hello\n"
    # `ray dashboard`: the head's dashboard on a local port until Ctrl-C.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray = str(Path(sys.executable).parent / "ray")
    # SIGINT as a terminal's Ctrl-C sends it: not ignored, whatever this test was started
    # under (a background job of a non-interactive shell ignores it, and so would `ray`).
    fwd = subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", HIDE,
                            laptop.hidden, ray, "dashboard", "--port", str(port),
                            str(laptop.config)], env=laptop.env, stdin=subprocess.DEVNULL,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    req = urllib.request.Request(f"http://127.0.0.1:{port}/api/version", headers={
        "Authorization": f"Bearer {laptop.cluster.token()}"})

    def answered() -> Any:
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                return json.loads(resp.read())
        except OSError:
            return None

    try:
        version = wait_for(answered, 90, "the dashboard through the forward", every=0.5)
        assert "ray_version" in version, version
    finally:
        fwd.send_signal(signal.SIGINT)  # Ctrl-C: `unshare` and `sh` exec'd into `ray`
        try:
            out, _ = fwd.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            fwd.kill()
            out, _ = fwd.communicate()
    assert f"Forwarding 127.0.0.1:{port} ->" in out and "Forwarding stopped." in out, \
        out[-3000:]
    wait_for(lambda: answered() is None, 30, "the forward to close")
    assert not laptop.marker.exists(), laptop.marker.read_text()


def processes_of(uid: int, job_ids: list[str]) -> list[str]:
    """Command lines of processes that belong to these jobs' Ray (their temp dirs, below the
    user's /tmp/rsp-<uid>/, are named after the job id)."""
    dirs = [temp_dir("/tmp", j, uid) + "/" for j in job_ids]
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if any(d in cmd for d in dirs):
            found.append(cmd)
    return found


def test_ray_down_from_the_laptop_leaves_nothing(laptop: Laptop) -> None:
    ids = [j for j, _ in laptop.cluster.jobs()]
    assert ids
    rc, out, err = laptop.ray("down", "-y", str(laptop.config))
    assert rc == 0, (out + err)[-3000:]
    assert laptop.cluster.jobs() == []
    uid = laptop.cluster.user.uid
    wait_for(lambda: processes_of(uid, ids) == [], 60, "the cluster's processes to exit")
    assert not laptop.marker.exists(), laptop.marker.read_text()


def test_report_from_the_laptop_after_down(laptop: Laptop) -> None:
    page = laptop.dir / "report.html"
    data = json.loads(laptop.ray_slurm("report", str(laptop.config), "--json", "--html",
                                       str(page)))
    heads = [j for j in data["jobs"] if j["kind"] == "head"]
    assert [j["end"] for j in heads] == ["ray down"], data["jobs"]
    assert page.read_text().startswith("<!DOCTYPE html>") or "<html" in page.read_text()
    assert not laptop.marker.exists(), laptop.marker.read_text()


#: The Python API from the laptop: up, a task through Ray Client over the tunnel, the login
#: node's status and log, then down when the `with` block ends.
API_CYCLE = """
import json, sys, ray
from ray_slurm_provider import SlurmCluster
with SlurmCluster(sys.argv[1]) as c:
    ray.init(c.address)
    where = ray.get(ray.remote(num_cpus=0)(lambda: ray.get_runtime_context().get_node_id())
                    .remote())
    ray.shutdown()
    heads = [r for r in c.status()["nodes"] if r["kind"] == "head"]
    print("API", json.dumps({"address": c.address, "task_node": where, "heads": heads,
                             "log": "[ray-slurm " in c.logs("head", lines=50)}))
"""


def test_the_python_api_from_the_laptop(laptop: Laptop) -> None:
    """After `ray down` from the laptop (the test before): the API's own cycle."""
    rc, out, err = laptop.run(sys.executable, "-c", API_CYCLE, str(laptop.config), timeout=600)
    assert rc == 0, (out + err)[-4000:]
    got = json.loads(next(x for x in out.splitlines() if x.startswith("API "))[4:])
    assert got["address"].startswith("ray://127.0.0.1:"), got
    assert got["task_node"] and got["log"], got
    assert [(h["ray_up"], h["state"]) for h in got["heads"]] == [(True, "RUNNING")], got
    assert laptop.cluster.jobs() == []  # the `with` block took it down
    assert not laptop.marker.exists(), laptop.marker.read_text()
