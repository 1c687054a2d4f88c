"""`ray-slurm status`, `logs` and `report` from a laptop (`provider.ssh`).

These commands read the cluster directory, which lives on the login node, and ask Slurm,
whose commands are there too. So on a laptop the whole command runs on the login node, as
`<provider.python> -m ray_slurm_provider.cli.serve` over the one SSH connection (the
provider's `serve` does the same for Ray's calls): the request on stdin is the command line
and the cluster config without `ssh`; the login node writes the config to a private temp
file, runs the same command there, and replies with its exit code after what it printed
(wire.MARKER). A file the command writes (`report --html FILE`) comes back in the reply and
is written on the laptop. What the command prints is shown as it comes, so `status --watch`
and `logs --follow` work too (Ctrl-C ends the SSH session; the login node's command ends at
its next write).
"""

from __future__ import annotations

import argparse
import base64
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from ray_slurm_provider.provider.wire import login_config

#: The commands a laptop runs on the login node.
FORWARDED = frozenset({"status", "logs", "report"})
#: Stands for the config file on the login node, and for the file `--html` writes there.
CONFIG_ARG = "{config}"
HTML_ARG = "{html}"
#: A status or report, or the tail of a log, is done well within this.
CALL_TIMEOUT_S = 300.0


def streaming(args: argparse.Namespace) -> str | None:
    """The option that keeps the command running, if given."""
    if getattr(args, "watch", False):
        return "--watch"
    if getattr(args, "follow", False):
        return "--follow"
    return None


def remote_argv(argv: list[str], args: argparse.Namespace) -> list[str]:
    """`argv` for the login node: the config path and `--html`'s file replaced by
    placeholders (both are the laptop's paths)."""
    out = list(argv)
    out[out.index(args.config, out.index(args.command) + 1)] = CONFIG_ARG
    html = getattr(args, "html", None)
    if html:
        for i, a in enumerate(out):
            if a == "--html" and i + 1 < len(out) and out[i + 1] == html:
                out[i + 1] = HTML_ARG
            elif a == f"--html={html}":
                out[i] = f"--html={HTML_ARG}"
    return out


def forward(argv: list[str], args: argparse.Namespace) -> int | None:
    """Run the command on the login node when its config has provider.ssh; its exit code,
    or None to run it here."""
    from ray_slurm_provider.cli.common import CliError, load_cluster, run_command

    if args.command not in FORWARDED:
        return None
    try:
        cluster = load_cluster(args.config)
    except CliError:
        return None  # the command itself says what is wrong with the file
    if cluster.pcfg.ssh is None:
        return None

    def body() -> int:
        from ray_slurm_provider.provider.laptop import SshTransport, login_python
        from ray_slurm_provider.slurm.ssh import SshLink

        assert cluster.pcfg.ssh is not None
        transport = SshTransport(SshLink(cluster.pcfg.ssh), login_python(cluster.pcfg),
                                 module="ray_slurm_provider.cli.serve")
        config = dict(cluster.config)
        config["provider"] = login_config(config["provider"])
        # Output is shown as it comes; --watch and --follow run until Ctrl-C.
        timeout = None if streaming(args) else CALL_TIMEOUT_S
        reply = transport.call({"argv": remote_argv(argv, args), "config": config}, timeout)
        html = getattr(args, "html", None)
        if html and reply.get("html") is not None:
            Path(html).write_bytes(base64.b64decode(reply["html"]))
        return int(reply["code"])

    return run_command(body)


def run(request: dict[str, Any], command: Callable[[list[str]], int]) -> dict[str, Any]:
    """The login node's half (cli/serve.py): `command` (cli.main.main) on the request's
    command line, with a private copy of its config."""
    work = tempfile.mkdtemp(prefix="rsp-remote-")  # 0700: the config names the token's path
    try:
        config = os.path.join(work, "cluster.yaml")
        html = os.path.join(work, "report.html")
        Path(config).write_text(yaml.safe_dump(request["config"]))
        given = {CONFIG_ARG: config, HTML_ARG: html, f"--html={HTML_ARG}": f"--html={html}"}
        argv = [given.get(a, a) for a in request["argv"]]
        try:
            code = command(argv)
        except SystemExit as e:  # argparse: a command line this package does not take
            code = e.code if isinstance(e.code, int) else 2
        sys.stdout.flush()
        sent = Path(html).read_bytes() if os.path.exists(html) else None
        return {"code": code, "html": base64.b64encode(sent).decode() if sent else None}
    finally:
        shutil.rmtree(work, ignore_errors=True)
