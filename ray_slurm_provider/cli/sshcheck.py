"""`ray-slurm doctor` with `provider.ssh`: the SSH path to the login node, each step with
how to fix it: the login (host key, key), the Slurm commands there, Slurm answering through
them, and this package in the login node's `provider.python` at the laptop's version."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable

from ray_slurm_provider import proc
from ray_slurm_provider.cli.common import Finding, ask
from ray_slurm_provider.config import ProviderConfig
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import SlurmError
from ray_slurm_provider.slurm.ssh import SshError, SshLink, destination

PACKAGE = "ray-slurm-provider"


def local_version() -> str:
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def ssh_findings(pcfg: ProviderConfig, link: SshLink | None = None,
                 sleep: Callable[[float], None] | None = None) -> list[Finding]:
    """Each check stops the later ones when it fails: they all need the one before. `sleep`:
    the wait before Slurm is asked again (common.ask)."""
    assert pcfg.ssh is not None
    cfg = pcfg.ssh
    link = link or SshLink(cfg)
    where = f"{destination(cfg)}:{cfg.port}"
    try:
        link.run(["true"], timeout=60)
    except SshError as e:
        return [Finding("fail", "SSH login", str(e), "fix provider.ssh (host, port, user, "
                        "identity_file, known_hosts), then `ray-slurm doctor` again")]
    except proc.CommandError as e:
        return [Finding("fail", "SSH login", f"{where}: {e}", "check the login shell")]
    out = [Finding("ok", "SSH login", f"{where} (host key verified, one multiplexed "
                   "connection)")]
    if pcfg.slurm_api != "cli":
        return [*out, Finding("fail", "Slurm over SSH", f"slurm_api {pcfg.slurm_api} with "
                              "provider.ssh", "set provider.slurm_api: cli")]
    try:
        missing = link.missing_commands()
    except (SshError, proc.CommandError) as e:
        return [*out, Finding("fail", "Slurm commands", str(e), "run doctor again")]
    if missing:
        return [*out, Finding("fail", "Slurm commands", f"not on the login node's PATH: "
                              f"{', '.join(missing)}", "is this the login node? does its "
                              "shell load the Slurm module for non-interactive logins?")]
    out.append(Finding("ok", "Slurm commands", "sbatch, squeue, scancel, scontrol, sinfo, "
                       "srun on the login node"))
    try:
        info = ask("asking Slurm for its partitions", CliSlurmClient(remote=link).cluster_info,
                   sleep)
    except SlurmError as e:
        return [*out, Finding("fail", "Slurm via ssh", str(e),
                              "on the login node: `scontrol ping`")]
    out.append(Finding("ok", "Slurm via ssh", f"Slurm {info.version} answers "
                       f"({len(info.partitions)} partitions)"))
    out.append(_version(pcfg, link))
    return out


def _version(pcfg: ProviderConfig, link: SshLink) -> Finding:
    python = pcfg.python or "python3"
    mine = local_version()
    try:
        theirs = link.package_version(python)
    except (SshError, proc.CommandError) as e:
        return Finding("fail", "package version", str(e), "run doctor again")
    if theirs is None:
        return Finding("fail", "package version", f"{python} on the login node has no "
                       f"{PACKAGE}", "set provider.python to the login node's Python "
                       "that has it (and ray)")
    if theirs != mine:
        return Finding("warn", "package version", f"this machine runs {PACKAGE} {mine}, "
                       f"the login node's {python} {theirs}",
                       f"install {PACKAGE}=={theirs} here, or {mine} there")
    return Finding("ok", "package version", f"{PACKAGE} {mine} on both sides ({python})")
