"""`provider.ssh` against the sandbox's login node: Slurm commands through the CLI back end
run on the login node as the login user over one multiplexed connection, and each bad input
(unreachable host, refused key, unknown host key, missing commands) is one line naming it."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from ray_slurm_provider.cli.sshcheck import ssh_findings
from ray_slurm_provider.config import ProviderConfig, SshConfig
from ray_slurm_provider.sandbox import Sandbox, login
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
