"""`ray up` from a laptop (provider.ssh): the laptop's provider and runner send each call to
serve.py, which runs the login node's own SlurmNodeProvider. Here the "SSH" is in-process:
the request goes through JSON and serve's reply line, against FakeSlurm, so the laptop and
the login node run the same code the sandbox e2e test (test_laptop_tunnels.py) runs."""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import tarfile
import threading
from pathlib import Path
from typing import Any

import click
import pytest
from ray.autoscaler._private.subprocess_output_util import ProcessRunnerError
from ray.autoscaler.tags import TAG_RAY_NODE_KIND, TAG_RAY_NODE_STATUS

from ray_slurm_provider import proc
from ray_slurm_provider.config import SshConfig
from ray_slurm_provider.provider import bootstrap, laptop, serve, wire
from ray_slurm_provider.provider import provider as provider_module
from ray_slurm_provider.slurm.ssh import SshError
from ray_slurm_provider.state import ClusterDir
from tests.fakes import FakeSlurm
from tests.unit.test_provider import HEAD_TAGS

SSH = {"host": "login.example.org", "user": "me"}


class InProcess:
    """serve.py's request and reply, without SSH."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []

    def call(self, request: dict[str, Any], timeout: float | None) -> Any:
        request = json.loads(json.dumps(request))  # what crosses the connection is JSON
        self.requests.append(request)
        return laptop.parse_reply("printed\n" + serve.reply_line(request))[1]


def make(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[laptop.LaptopNodeProvider,
                                                                    FakeSlurm, InProcess]:
    fake = FakeSlurm()
    monkeypatch.setattr(provider_module, "make_client", lambda pcfg: fake)
    cfg = {"type": "external", "module": laptop.MODULE, "state_dir": str(tmp_path / "login"),
           "python": "/opt/venv/bin/python", "ssh": SSH}
    transport = InProcess()
    return laptop.LaptopNodeProvider(cfg, "c1", transport=transport), fake, transport


def test_the_laptop_runs_each_call_on_the_login_nodes_provider(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    p, fake, transport = make(tmp_path, monkeypatch)
    (head,) = p.create_node({"partition": "cpu", "cpus": 1}, HEAD_TAGS, 1)  # type: ignore[misc]
    assert transport.requests[-1]["provider"]["ssh"] == SSH  # the login side drops it
    assert p.non_terminated_nodes({}) == [head]
    asked = len(transport.requests)
    assert p.node_tags(head) == HEAD_TAGS  # from the listing's snapshot: no round trip
    assert not p.is_running(head)
    assert len(transport.requests) == asked
    fake.start(head, "n2")
    p.non_terminated_nodes({})
    assert p.is_running(head)
    assert p.internal_ip(head) == "127.0.0.3"
    p.set_node_tags(head, {TAG_RAY_NODE_STATUS: "up-to-date"})
    # The tags are the login node's files, under its lock (state.py), read by its provider.
    assert ClusterDir(str(tmp_path / "login"), "c1").tags(head)[TAG_RAY_NODE_STATUS] == \
        "up-to-date"
    assert p.node_tags(head)[TAG_RAY_NODE_STATUS] == "up-to-date"
    p.terminate_nodes([head])
    assert p.non_terminated_nodes({}) == []
    assert [head] in fake.cancelled


def test_the_head_gets_the_login_nodes_config(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    p, _, _ = make(tmp_path, monkeypatch)
    cfg = {"cluster_name": "c1", "provider": dict(p.provider_config)}
    head = p.prepare_for_head_node(cfg)
    assert "ssh" not in head["provider"]
    assert head["provider"]["module"] == "ray_slurm_provider.provider.SlurmNodeProvider"
    assert cfg["provider"]["ssh"] == SSH  # the laptop's own stays


def test_errors_cross_back_typed() -> None:
    with pytest.raises(click.ClickException, match=r"^no partition$"):
        laptop.raise_reply(wire.error_reply(click.ClickException("no partition")))
    ray_err = ProcessRunnerError("Command failed", "ssh_command_failed",  # type: ignore[no-untyped-call]
                                 code=3, command="false")
    with pytest.raises(ProcessRunnerError) as ei:
        laptop.raise_reply(wire.error_reply(ray_err))
    assert (ei.value.code, ei.value.command) == (3, "false")  # type: ignore[attr-defined]
    with pytest.raises(laptop.LoginError, match=r"^KeyError on the login node"):
        laptop.raise_reply(wire.error_reply(KeyError("x")))
    with pytest.raises(laptop.LoginError, match="gave no reply: No module named"):
        laptop.parse_reply("Traceback\nNo module named ray_slurm_provider\n")


def test_printed_output_comes_before_the_reply() -> None:
    printed, value = laptop.parse_reply("a\nb" + wire.MARKER.join(["\n", '{"ok": 5}\n']))
    assert (printed, value) == ("a\nb", 5)


def test_files_travel_as_one_archive_and_stay_inside(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "f.txt").write_text("hi")
    data, name = wire.pack(str(src) + "/")
    assert name == "src/"
    into = tmp_path / "into"
    wire.unpack(data, str(into))
    assert (into / "src" / "sub" / "f.txt").read_text() == "hi"
    for bad in ("../evil", "/abs"):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            info = tarfile.TarInfo(bad)
            tar.addfile(info, io.BytesIO(b""))
        with pytest.raises(ValueError, match="refused archive member"):
            wire.unpack(base64.b64encode(buf.getvalue()).decode(), str(into))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        link = tarfile.TarInfo("l")
        link.type = tarfile.SYMTYPE
        link.linkname = "/etc/passwd"
        tar.addfile(link)
    with pytest.raises(ValueError, match="refused archive member"):
        wire.unpack(base64.b64encode(buf.getvalue()).decode(), str(into))


class FakeLink:
    host = "login.example.org"

    def __init__(self, missing: list[str] | None = None, version: str | None = "1.0",
                 error: str | None = None) -> None:
        self.missing = missing or []
        self.version = version
        self.error = error

    def missing_commands(self) -> list[str]:
        if self.error:
            raise SshError(self.error)
        return self.missing

    def package_version(self, python: str) -> str | None:
        return self.version


@pytest.mark.parametrize(("link", "said"), [
    (FakeLink(error="cannot reach the login node login.example.org:22: Connection refused"),
     "provider.ssh: cannot reach the login node login.example.org:22: Connection refused"),
    (FakeLink(error="login.example.org:22 refused the login of me@login.example.org "
                    "(Permission denied: the key is not accepted; check provider.ssh.user "
                    "and identity_file)"), "Permission denied"),
    (FakeLink(missing=["sbatch", "squeue"]),
     "provider.ssh: the login node login.example.org lacks Slurm's sbatch, squeue on its PATH"),
    (FakeLink(version=None), "cannot import ray_slurm_provider"),
])
def test_bad_input_ends_ray_up_with_one_line(link: FakeLink, said: str) -> None:
    with pytest.raises(click.ClickException) as ei:
        laptop.preflight(link, "/opt/venv/bin/python")
    message = ei.value.format_message()
    assert said in message
    assert "\n" not in message


def test_ray_up_with_ssh_needs_the_login_nodes_python() -> None:
    cfg = {"cluster_name": "c", "provider": {"type": "external", "ssh": {"host": "h"}}}
    with pytest.raises(click.ClickException, match=r"provider\.python: with provider\.ssh"):
        bootstrap.bootstrap_config(cfg)


def test_ray_up_with_ssh_stops_before_anything_is_submitted(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def refused(*a: Any, **k: Any) -> Any:
        raise SshError("cannot reach the login node h:22: Connection refused")

    monkeypatch.setattr(laptop.SshLink, "missing_commands", refused)
    cfg = {"cluster_name": "c", "provider": {"type": "external", "python": "/p",
                                             "ssh": {"host": "h"}}}
    with pytest.raises(click.ClickException, match="Connection refused"):
        bootstrap.bootstrap_config(cfg)


def test_the_head_kind_is_what_the_login_node_set(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    p, _, _ = make(tmp_path, monkeypatch)
    p.create_node({"partition": "cpu", "cpus": 1}, HEAD_TAGS, 1)
    (head,) = p.non_terminated_nodes({TAG_RAY_NODE_KIND: HEAD_TAGS[TAG_RAY_NODE_KIND]})
    assert p.node_tags(head)[TAG_RAY_NODE_KIND] == HEAD_TAGS[TAG_RAY_NODE_KIND]


def test_sandbox_login_yaml_names_the_sandboxs_login_node() -> None:
    """cluster-configs/sandbox-login.yaml is for `sandbox up --users 1 --login` as it is:
    the default state dir, port offset 0, the first user (the e2e test swaps in its own)."""
    import yaml

    from ray_slurm_provider.sandbox import DEFAULT_STATE_DIR, login
    from ray_slurm_provider.sandbox.layout import Layout
    from ray_slurm_provider.sandbox.users import user_names

    path = Path(__file__).resolve().parents[2] / "cluster-configs" / "sandbox-login.yaml"
    provider = yaml.safe_load(path.read_text())["provider"]
    layout = Layout(DEFAULT_STATE_DIR)
    (user,) = user_names(1)
    assert provider["ssh"] == {"host": login.LOGIN_HOST, "port": login.ssh_port(0),
                               "user": user, "identity_file": login.user_key(layout, user),
                               "known_hosts": login.known_hosts(layout)}
    assert provider["python"] == str(Path(layout.shared_dir) / "venv" / "bin" / "python")


def test_a_config_with_ssh_gets_the_laptops_provider() -> None:
    """Ray loads the YAML's class, also where it never bootstraps the config (`ray
    get-head-ip`): with `ssh` that class hands over to the laptop's provider."""
    from ray_slurm_provider.provider.provider import SlurmNodeProvider

    cfg = {"type": "external", "module": wire.MODULE, "python": "/p", "ssh": SSH}
    assert isinstance(SlurmNodeProvider(cfg, "c1"), laptop.LaptopNodeProvider)
    plain = SlurmNodeProvider(wire.login_config(cfg), "c1")  # the login node's and the head's
    assert type(plain) is SlurmNodeProvider


def test_file_mounts_follow_symbolic_links(tmp_path: Path) -> None:
    """A link in a file mount arrives as what it points to: the login node refuses links
    in the archive, and one to this laptop's path would point nowhere there."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "data.txt").write_text("real")
    src = tmp_path / "src"
    src.mkdir()
    (src / "file-link").symlink_to(outside / "data.txt")
    (src / "dir-link").symlink_to(outside)
    data, _ = wire.pack(str(src))
    into = tmp_path / "into"
    wire.unpack(data, str(into))
    assert (into / "src" / "file-link").read_text() == "real"
    assert not (into / "src" / "file-link").is_symlink()
    assert (into / "src" / "dir-link" / "data.txt").read_text() == "real"


@pytest.mark.parametrize("target", ["missing", "loop"])
def test_a_link_that_points_nowhere_is_named(tmp_path: Path, target: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "bad").symlink_to(src / target)
    if target == "loop":
        (src / "loop").symlink_to(src / "bad")
    with pytest.raises(click.ClickException) as ei:
        wire.pack(str(src) + "/")
    message = ei.value.format_message()
    assert message.startswith("file_mounts: cannot copy "), message
    assert str(src / "bad") in message or str(src / "loop") in message, message


def test_a_link_to_a_directory_that_holds_it_stops_at_once(tmp_path: Path) -> None:
    """Followed, `sub/up -> ..` would copy the tree into itself until the kernel's limit of
    40 links (a big data directory beside such a link: 40 copies in memory)."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "data.bin").write_bytes(b"x" * 1000)
    (src / "sub" / "up").symlink_to(src)
    with pytest.raises(click.ClickException) as ei:
        wire.pack(str(src))
    assert ei.value.format_message() == (
        f"file_mounts: {src / 'sub' / 'up'} links to a directory that holds it")


class LostLink:
    """An SshLink whose connection is gone (or whose call outran its time)."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.cfg = SshConfig(host="login.example.org")

    def run(self, argv: list[str], **kw: object) -> Any:
        raise self.error

    def stream(self, argv: list[str], **kw: object) -> Any:
        raise self.error

    def close_tunnels(self, name: str) -> None:
        raise self.error


@pytest.mark.parametrize("error", [
    SshError("cannot reach the login node login.example.org:22: Connection reset",
             transient=True),
    proc.CommandTimeout(["ssh"], "ssh timed out after 600s"),
])
def test_a_lost_login_node_ends_the_ray_command_with_one_line(error: Exception) -> None:
    transport = laptop.SshTransport(LostLink(error), "/p")  # type: ignore[arg-type]
    with pytest.raises(click.ClickException) as ei:
        transport.call({"op": "non_terminated_nodes"}, 5)
    message = ei.value.format_message()
    assert message.startswith("provider.ssh: ") and str(error) in message
    assert "\n" not in message


def test_ray_down_ends_even_when_the_tunnels_cannot_be_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    provider, _, _ = make(tmp_path, monkeypatch)
    link = LostLink(proc.CommandTimeout(["ssh"], "ssh timed out after 30s"))
    inner = provider.transport

    class Both(laptop.SshTransport):
        def call(self, request: dict[str, Any], timeout: float | None) -> Any:
            return inner.call(request, timeout)

    provider.transport = Both(link, "/p")  # type: ignore[arg-type]
    provider.cleanup_cluster_resources()
    assert "could not close the tunnels" in capsys.readouterr().err


def test_what_a_call_prints_is_shown_as_it_comes_without_the_reply(
        capsys: pytest.CaptureFixture[str]) -> None:
    reply = serve.reply_line({"op": "version"})  # "\n" + MARKER + JSON + "\n"

    def show(text: str) -> str:
        shown = laptop.Shown()
        for line in re.findall(r"[^\n]*\n|[^\n]+$", text):  # as a pipe reads (not \x1e)
            shown.line(line)
        shown.end()
        return capsys.readouterr().out

    shown = laptop.Shown()
    shown.line("one\n")
    assert capsys.readouterr().out == "one\n"  # at once, before the call ends
    assert show("one\ntwo\n" + reply) == "one\ntwo\n"  # not the separator's empty line
    assert show("one\n\n\ntwo\n" + reply) == "one\n\n\ntwo\n"  # the output's own
    assert show("no newline" + reply) == "no newline\n"
    assert show("a\nb\n\n") == "a\nb\n\n"  # no reply (a crash): all of it


def test_rsync_down_brings_a_node_s_files_to_the_laptop(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray rsync-down`: the login node's runner copies off the node (here: the shared
    filesystem), the copy crosses as one archive, and lands as rsync would put it."""
    p, _, _ = make(tmp_path, monkeypatch)
    (head,) = p.create_node({"partition": "cpu", "cpus": 1}, HEAD_TAGS, 1)  # type: ignore[misc]
    src = tmp_path / "on-node" / "results"
    (src / "sub").mkdir(parents=True)
    (src / "sub" / "a.txt").write_text("A")
    (src / "b.txt").write_text("B")
    runner = p.get_command_runner("", head, {}, "c1", None, True)
    here = tmp_path / "laptop"
    runner.run_rsync_down(str(src) + "/", str(here))  # the directory's contents
    assert (here / "sub" / "a.txt").read_text() == "A" and (here / "b.txt").read_text() == "B"
    runner.run_rsync_down(str(src / "b.txt"), str(here / "c.txt"))  # a file, renamed
    assert (here / "c.txt").read_text() == "B"
    runner.run_rsync_down(str(src / "b.txt"), str(here / "sub"))  # a file into a directory
    assert (here / "sub" / "b.txt").read_text() == "B"
    assert not list((tmp_path / "login").glob("rsync-*"))  # the login node's stage is gone


def test_port_forwards_reach_the_head_where_it_is_and_end_with_the_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`ray dashboard` / `ray exec --port-forward` from a laptop: tunnels of their own (not
    `ray-slurm env`'s) to the head's real dashboard port, closed when the command ends."""
    from ray_slurm_provider.state import HeadInfo

    p, _, _ = make(tmp_path, monkeypatch)
    (head,) = p.create_node({"partition": "cpu", "cpus": 1}, HEAD_TAGS, 1)  # type: ignore[misc]
    ClusterDir(str(tmp_path / "login"), "c1").write_head(HeadInfo(
        job_id=head, ip="10.0.0.5", gcs_port=24000, dashboard_port=24001, client_port=24002))

    class Link:
        cfg = SshConfig(host="login.example.org")
        forwards: list[tuple[str, int, str, int]] = []
        closed: list[str] = []

        def forward(self, name: str, local: int, host: str, port: int) -> None:
            self.forwards.append((name, local, host, port))

        def close_tunnels(self, name: str) -> None:
            self.closed.append(name)

    inner = p.transport

    class Both(laptop.SshTransport):
        def call(self, request: dict[str, Any], timeout: float | None) -> Any:
            return inner.call(request, timeout)

    link = Link()
    p.transport = Both(link, "/p")  # type: ignore[arg-type]
    runner = p.get_command_runner("", head, {}, "c1", None, True)
    with runner.forwarding([(9000, 8265), (9001, 7777)]):
        (name, *_), _ = link.forwards
        assert link.forwards == [(name, 9000, "10.0.0.5", 24001), (name, 9001, "10.0.0.5", 7777)]
        assert name != "c1" and link.closed == []  # `env`'s tunnels are the cluster's name
    assert link.closed == [name]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_ray_dashboard_s_wait_ends_on_ctrl_c_term_or_hup(sig: int) -> None:
    """So the forwards' clean-up runs (Python's default TERM and HUP skip it). The signals
    are set as a terminal's shell leaves them: this test may run where they are ignored."""
    terminal = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL,
                signal.SIGHUP: signal.SIG_DFL}
    outside = {s: signal.signal(s, h) for s, h in terminal.items()}
    try:
        timer = threading.Timer(0.2, os.kill, (os.getpid(), sig))
        timer.start()
        laptop.until_stopped()  # returns instead of ending the process
        timer.join()
        assert {s: signal.getsignal(s) for s in terminal} == terminal
    finally:
        for s, h in outside.items():
            signal.signal(s, h)


def test_a_hup_ignored_under_nohup_stays_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    set_to: dict[int, Any] = {}
    monkeypatch.setattr(signal, "getsignal", lambda s: signal.SIG_IGN if s == signal.SIGHUP
                        else signal.SIG_DFL)
    monkeypatch.setattr(signal, "signal", lambda s, h: set_to.setdefault(s, h))
    monkeypatch.setattr(laptop.time, "sleep", lambda s: (_ for _ in ()).throw(
        KeyboardInterrupt()))
    laptop.until_stopped()
    assert signal.SIGHUP not in set_to and signal.SIGTERM in set_to
