"""`ray-slurm status|logs|report` from a laptop (cli/remote.py): the command line and the config
(without `ssh`) go to the login node, which runs the same command on a private copy of the
config; its output, exit code and `--html` file come back. The SSH hop is replaced by an
in-process call of the login node's half."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from ray_slurm_provider import proc
from ray_slurm_provider.cli import main as cli
from ray_slurm_provider.cli import remote, serve
from ray_slurm_provider.slurm.ssh import SshLink

CONFIG: dict[str, Any] = {"cluster_name": "c", "provider": {
    "type": "external", "module": "ray_slurm_provider.provider.SlurmNodeProvider",
    "python": "/login/venv/bin/python",
    "ssh": {"host": "login.example", "user": "me", "identity_file": "~/.ssh/id_x"}}}


@pytest.fixture
def login_node(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each SSH call runs the login node's half here; what the command saw is recorded."""
    seen: list[dict[str, Any]] = []

    def fake_main(argv: list[str]) -> int:
        path = Path(next(a for a in argv if a.endswith("cluster.yaml")))
        seen[-1].update(argv=argv, config=yaml.safe_load(path.read_text()),
                        mode=stat.S_IMODE(path.parent.stat().st_mode))
        print(f"ran {argv[0]} on the login node")
        for i, a in enumerate(argv):
            if a == "--html":
                Path(argv[i + 1]).write_text("<html>report</html>")
        return 3

    def stream(self: SshLink, argv: list[str], *, on_line: Callable[[str], None],
               on_err: Callable[[str], None], input: str = "",
               timeout: float | None = 0, keep: int | None = None) -> proc.Result:
        assert argv == ["/login/venv/bin/python", "-m", "ray_slurm_provider.cli.serve"]
        seen.append({"timeout": timeout})
        out = io.StringIO()
        with contextlib.redirect_stdout(out), mock.patch.object(sys, "stdin",
                                                                io.StringIO(input)):
            serve.main()
        for line in re.findall(r"[^\n]*\n|[^\n]+$", out.getvalue()):  # as a pipe reads
            on_line(line)
        return proc.Result(argv, 0, out.getvalue(), "")

    monkeypatch.setattr(SshLink, "stream", stream)
    monkeypatch.setattr(serve, "cli_main", fake_main)
    return seen


def write(tmp_path: Path, config: dict[str, Any]) -> str:
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_report_runs_on_the_login_node_and_its_page_comes_back(
        tmp_path: Path, login_node: list[dict[str, Any]],
        capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, CONFIG)
    page = tmp_path / "page.html"
    code = remote.forward(["report", path, "--json", "--html", str(page)],
                          cli.parse(["report", path, "--json", "--html", str(page)]))
    assert code == 3  # the login node's exit code
    assert "ran report on the login node" in capsys.readouterr().out
    (call,) = login_node
    config_path, html_path = call["argv"][1], call["argv"][4]
    assert call["argv"] == ["report", config_path, "--json", "--html", html_path]
    assert config_path != path and html_path != str(page)  # the login node's own files
    assert "ssh" not in call["config"]["provider"]  # the login node's config
    assert call["config"]["cluster_name"] == "c" and call["mode"] == 0o700
    assert page.read_text() == "<html>report</html>"
    assert not os.path.exists(config_path)  # removed after the command


def test_options_between_positionals_keep_their_place(
        tmp_path: Path, login_node: list[dict[str, Any]]) -> None:
    path = write(tmp_path, CONFIG)
    argv = ["logs", "--lines", "5", path, "head"]
    assert remote.forward(argv, cli.parse(argv)) == 3
    assert login_node[0]["argv"][:3] == ["logs", "--lines", "5"]
    assert login_node[0]["argv"][4] == "head"


def test_what_runs_until_ctrl_c_has_no_time_limit(
        tmp_path: Path, login_node: list[dict[str, Any]]) -> None:
    path = write(tmp_path, CONFIG)
    for argv in (["status", path, "--watch"], ["logs", path, "head", "--follow"],
                 ["status", path]):
        assert remote.forward(argv, cli.parse(argv)) == 3
    assert [c["timeout"] for c in login_node] == [None, None, remote.CALL_TIMEOUT_S]


def test_without_ssh_or_for_other_commands_nothing_is_forwarded(
        tmp_path: Path, login_node: list[dict[str, Any]]) -> None:
    local = {**CONFIG, "provider": {k: v for k, v in CONFIG["provider"].items() if k != "ssh"}}
    path = write(tmp_path, local)
    assert remote.forward(["status", path], cli.parse(["status", path])) is None
    path = write(tmp_path, CONFIG)
    assert remote.forward(["validate", path], cli.parse(["validate", path])) is None
    assert login_node == []


def test_the_reply_is_the_last_line_after_what_the_command_printed(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    def reply_to(argv: list[str]) -> dict[str, Any]:
        monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(
            {"argv": argv, "config": CONFIG})))
        assert serve.main() == 0
        out = capsys.readouterr()
        return dict(json.loads(out.out.rsplit("\x1erayslurm-reply ", 1)[1]))

    # argparse's exit (a laptop with a newer package) is the command's exit code, not a
    # traceback; its words went to stderr.
    assert reply_to(["status", remote.CONFIG_ARG, "--nosuch"]) == {
        "ok": {"code": 2, "html": None}}
    # Only the forwarded commands run there.
    assert reply_to(["sandbox", "down"])["error"]["kind"] == "ValueError"


@pytest.mark.parametrize(("argv", "sent"), [
    (["report", "C", "--html", "p.html"], ["report", "{config}", "--html", "{html}"]),
    (["report", "--htm", "p.html", "C", "--json"],
     ["report", "{config}", "--json", "--html", "{html}"]),
    (["report", "--ht=p.html", "C"], ["report", "{config}", "--html", "{html}"]),
    (["report", "--html", "C", "C"], ["report", "{config}", "--html", "{html}"]),
    (["status", "status"], ["status", "{config}"]),
])
def test_the_laptop_s_paths_never_reach_the_login_node(argv: list[str],
                                                       sent: list[str]) -> None:
    assert remote.remote_argv(argv, cli.parse(argv)) == sent


def test_a_lost_connection_or_ctrl_c_is_one_line(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import click

    path = write(tmp_path, CONFIG)
    failure: list[BaseException] = [click.ClickException("provider.ssh: cannot reach it")]

    def stream(self: SshLink, argv: list[str], **kw: Any) -> proc.Result:
        raise failure[0]

    monkeypatch.setattr(SshLink, "stream", stream)
    assert remote.forward(["status", path], cli.parse(["status", path])) == 2
    assert capsys.readouterr().err == "ray-slurm: provider.ssh: cannot reach it\n"
    failure[0] = KeyboardInterrupt()
    assert remote.forward(["status", path, "--watch"],
                          cli.parse(["status", path, "--watch"])) == 0
    assert remote.forward(["status", path], cli.parse(["status", path])) == 130
    assert "Traceback" not in capsys.readouterr().err
