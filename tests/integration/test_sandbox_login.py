"""The sandbox's login node (`sandbox up --login`): a sandbox user logs in with its key through
the generated client config, the session has the sandbox's Slurm, the host key is checked,
and nothing but keys gets in. A sandbox started without --login gets its sshd added here
(`up` on a running sandbox starts only what the shape adds)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from ray_slurm_provider.sandbox import Sandbox, login
from ray_slurm_provider.sandbox.procs import exists

pytestmark = pytest.mark.integration


def ssh(sb: Sandbox, user: str, *command: str, options: tuple[str, ...] = (),
        timeout: float = 60) -> subprocess.CompletedProcess[str]:
    argv = ["ssh", "-F", login.client_config(sb.layout), *options, f"{user}@{login.HOST_ALIAS}",
            *command]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False,
                          stdin=subprocess.DEVNULL)


def test_a_user_logs_in_with_its_key_and_finds_slurm(login_sandbox: Sandbox) -> None:
    user = login_sandbox.users()[0]
    res = ssh(login_sandbox, user.name, "true")
    assert res.returncode == 0, res.stderr
    res = ssh(login_sandbox, user.name, "id -un; echo $SLURM_CONF; sinfo -h -o %P")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.split()
    assert lines[:2] == [user.name, login_sandbox.layout.slurm_conf]
    assert "cpu*" in lines


def test_the_host_key_is_verified(login_sandbox: Sandbox, tmp_path: Path) -> None:
    user = login_sandbox.users()[0].name
    empty = tmp_path / "empty_known_hosts"
    empty.write_text("")
    res = ssh(login_sandbox, user, "true", options=("-o", f"UserKnownHostsFile={empty}"))
    assert res.returncode == 255
    assert "Host key verification failed" in res.stderr
    other = tmp_path / "other"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(other)],
                   check=True, timeout=30)
    port = login.ssh_port(login_sandbox.spec.port_offset)
    wrong = tmp_path / "wrong_known_hosts"
    wrong.write_text(login.render_known_hosts(login_sandbox.spec.port_offset,
                                              (tmp_path / "other.pub").read_text()))
    res = ssh(login_sandbox, user, "true", options=("-o", f"UserKnownHostsFile={wrong}"))
    assert res.returncode == 255
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in res.stderr, res.stderr
    assert f"[127.0.0.1]:{port}" in Path(login.known_hosts(login_sandbox.layout)).read_text()


def test_only_the_users_key_gets_in(login_sandbox: Sandbox, tmp_path: Path) -> None:
    user = login_sandbox.users()[0].name
    stranger = tmp_path / "stranger"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(stranger)],
                   check=True, timeout=30)
    # The generated config with the stranger's key in place of the user's.
    bare = tmp_path / "config"
    bare.write_text(login.render_client_config(login_sandbox.layout,
                                               login_sandbox.spec.port_offset)
                    .replace(os.path.join(login.ssh_dir(login_sandbox.layout), "keys", "%r",
                                          "id_ed25519"), str(stranger)))
    res = subprocess.run(["ssh", "-F", str(bare), f"{user}@{login.HOST_ALIAS}", "true"],
                         capture_output=True, text=True, timeout=60, check=False,
                         stdin=subprocess.DEVNULL)
    assert res.returncode == 255
    assert "Permission denied (publickey)" in res.stderr
    res = ssh(login_sandbox, "root", "true")  # root has no key here, and may not log in
    assert res.returncode == 255


def test_status_names_the_sshd(login_sandbox: Sandbox) -> None:
    pid = login_sandbox.status().daemons.get("sshd")
    assert pid is not None and exists(pid)
    env_sh = Path(login_sandbox.layout.env_file).read_text()
    assert f"RAY_SLURM_SANDBOX_SSH_CONFIG='{login.client_config(login_sandbox.layout)}'" \
        in env_sh
