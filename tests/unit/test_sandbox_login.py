"""The sandbox's login node (`sandbox up --login`): its sshd_config, client config,
known_hosts, exports and shape checks. No daemon runs here; `sshd -t` checks the rendered
config where openssh-server is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ray_slurm_provider.sandbox import Sandbox, daemons, login, prereq, procs
from ray_slurm_provider.sandbox.config import SandboxSpec
from ray_slurm_provider.sandbox.layout import Layout

ROOT = "/tmp/rsp-unit"


def options(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.strip().partition(" ")
            out.setdefault(key, []).append(value)
    return out


def test_login_needs_users() -> None:
    with pytest.raises(ValueError, match="--users"):
        SandboxSpec(login=True)
    assert SandboxSpec(login=True, users=1).login


def test_spec_round_trips_login() -> None:
    spec = SandboxSpec(users=2, login=True, port_offset=600)
    assert SandboxSpec.from_json(spec.to_json()) == spec


def test_sshd_config_is_keys_only_and_forwards_nothing_but_local_tcp() -> None:
    layout = Layout(ROOT)
    text = login.render_sshd_config(layout, 600, ["rsp600-u1", "rsp600-u2"],
                                    {"SLURM_CONF": f"{ROOT}/etc/slurm.conf", "PATH": "/usr/bin"})
    o = options(text)
    assert o["ListenAddress"] == ["127.0.0.1:7422"]
    assert o["HostKey"] == [f"{ROOT}/ssh/ssh_host_ed25519_key"]
    assert o["AuthenticationMethods"] == ["publickey"]
    assert o["PasswordAuthentication"] == ["no"]
    assert o["KbdInteractiveAuthentication"] == ["no"]
    assert o["PermitRootLogin"] == ["no"]
    assert o["AllowUsers"] == ["rsp600-u1 rsp600-u2"]
    assert o["AllowAgentForwarding"] == ["no"]
    assert o["X11Forwarding"] == ["no"]
    assert o["AllowTcpForwarding"] == ["local"]
    assert o["AllowStreamLocalForwarding"] == ["no"]
    assert o["PermitUserEnvironment"] == ["no"]
    assert o["StrictModes"] == ["yes"]
    assert o["SetEnv"] == [f'"PATH=/usr/bin" "SLURM_CONF={ROOT}/etc/slurm.conf"']


def test_client_config_verifies_the_host_key_against_the_sandbox_only() -> None:
    o = options(login.render_client_config(Layout(ROOT), 600))
    assert o["Host"] == [login.HOST_ALIAS]
    assert o["HostName"] == ["127.0.0.1"]
    assert o["Port"] == ["7422"]
    assert o["IdentityFile"] == [f"{ROOT}/ssh/keys/%r/id_ed25519"]
    assert o["UserKnownHostsFile"] == [f"{ROOT}/ssh/known_hosts"]
    assert o["GlobalKnownHostsFile"] == ["/dev/null"]
    assert o["StrictHostKeyChecking"] == ["yes"]
    assert o["ForwardAgent"] == ["no"]
    assert o["ForwardX11"] == ["no"]


def test_known_hosts_names_the_port() -> None:
    line = login.render_known_hosts(0, "ssh-ed25519 AAAAkey comment\n")
    assert line == "[127.0.0.1]:6822 ssh-ed25519 AAAAkey\n"


def test_sshd_is_a_daemon_of_a_login_sandbox_only(monkeypatch: pytest.MonkeyPatch) -> None:
    layout = Layout(ROOT)
    assert "sshd" not in daemons.daemon_names(SandboxSpec(users=1))
    spec = SandboxSpec(users=1, login=True)
    assert daemons.daemon_names(spec)[-1] == "sshd"
    monkeypatch.setattr(login, "sshd_binary", lambda: "/usr/sbin/sshd")
    argv = daemons.argv_for("sshd", layout, spec)
    assert argv == ["/usr/sbin/sshd", "-D", "-e", "-f", f"{ROOT}/ssh/sshd_config"]
    # Never under a root's entry script: the login node is the host's sshd.
    root_spec = SandboxSpec(users=1, login=True, slurm="24.11")
    assert daemons.spawn_argv("sshd", layout, root_spec, ["sshd"]) == ["sshd"]


def test_exports_and_session_env() -> None:
    sb = Sandbox(ROOT, users=1, login=True, port_offset=600)
    env = sb.env()
    assert env["RAY_SLURM_SANDBOX_SSH_CONFIG"] == f"{ROOT}/ssh/config"
    assert env["RAY_SLURM_SANDBOX_SSH_HOST"] == "127.0.0.1"
    assert env["RAY_SLURM_SANDBOX_SSH_PORT"] == "7422"
    assert env["RAY_SLURM_SANDBOX_SSH_KNOWN_HOSTS"] == f"{ROOT}/ssh/known_hosts"
    assert sb.login_env()["SLURM_CONF"] == f"{ROOT}/etc/slurm.conf"
    assert "RAY_SLURM_SANDBOX_SSH_CONFIG" not in Sandbox(ROOT, users=1).env()
    in_root = Sandbox(ROOT, users=1, login=True, slurm="24.11").login_env()
    assert in_root["PATH"].split(":")[0] == f"{ROOT}/bin"


def test_login_packages_are_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prereq, "_present", lambda probe: probe not in ("sshd",))
    assert prereq.missing_packages(prereq.Needs(login=True)) == ["openssh-server"]
    assert prereq.missing_packages(prereq.Needs()) == []


@pytest.mark.skipif(not os.path.exists("/usr/sbin/sshd") or os.geteuid() != 0,
                    reason="needs openssh-server and root (sshd -t reads the host key)")
def test_rendered_config_passes_sshd_test_mode(tmp_path: Path) -> None:
    layout = Layout(str(tmp_path))
    os.makedirs(login.ssh_dir(layout))
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f",
                    login.host_key(layout)], check=True, timeout=30)
    text = login.render_sshd_config(layout, 0, ["root"], {"SLURM_CONF": "/x"})
    Path(login.sshd_config(layout)).write_text(text)
    os.makedirs(login.PRIVSEP_DIR, exist_ok=True)
    res = subprocess.run(["/usr/sbin/sshd", "-t", "-f", login.sshd_config(layout)],
                         capture_output=True, text=True, timeout=30, check=False)
    assert res.returncode == 0, res.stderr


def test_the_retitled_sshd_listener_is_still_ours() -> None:
    argv = ("/usr/sbin/sshd", "-D", "-e", "-f", "/s/ssh/sshd_config")
    title = ("sshd: /usr/sbin/sshd -D -e -f /s/ssh/sshd_config [listener] 0 of 10-100 "
             "startups",)
    assert procs.same_command(title, argv)
    assert procs.same_command(argv, argv)
    other = ("sshd: /usr/sbin/sshd -D -e -f /t/ssh/sshd_config [listener] 0 of 10-100 "
             "startups",)
    assert not procs.same_command(other, argv)
    assert not procs.same_command(None, argv)
