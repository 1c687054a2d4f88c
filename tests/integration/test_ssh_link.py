"""`provider.ssh` against the sandbox's login node: Slurm commands through the CLI back end
run on the login node as the login user over one multiplexed connection, and each bad input
(unreachable host, refused key, unknown host key, missing commands) is one line naming it."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import stat
import subprocess
import tempfile
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from ray_slurm_provider.cli.env import env_lines
from ray_slurm_provider.cli.sshcheck import ssh_findings
from ray_slurm_provider.config import ProviderConfig, SshConfig
from ray_slurm_provider.sandbox import Sandbox, login, roots
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.ssh import SshError, SshLink

pytestmark = pytest.mark.integration


def ssh_config(sb: Sandbox, **kw: object) -> SshConfig:
    user = sb.users()[0].name
    base: dict[str, object] = {
        "host": login.LOGIN_HOST, "port": login.ssh_port(sb.spec.port_offset), "user": user,
        "identity_file": login.user_key(sb.layout, user),
        "known_hosts": login.known_hosts(sb.layout), "control_persist_s": 60}
    base.update(kw)
    return SshConfig(**base)  # type: ignore[arg-type]


@pytest.fixture
def control() -> Iterator[str]:
    """A short private dir for the control socket (pytest's tmp_path is too long for one)."""
    d = tempfile.mkdtemp(prefix="rsp-ctl-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def link(login_sandbox: Sandbox, control: str) -> Iterator[SshLink]:
    lk = SshLink(ssh_config(login_sandbox), control=control)
    yield lk
    lk.close()


def test_slurm_runs_on_the_login_node_as_the_login_user(login_sandbox: Sandbox,
                                                        link: SshLink) -> None:
    user = login_sandbox.users()[0].name
    client = CliSlurmClient(remote=link)
    assert client.cluster_info().partition("cpu") is not None
    assert link.is_open()  # the first command opened the master; the others reuse it
    name = f"rsp-ssh-{uuid.uuid4().hex[:8]}"
    job = link.run(["sbatch", "--parsable", "-o", "/dev/null", "-J", name, "-t", "2",
                    "--wrap", "sleep 60"]).stdout.strip()
    try:
        jobs = client.list_jobs(name)
        assert [j.job_id for j in jobs] == [job]
        owner = link.run(["squeue", "-h", "-j", job, "-o", "%u"]).stdout.strip()
        assert owner == user
    finally:
        client.cancel([job])
    link.close()
    assert not link.is_open()


def test_quoted_words_arrive_whole(link: SshLink) -> None:
    words = ["a b", "$HOME", "'; touch /tmp/pwned-rsp; '", "`id`", "*", "x\ny"]
    out = link.run(["printf", "%s\\0", *words]).stdout
    assert out.split("\0")[:-1] == words
    assert not os.path.exists("/tmp/pwned-rsp")


def test_missing_commands_are_named(link: SshLink) -> None:
    assert link.missing_commands(("sinfo", "no-such-slurm-cmd")) == ["no-such-slurm-cmd"]


def test_bad_inputs_are_one_line(login_sandbox: Sandbox, control: str, tmp_path: Path) -> None:

    def fails(**kw: object) -> str:
        with pytest.raises(SshError) as ei:
            SshLink(ssh_config(login_sandbox, **kw), control=control).run(["true"])
        message = str(ei.value)
        assert "\n" not in message
        return message

    assert "cannot reach the login node 127.0.0.1:1: Connection refused" in fails(port=1)
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)],
                   check=True, timeout=30)
    assert "refused the login" in fails(identity_file=str(stranger))
    empty = tmp_path / "known_hosts"
    empty.write_text("")
    message = fails(known_hosts=str(empty))
    assert "unknown host key" in message
    public = Path(login.host_key(login_sandbox.layout) + ".pub").read_text()
    fingerprint = subprocess.run(["ssh-keygen", "-l", "-f", "-"], input=public, text=True,
                                 capture_output=True, check=True).stdout.split()[1]
    assert fingerprint in message  # what to compare before accepting
    assert "accept it with" in message


def test_doctor_checks_the_ssh_path(login_sandbox: Sandbox, link: SshLink) -> None:
    pcfg = ProviderConfig(ssh=ssh_config(login_sandbox), python="/usr/bin/python3")
    found = {f.what: f for f in ssh_findings(pcfg, link)}
    assert found["SSH login"].level == "ok"
    assert found["Slurm commands"].level == "ok"
    assert found["Slurm via ssh"].level == "ok", found["Slurm via ssh"].message
    # Debian's python3 on the login node has no ray-slurm-provider: named, with the fix.
    assert found["package version"].level == "fail"
    assert "/usr/bin/python3" in found["package version"].message


def _listening_on(port: int) -> list[str]:
    out = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True,
                         timeout=10, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if line.strip()]


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def test_env_opens_tunnels_that_keep_their_ports(login_sandbox: Sandbox,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in head in the login user's cluster dir: its "dashboard" is the sandbox's
    slurmrestd, its "client port" the sshd; the tunnels reach both from 127.0.0.1 only."""
    user = login_sandbox.users()[0]
    name = f"tun-{uuid.uuid4().hex[:6]}"
    cdir = Path(user.home) / ".ray_slurm" / name
    rest_port = login_sandbox.spec.rest_port
    head = {"job_id": "1", "ip": "127.0.0.1", "gcs_port": 1, "dashboard_port": rest_port,
            "client_port": login.ssh_port(login_sandbox.spec.port_offset)}
    for d in (cdir.parent, cdir):
        d.mkdir(mode=0o700, exist_ok=True)
        os.chown(d, user.uid, user.gid)
    (cdir / "head.json").write_text(json.dumps(head))
    (cdir / "auth_token").write_text("not-a-real-token\n")
    for f in ("head.json", "auth_token"):
        os.chmod(cdir / f, 0o600)
        os.chown(cdir / f, user.uid, user.gid)
    home = tempfile.mkdtemp(prefix="rsp-h-", dir="/tmp")  # the laptop's home: short paths
    monkeypatch.setenv("HOME", home)
    ssh = ssh_config(login_sandbox)
    config = Path(home) / "cluster.yaml"
    config.write_text(yaml.safe_dump({"cluster_name": name, "provider": {
        "type": "external", "module": "ray_slurm_provider.provider.SlurmNodeProvider",
        "python": "/usr/bin/python3", "ssh": {
            "host": ssh.host, "port": ssh.port, "user": ssh.user,
            "identity_file": ssh.identity_file, "known_hosts": ssh.known_hosts}}}))
    try:
        exports = _exports(env_lines(str(config)))
        api = exports["RAY_API_SERVER_ADDRESS"]
        port = int(api.rsplit(":", 1)[1])
        client = int(exports["RAY_ADDRESS"].rsplit(":", 1)[1])
        assert exports["RAY_ADDRESS"].startswith("ray://127.0.0.1:")
        assert _listening_on(port) == [f"127.0.0.1:{port}"]
        version = roots.rest_version(login_sandbox.spec.slurm)
        assert _http_status(f"{api}/slurm/{version}/ping") == 401  # slurmrestd, no token
        with socket.create_connection(("127.0.0.1", client), timeout=10) as s:
            assert s.recv(64).startswith(b"SSH-2.0")  # the "client port": the sshd
        token = Path(exports["RAY_AUTH_TOKEN_PATH"])
        assert token.read_text() == "not-a-real-token\n"
        assert stat.S_IMODE(token.stat().st_mode) == 0o600
        # Closed: the ports stay recorded and the token copy goes; reopened: same ports.
        env_lines(str(config), close=True)
        assert _listening_on(port) == []
        assert not token.exists()
        again = _exports(env_lines(str(config)))
        assert again["RAY_API_SERVER_ADDRESS"] == api
        assert again["RAY_ADDRESS"] == exports["RAY_ADDRESS"]
        assert _http_status(f"{api}/slurm/{version}/ping") == 401
    finally:
        with contextlib.suppress(Exception):
            env_lines(str(config), close=True)
        shutil.rmtree(cdir.parent, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)


def _exports(lines: list[str]) -> dict[str, str]:
    pairs = (line.removeprefix("export ").split("=", 1) for line in lines
             if line.startswith("export "))
    return {k: v for k, v in pairs}
