"""What every cluster command needs: the loaded config, its Slurm client, findings, tables."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO, TypeVar

import yaml

from ray_slurm_provider.cluster import ClusterConfig, parse_cluster
from ray_slurm_provider.config import ConfigError, ProviderConfig, parse_provider
from ray_slurm_provider.jobs import job_name
from ray_slurm_provider.provider import defaults
from ray_slurm_provider.schema import with_source
from ray_slurm_provider.slurm.cli import CliSlurmClient
from ray_slurm_provider.slurm.client import SlurmClient
from ray_slurm_provider.slurm.client import ask as ask_slurm
from ray_slurm_provider.slurm.factory import make_client
from ray_slurm_provider.slurm.ssh import SshLink
from ray_slurm_provider.state import ClusterDir

#: What the commands that need the cluster directory say with provider.ssh, for now.
SSH_NOT_YET = ("provider.ssh: this command does not run from a laptop yet (the cluster "
               "directory's hand-offs over SSH are missing); run it on the login node. "
               "`ray-slurm doctor`, `validate`, `env`, `status`, `logs` and `report` work "
               "over SSH.")

T = TypeVar("T")


class CliError(Exception):
    """A command cannot go on; the message says why (and how to fix it)."""


@dataclass
class Cluster:
    """A cluster config as the commands see it."""

    path: str
    config: dict[str, Any]
    pcfg: ProviderConfig
    cdir: ClusterDir
    client_factory: Callable[[ProviderConfig], SlurmClient] = make_client
    _client: SlurmClient | None = field(default=None, repr=False)
    #: Key path -> the defaults file that supplied it (provider/defaults.py).
    from_defaults: dict[str, str] = field(default_factory=dict)
    #: The wait between tries of `ask` (None: time.sleep); tests never sleep.
    sleep: Callable[[float], None] | None = field(default=None, repr=False)

    @property
    def name(self) -> str:
        return str(self.config["cluster_name"])

    @property
    def job_name(self) -> str:
        return job_name(self.name)

    @functools.cached_property
    def parsed(self) -> ClusterConfig:
        """The whole cluster, parsed once; raises ConfigError naming the key."""
        return parse_cluster(self.config)

    @functools.cached_property
    def remote(self) -> SshLink | None:
        """The one connection to the login node (provider.ssh), else None."""
        return SshLink(self.pcfg.ssh) if self.pcfg.ssh is not None else None

    @property
    def slurm_client(self) -> SlurmClient:
        """For commands that ask Slurm only (no cluster directory): over provider.ssh when
        the config has it, else `client`."""
        if self.remote is not None:
            return CliSlurmClient(remote=self.remote)
        return self.client

    @property
    def client(self) -> SlurmClient:
        if self.pcfg.ssh is not None:  # the cluster directory is the login node's: not yet
            raise CliError(SSH_NOT_YET)
        if self._client is None:
            self._client = self.client_factory(self.pcfg)
        return self._client

    def ask(self, what: str, question: Callable[[], T]) -> T:
        """`ask` with this cluster's wait between tries."""
        return ask(what, question, self.sleep)


def ask(what: str, question: Callable[[], T],
        sleep: Callable[[float], None] | None = None) -> T:
    """`question()`, asked again while Slurm does not answer in time (slurm.client.ask). Each
    retry says so on stderr: a throttled controller makes a command slow, not silent."""
    return ask_slurm(what, question, sleep=sleep,
                     say=lambda line: print(f"ray-slurm: {line}", file=sys.stderr))


def load_cluster(path: str, *, starts: bool = False) -> Cluster:
    """Read and minimally check a cluster YAML (the provider section is parsed). `starts`: for
    the commands that check or start a cluster, a value YAML read otherwise than written is
    refused with its line; status and logs still read a cluster started with one."""
    try:
        text = Path(path).read_text()
        config = yaml.safe_load(text)
    except OSError as e:
        raise CliError(f"cannot read {path}: {e.strerror or e}") from e
    except yaml.YAMLError as e:
        raise CliError(f"{path} is not valid YAML: {e}") from e
    if not isinstance(config, dict) or not config.get("cluster_name"):
        raise CliError(f"{path}: not a Ray cluster config (no cluster_name)")
    try:
        supplied = defaults.apply(config)
    except ConfigError as e:
        raise CliError(str(e)) from e  # names the defaults file
    try:
        if starts:
            parse_cluster(config)
    except ConfigError as e:
        # What YAML 1.1 read otherwise than written (`time: 4:00:00` is 14400) is named with
        # its line here, where the text is at hand; the rest is each command's to report.
        named = with_source(e, text, path, only_surprises=True)
        if named is not e:
            raise CliError(str(named)) from e
    try:
        pcfg = parse_provider(config.get("provider") or {})
    except ConfigError as e:
        raise CliError(f"{path}: {e}") from e
    return Cluster(path, config, pcfg, ClusterDir(pcfg.state_dir, str(config["cluster_name"])),
                   from_defaults=supplied)


Level = Literal["ok", "info", "warn", "fail"]
MARK = {"ok": "OK  ", "info": "INFO", "warn": "WARN", "fail": "FAIL"}


@dataclass(frozen=True)
class Finding:
    """One check's outcome; `fix` says what to do about a warning or failure."""

    level: Level
    what: str
    message: str
    fix: str = ""

    def lines(self) -> list[str]:
        out = [f"[{MARK[self.level]}] {self.what}: {self.message}"]
        if self.fix and self.level in ("warn", "fail"):
            out.append(f"       fix: {self.fix}")
        return out


def report(findings: Sequence[Finding], out: TextIO | None = None) -> int:
    """Print findings; exit code 1 when any failed."""
    stream = out or sys.stdout
    for f in findings:
        for line in f.lines():
            print(line, file=stream)
    failed = sum(f.level == "fail" for f in findings)
    warned = sum(f.level == "warn" for f in findings)
    print(f"{failed} failed, {warned} warnings, {len(findings) - failed - warned} passed",
          file=stream)
    return 1 if failed else 0


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """Left-aligned columns, two spaces apart."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*headers).rstrip(), *(fmt.format(*r).rstrip() for r in rows)]


def config_command(sub: Any, name: str, help: str, func: Callable[[Any], int]) -> Any:
    """A `ray-slurm NAME CONFIG ...` subcommand; returns its parser for more arguments."""
    p = sub.add_parser(name, help=help)
    p.add_argument("config", help="cluster YAML")
    p.set_defaults(func=func)
    return p


def run_command(fn: Callable[[], int]) -> int:
    """Run a command body; CliError becomes one line on stderr and exit code 2."""
    try:
        return fn()
    except CliError as e:
        print(f"ray-slurm: {e}", file=sys.stderr)
        return 2
