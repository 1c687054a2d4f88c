"""`provider.ssh`'s one connection (slurm/ssh.py): the ssh argv and its security options, the
quoting of the remote command (property tests: every word reaches the remote program whole,
run here through the same kind of shell a login node runs it with), one-line errors, the
control dir, and the `ray-slurm` commands that refuse provider.ssh for now (`ray up` over
it: test_laptop.py)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ray_slurm_provider import config, proc
from ray_slurm_provider.config import SshConfig
from ray_slurm_provider.slurm import ssh as sshlink
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import PermanentSlurmError, SlurmError, TransientSlurmError
from ray_slurm_provider.slurm.sacct import Accounting
from ray_slurm_provider.slurm.ssh import SshError, SshLink
from ray_slurm_provider.state import ClusterDir

CFG = SshConfig(host="login.example.org", port=2222, user="me",
                identity_file="/keys/id", jump_host="gw.example.org", known_hosts="/kh")


def option_values(argv: list[str]) -> dict[str, str]:
    out = {}
    for i, a in enumerate(argv):
        if a == "-o":
            key, _, value = argv[i + 1].partition("=")
            out[key] = value
    return out


def test_every_call_checks_the_host_key_and_forwards_nothing() -> None:
    argv = sshlink.ssh_argv(CFG, "/ctl", "true")
    o = option_values(argv)
    assert o["StrictHostKeyChecking"] == "yes"
    assert o["BatchMode"] == "yes"
    assert o["ClearAllForwardings"] == "yes"
    assert o["ForwardAgent"] == "no"
    assert o["ForwardX11"] == "no"
    assert o["ControlMaster"] == "auto"
    assert o["ControlPath"] == "/ctl/%C"
    assert o["UserKnownHostsFile"] == "/kh"
    assert o["IdentitiesOnly"] == "yes"
    assert {"-a", "-x"} <= set(argv)
    assert argv[argv.index("-p") + 1] == "2222"
    assert argv[argv.index("-i") + 1] == "/keys/id"
    assert argv[argv.index("-J") + 1] == "gw.example.org"
    assert argv[-3:] == ["--", "me@login.example.org", "true"]
    assert not any("=no" in a and "StrictHostKeyChecking" in a for a in argv)


def test_the_remote_command_is_quoted_words() -> None:
    cmd = sshlink.remote_command(["squeue", "--name=a b", "$(id)"],
                                 {"SLURM_TIME_FORMAT": "standard"})
    assert cmd == "env SLURM_TIME_FORMAT=standard squeue '--name=a b' '$(id)'"
    with pytest.raises(ValueError):
        sshlink.remote_command(["true"], {"A;B": "x"})
    with pytest.raises(ValueError):
        sshlink.remote_command([])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(alphabet=st.characters(blacklist_categories=("Cs",),
                                               blacklist_characters="\x00"),
                        max_size=30), min_size=1, max_size=6))
def test_any_words_reach_the_remote_program_whole(words: list[str]) -> None:
    """sshd hands the command string to the user's shell as `sh -c STRING`."""
    cmd = sshlink.remote_command(["printf", "%s\\0", *words])
    out = subprocess.run(["sh", "-c", cmd], capture_output=True, timeout=10,
                         check=True).stdout
    assert out.decode("utf-8", "surrogateescape").split("\0")[:-1] == words


@pytest.mark.parametrize(("stderr", "expected"), [
    ("ssh: connect to host h port 22: Connection refused", "cannot reach the login node"),
    ("ssh: Could not resolve hostname nope: Name or service not known",
     "cannot reach the login node"),
    ("me@h: Permission denied (publickey).", "refused the login of me@login"),
    ("@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed.",
     "not the one in known_hosts"),
])
def test_ssh_failures_are_one_line(stderr: str, expected: str) -> None:
    message = sshlink.explain(CFG, stderr)
    assert expected in message
    assert "\n" not in message


def test_an_unknown_host_key_says_how_to_accept_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sshlink, "fingerprints", lambda cfg: ["256 SHA256:abc h (ED25519)"])
    message = sshlink.explain(CFG, "No ED25519 host key is known for [h]:2222 and you have "
                              "requested strict checking.\nHost key verification failed.")
    assert "unknown host key for login.example.org:2222" in message
    assert "SHA256:abc" in message
    assert "ssh -p 2222 me@login.example.org true" in message


class FakeSsh:
    """proc.run for ssh: answers with a fixed exit code and stderr, records the argv."""

    def __init__(self, rc: int, stdout: str = "", stderr: str = "") -> None:
        self.rc = rc
        self.stdout = stdout
        self.stderr = stderr
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kw: object) -> proc.Result:
        self.calls.append(list(argv))
        return proc.Result(list(argv), self.rc, self.stdout, self.stderr)


def test_run_types_its_failures(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    link = SshLink(CFG, control=str(tmp_path))
    monkeypatch.setattr(proc, "run", FakeSsh(255, stderr="Connection refused"))
    with pytest.raises(SshError):
        link.run(["sinfo"])
    monkeypatch.setattr(proc, "run", FakeSsh(127, stderr="sh: sinfo: not found"))
    with pytest.raises(proc.CommandNotFound):
        link.run(["sinfo"])
    monkeypatch.setattr(proc, "run", FakeSsh(1, stderr="Invalid job id"))
    with pytest.raises(proc.CommandFailed, match="Invalid job id"):
        link.run(["scontrol", "show", "job", "1"])
    fake = FakeSsh(0, stdout="ok\n")
    monkeypatch.setattr(proc, "run", fake)
    assert link.run(["sinfo"]).stdout == "ok\n"


def test_the_cli_back_end_runs_through_the_link(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    fake = FakeSsh(0, stdout="")
    monkeypatch.setattr(proc, "run", fake)
    client = CliSlurmClient(remote=SshLink(CFG, control=str(tmp_path)))
    client.list_jobs("ray-x")
    assert fake.calls[0][0] == "ssh"
    assert fake.calls[0][-1].startswith("env SLURM_TIME_FORMAT=standard squeue ")
    monkeypatch.setattr(proc, "run", FakeSsh(255, stderr="Connection timed out"))
    with pytest.raises(TransientSlurmError, match="cannot reach the login node"):
        client.list_jobs("ray-x")


def test_the_control_dir_is_private() -> None:
    tmp_path = Path(tempfile.mkdtemp(prefix="rsp-u-", dir="/tmp"))
    d = tmp_path / "ctl"
    assert sshlink.control_dir(str(d)) == str(d)
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    os.chmod(d, 0o755)
    sshlink.control_dir(str(d))
    assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
    with pytest.raises(SshError, match="too long"):
        sshlink.control_dir("/tmp/" + "x" * 60)
    link_path = tmp_path / "link"
    link_path.symlink_to(d)
    with pytest.raises(SshError):
        sshlink.control_dir(str(link_path))
    shutil.rmtree(tmp_path)


def test_provider_ssh_is_in_the_model() -> None:
    pcfg = config.parse_provider({"ssh": {"host": "h", "user": "me"}})
    assert pcfg.ssh is not None
    assert (pcfg.ssh.port, pcfg.ssh.control_persist_s) == (22, 600)
    with pytest.raises(config.ConfigError, match=r"provider\.ssh\.host"):
        config.parse_provider({"ssh": {"user": "me"}})
    with pytest.raises(config.ConfigError, match=r"provider\.ssh"):
        config.parse_provider({"ssh": {"host": "h", "agent": True}})


def test_commands_that_need_the_cluster_directory_say_not_yet(tmp_path: Path) -> None:
    from ray_slurm_provider.cli.common import SSH_NOT_YET, CliError, load_cluster

    path = tmp_path / "c.yaml"
    path.write_text("cluster_name: c\nprovider:\n  type: external\n  ssh: {host: h}\n")
    cluster = load_cluster(str(path))
    with pytest.raises(CliError) as ei:
        _ = cluster.client
    assert str(ei.value) == SSH_NOT_YET
    assert isinstance(cluster.slurm_client, CliSlurmClient)  # validate and doctor: over SSH
    assert cluster.remote is not None


def test_remote_paths_under_home_are_relative() -> None:
    assert sshlink.remote_path("~/.ray_slurm/c/head.json") == "./.ray_slurm/c/head.json"
    assert sshlink.remote_path("/scratch/me/c") == "/scratch/me/c"
    with pytest.raises(SshError):
        sshlink.remote_path("~other/x")


def test_tunnel_ports_are_chosen_once_and_kept(tmp_path: Path) -> None:
    from ray_slurm_provider.cli import tunnels

    first = tunnels.local_ports(tmp_path)
    assert sorted(first) == ["client", "dashboard"]
    assert tunnels.local_ports(tmp_path) == first
    (tmp_path / tunnels.TUNNELS_FILE).write_text('{"dashboard": 40001}')
    again = tunnels.local_ports(tmp_path)
    assert again["dashboard"] == 40001
    assert tunnels.local_ports(tmp_path) == again


def test_head_json_from_the_login_node_is_typed() -> None:
    from ray_slurm_provider.state import parse_head

    head = parse_head('{"job_id": "7", "ip": "10.0.0.5", "gcs_port": 24000, "x": 1}', "h")
    assert head is not None
    assert (head.ip, head.dashboard_port, head.client_port) == ("10.0.0.5", 8265, 10001)
    assert parse_head("[]", "h") is None
    with pytest.raises(ValueError, match="malformed"):
        parse_head("{", "h")


def test_the_heads_autoscaler_and_the_agents_ignore_provider_ssh() -> None:
    """make_client is what the provider (in the head's autoscaler) and the agents build:
    Slurm there is local, whatever provider.ssh says."""
    from ray_slurm_provider.slurm.factory import make_client

    client = make_client(config.parse_provider({"ssh": {"host": "h"}}))
    assert isinstance(client, CliSlurmClient)
    assert client._remote is None


class FakeLink:
    """SshLink's run for version checks: the package's and Ray's versions there."""

    def __init__(self, package: str | None, ray_line: str) -> None:
        self.package = package
        self.ray_line = ray_line
        self.cfg = CFG

    def package_version(self, python: str) -> str | None:
        return self.package

    def run(self, argv: list[str], **kw: object) -> proc.Result:
        return proc.Result(list(argv), 0, self.ray_line + "\n", "")


def test_version_differences_are_said(tmp_path: Path) -> None:
    from ray_slurm_provider.cli import tunnels
    from ray_slurm_provider.cli.common import load_cluster
    from ray_slurm_provider.cli.sshcheck import local_version

    path = tmp_path / "c.yaml"
    path.write_text("cluster_name: c\nprovider:\n  type: external\n  ssh: {host: h}\n")
    cluster = load_cluster(str(path))
    same = FakeLink(local_version(), tunnels.local_ray_versions())
    assert tunnels.version_warnings(cluster, same) == []  # type: ignore[arg-type]
    other = FakeLink("0.0.1", "1.0.0 3.9")
    said = tunnels.version_warnings(cluster, other)  # type: ignore[arg-type]
    assert "0.0.1 on login.example.org" in said[0]
    assert "on the cluster 1.0.0/3.9" in said[1]
    assert "no ray-slurm-provider" in tunnels.version_warnings(
        cluster, FakeLink(None, tunnels.local_ray_versions()))[0]  # type: ignore[arg-type]


class SlowLink(FakeLink):
    """A login node whose Slurm does not answer `sinfo` in time at first (issue 29)."""

    def __init__(self, timeouts: int) -> None:
        from ray_slurm_provider.cli.sshcheck import local_version

        super().__init__(local_version(), "")
        self.timeouts = timeouts
        self.asked: list[str] = []

    def missing_commands(self) -> list[str]:
        return []

    def run(self, argv: list[str], **kw: object) -> proc.Result:
        self.asked.append(argv[0])
        if argv[0] == "sinfo" and self.timeouts:
            self.timeouts -= 1
            raise proc.CommandTimeout(argv, "timed out", stderr="")
        out = {"sinfo": "slurm 25.11.7\n", "scontrol": ""}.get(argv[0], "")
        return proc.Result(list(argv), 0, out, "")


def test_doctor_over_ssh_asks_a_throttled_controller_again() -> None:
    from ray_slurm_provider.cli.sshcheck import ssh_findings

    pcfg = config.parse_provider({"ssh": {"host": "h"}})
    waits: list[float] = []
    link = SlowLink(timeouts=1)
    found = {f.what: f for f in ssh_findings(pcfg, link, sleep=waits.append)}  # type: ignore[arg-type]
    assert found["Slurm via ssh"].level == "ok" and len(waits) == 1
    assert link.asked.count("sinfo") == 2
    found = {f.what: f for f in ssh_findings(pcfg, SlowLink(timeouts=3),  # type: ignore[arg-type]
                                             sleep=waits.append)}
    assert found["Slurm via ssh"].level == "fail" and len(waits) == 3


class RecordRun:
    """proc.run's stand-in: records each argv; `-O check` fails until a master was started."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.started: set[str] = set()

    def __call__(self, argv: list[str], **_: object) -> proc.Result:
        self.calls.append(list(argv))
        socket = option_values(argv).get("ControlPath", "")
        if "-O" in argv:
            op = argv[argv.index("-O") + 1]
            if op == "exit":
                self.started.discard(socket)
            ok = op != "check" or socket in self.started
            return proc.Result(list(argv), 0 if ok else 255, "", "")
        self.started.add(socket)
        return proc.Result(list(argv), 0, "", "")


def test_tunnels_have_a_master_of_their_own_per_cluster(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cluster's tunnels persist until closed (an idle main master ends after
    ControlPersist and would take them along), closing them ends neither the main connection
    nor another cluster's, and a forward request carries no forward from the user's
    ssh_config (-F /dev/null: ClearAllForwardings would drop ours too)."""
    run = RecordRun()
    monkeypatch.setattr(proc, "run", run)
    link = SshLink(CFG, control="/ctl")
    link.forward("a", 40001, "10.0.0.5", 8265)
    start, forward = run.calls[1], run.calls[2]
    socket = link.tunnel_socket("a")
    assert option_values(start)["ControlPath"] == socket != "/ctl/%C"
    assert option_values(start)["ControlPersist"] == "yes"
    assert option_values(start)["ClearAllForwardings"] == "yes"
    assert start[-2:] == ["me@login.example.org", "true"]
    assert forward[:3] == ["ssh", "-F", "/dev/null"]
    assert forward[forward.index("-O") + 1:forward.index("--")] == [
        "forward", "-L", "127.0.0.1:40001:10.0.0.5:8265"]
    assert option_values(forward)["ControlPath"] == socket
    link.forward("a", 40002, "10.0.0.5", 10001)  # the master runs: no second one
    assert sum(1 for c in run.calls if "-O" not in c) == 1
    assert link.tunnel_socket("b") != socket
    assert len(os.path.basename(socket)) == 40  # as long as ssh's %C: fits sun_path
    link.close_tunnels("a")
    assert run.calls[-1][run.calls[-1].index("-O") + 1] == "exit"
    assert option_values(run.calls[-1])["ControlPath"] == socket
    assert "/ctl/%C" not in run.calls[-1]


def test_closing_tunnels_never_removes_the_clusters_own_token(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where this machine's home is the login node's (a notebook on the cluster), the local
    dir of `env` is the cluster directory itself: `--close` removes the copy, never the token
    the cluster runs with."""
    from ray_slurm_provider.cli import common, tunnels

    monkeypatch.setenv("HOME", str(tmp_path))
    cdir = tmp_path / ".ray_slurm" / "c"
    cdir.mkdir(parents=True, mode=0o700)
    (cdir / "auth_token").write_text("the-token\n")
    (cdir / "head.json").write_text('{"job_id": "1", "ip": "10.0.0.5", "gcs_port": 6379, '
                                    '"dashboard_port": 8265, "client_port": 10001}')

    class Link:
        cfg = CFG
        forwards: list[tuple[str, int, str, int]] = []
        closed: list[str] = []

        def read_file(self, path: str) -> str | None:
            p = Path(os.path.expanduser(path))
            return p.read_text() if p.exists() else None

        def forward(self, name: str, local: int, host: str, port: int) -> None:
            self.forwards.append((name, local, host, port))

        def close_tunnels(self, name: str) -> None:
            self.closed.append(name)

        def package_version(self, python: str) -> str | None:
            return sshcheck_version

        def run(self, argv: list[str], **_: object) -> proc.Result:
            return proc.Result(list(argv), 0, tunnels.local_ray_versions(), "")

    from ray_slurm_provider.cli.sshcheck import local_version
    sshcheck_version = local_version()
    link = Link()
    cfg = {"cluster_name": "c", "provider": {"type": "external", "python": "python3",
                                              "ssh": {"host": CFG.host}}}
    pcfg = config.parse_provider(cfg["provider"])  # type: ignore[arg-type]
    cluster = common.Cluster("c.yaml", cfg, pcfg, ClusterDir(str(tmp_path / "unused"), "c"))
    cluster.__dict__["remote"] = link  # the cached property: this fake instead of ssh
    lines = tunnels.open_tunnels(cluster)
    token = Path(next(ln for ln in lines if "RAY_AUTH_TOKEN_PATH" in ln).split("=", 1)[1])
    assert token != cdir / "auth_token" and token.read_text() == "the-token\n"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert {(h, p) for _, _, h, p in link.forwards} == {("10.0.0.5", 8265), ("10.0.0.5", 10001)}
    tunnels.close_tunnels(cluster)
    assert link.closed[-1] == "c"
    assert not token.exists()
    assert (cdir / "auth_token").read_text() == "the-token\n"


@pytest.mark.parametrize(("stderr", "transient"), [
    ("ssh: connect to host h port 22: Connection refused", True),
    ("ssh: connect to host h port 22: Connection timed out", True),
    ("Connection closed by 10.0.0.1 port 22", True),
    ("client_loop: send disconnect: Broken pipe", True),
    ("me@h: Permission denied (publickey).", False),
    ("@@@ WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED! @@@\nHost key verification failed."
     "\nConnection closed", False),
    ("Connection to login.example.org closed by remote host.", True),
    ("Timeout, server login.example.org not responding.", True),
    ("", True),  # the shared master died mid-command: it writes its messages nowhere
    ("kex_exchange_identification: read: Connection reset by peer", True),
    ("Received disconnect from h port 22:2: Too many authentication failures", False),
    ("Unable to negotiate with h port 22: no matching host key type found", False),
])
def test_only_a_failed_connection_is_worth_asking_again(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, stderr: str, transient: bool) -> None:
    """The CLI back end and sacct (and the retries above them) ask Slurm again where the
    connection failed or was lost; a refused key or host key stops at once with ssh's
    reason."""
    monkeypatch.setattr(sshlink, "fingerprints", lambda cfg: [])
    monkeypatch.setattr(proc, "run", FakeSsh(255, stderr=stderr))
    link = SshLink(CFG, control=str(tmp_path))
    kind = TransientSlurmError if transient else PermanentSlurmError
    with pytest.raises(SlurmError) as ei:
        CliSlurmClient(remote=link).list_jobs("ray-x")
    assert type(ei.value) is kind
    assert "\n" not in str(ei.value)
    with pytest.raises(SlurmError) as ei:
        Accounting(remote=link).ended_job("7")
    assert type(ei.value) is kind


class BrokenLink(FakeLink):
    """Logs in, then loses the connection (or the remote shell hangs)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(None, "")
        self.error = error
        self.calls = 0

    def run(self, argv: list[str], **kw: object) -> proc.Result:
        self.calls += 1
        if self.calls == 1:
            return proc.Result(list(argv), 0, "", "")
        raise self.error

    def missing_commands(self) -> list[str]:
        self.run(["sh"])
        return []


@pytest.mark.parametrize("error", [
    SshError("cannot reach the login node h:22: Connection reset", transient=True),
    proc.CommandTimeout(["sh"], "sh timed out after 30s"),
])
def test_doctor_over_ssh_says_a_lost_connection_as_a_finding(error: Exception) -> None:
    from ray_slurm_provider.cli.sshcheck import _version, ssh_findings

    pcfg = config.parse_provider({"ssh": {"host": "h"}})
    found = ssh_findings(pcfg, BrokenLink(error))  # type: ignore[arg-type]
    assert [f.level for f in found] == ["ok", "fail"]
    assert str(error) in found[-1].message

    class NoVersion(FakeLink):
        def package_version(self, python: str) -> str | None:
            raise error

    version = _version(pcfg, NoVersion(None, ""))  # type: ignore[arg-type]
    assert version.level == "fail" and str(error) in version.message


def test_env_says_a_hung_ssh_in_one_line(tmp_path: Path) -> None:
    from ray_slurm_provider.cli import common, tunnels

    class Hung:
        cfg = CFG

        def package_version(self, python: str) -> str | None:
            raise proc.CommandTimeout(["ssh"], "ssh timed out after 60s")

    cfg = {"cluster_name": "c", "provider": {"type": "external", "python": "python3",
                                              "ssh": {"host": CFG.host}}}
    pcfg = config.parse_provider(cfg["provider"])  # type: ignore[arg-type]
    cluster = common.Cluster("c.yaml", cfg, pcfg, ClusterDir(str(tmp_path / "unused"), "c"))
    cluster.__dict__["remote"] = Hung()
    with pytest.raises(common.CliError) as ei:
        tunnels.open_tunnels(cluster)
    assert str(ei.value) == f"over ssh to {CFG.host}: ssh timed out after 60s"
