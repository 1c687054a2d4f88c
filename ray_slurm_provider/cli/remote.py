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

import click
import yaml

from ray_slurm_provider.cli.common import CliError, Cluster, load_cluster, run_command
from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.provider.laptop import LoginError, SshTransport, login_python
from ray_slurm_provider.provider.wire import login_config
from ray_slurm_provider.slurm.ssh import SshLink

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


def _html_option(token: str) -> bool:
    """`--html`, `--html=F`, or an abbreviation argparse takes for it (`--ht`, `--htm=F`)."""
    name = token.split("=", 1)[0]
    return len(name) >= len("--ht") and "--html".startswith(name)


def remote_argv(argv: list[str], args: argparse.Namespace) -> list[str]:
    """`argv` for the login node: the config path and `--html`'s file (the laptop's paths)
    replaced by placeholders. `--html` is dropped wherever it stood, in whatever form, and
    given again at the end; only then is the config found, so a file named like the
    config cannot take its place."""
    out = list(argv)
    at = out.index(args.command) + 1
    if getattr(args, "html", None):
        kept = out[:at]
        rest = iter(out[at:])
        for token in rest:
            if token == "--":
                kept += [token, *rest]
            elif _html_option(token):
                if "=" not in token:
                    next(rest, None)  # its value
            else:
                kept.append(token)
        out = kept
    out[out.index(args.config, at)] = CONFIG_ARG
    if getattr(args, "html", None):
        out += ["--html", HTML_ARG]
    return out


def forward(argv: list[str], args: argparse.Namespace) -> int | None:
    """Run the command on the login node when its config has provider.ssh; its exit code,
    or None to run it here."""
    if args.command not in FORWARDED:
        return None
    try:
        cluster = load_cluster(args.config)
    except CliError:
        return None  # the command itself says what is wrong with the file
    if cluster.pcfg.ssh is None:
        return None

    def body() -> int:
        # Output is shown as it comes; --watch and --follow run until Ctrl-C.
        timeout = None if streaming(args) else CALL_TIMEOUT_S
        try:
            reply = login_side(cluster).call({"argv": remote_argv(argv, args),
                                              "config": login_only(cluster)}, timeout)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130 if streaming(args) is None else 0  # as --watch ends on the login node
        except (click.ClickException, LoginError, ConfigError) as e:
            raise CliError(e.format_message() if isinstance(e, click.ClickException)
                           else str(e)) from e
        html = getattr(args, "html", None)
        if html and reply.get("html") is not None:
            try:
                Path(html).write_bytes(base64.b64decode(reply["html"]))
            except OSError as e:
                raise CliError(f"cannot write {html}: {e.strerror or e}") from e
            print(f"ray-slurm: the page is {html} (here; the login node's copy is gone)",
                  file=sys.stderr)
        return int(reply["code"])

    return run_command(body)


def run_there(cluster: Cluster, argv: list[str]) -> str:
    """`ray-slurm ARGV` (CONFIG_ARG stands for the config) on the login node, its output
    not shown (the Python API reads it): what it printed. CliError with its last words when
    it fails."""
    try:
        printed, err, reply = login_side(cluster).ask(
            {"argv": argv, "config": login_only(cluster)}, CALL_TIMEOUT_S)
    except (click.ClickException, LoginError, ConfigError) as e:
        raise CliError(e.format_message() if isinstance(e, click.ClickException)
                       else str(e)) from e
    if reply["code"] != 0:
        said = err.strip().splitlines() or [f"exit code {reply['code']}"]
        host = cluster.pcfg.ssh.host if cluster.pcfg.ssh else "the login node"
        raise CliError(f"`ray-slurm {argv[0]}` on {host}: "
                       f"{said[-1].removeprefix('ray-slurm: ')}")
    return printed


def login_side(cluster: Cluster) -> SshTransport:
    """The login node's `ray-slurm` (cli/serve.py) over the cluster's connection."""
    assert cluster.pcfg.ssh is not None
    return SshTransport(SshLink(cluster.pcfg.ssh), login_python(cluster.pcfg),
                        module="ray_slurm_provider.cli.serve")


def login_only(cluster: Cluster) -> dict[str, Any]:
    """The cluster's config as the login node runs it: without `ssh`."""
    config = dict(cluster.config)
    config["provider"] = login_config(config["provider"])
    return config


def run(request: dict[str, Any], command: Callable[[list[str]], int]) -> dict[str, Any]:
    """The login node's half (cli/serve.py): `command` (cli.main.main) on the request's
    command line, with a private copy of its config."""
    argv = list(request["argv"])
    if not argv or argv[0] not in FORWARDED:
        raise ValueError(f"not a command a laptop runs here: {argv[:1]}")
    work = tempfile.mkdtemp(prefix="rsp-remote-")  # 0700: the config names the token's path
    try:
        config = os.path.join(work, "cluster.yaml")
        html = os.path.join(work, "report.html")
        Path(config).write_text(yaml.safe_dump(request["config"]))
        given = {CONFIG_ARG: config, HTML_ARG: html, f"--html={HTML_ARG}": f"--html={html}"}
        argv = [given.get(a, a) for a in argv]
        try:
            code = command(argv)
        except SystemExit as e:  # argparse: a command line this package does not take
            code = e.code if isinstance(e.code, int) else 2
        sys.stdout.flush()
        sent = Path(html).read_bytes() if os.path.exists(html) else None
        return {"code": code, "html": base64.b64encode(sent).decode() if sent else None}
    finally:
        shutil.rmtree(work, ignore_errors=True)
