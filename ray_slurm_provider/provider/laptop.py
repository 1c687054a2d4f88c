"""`ray up` ... `ray down` from a laptop (`provider.ssh`): Ray's provider and command runner
whose every call runs on the login node (serve.py) through the one SSH connection.

`bootstrap_config` (on the laptop) names this provider in the resolved config, and
`prepare_for_head_node` gives the head the login node's config back (wire.login_config),
so the head's autoscaler never sees `ssh`. The laptop keeps only the last listing's answers
(serve.snapshot), so Ray's per-node questions cost no round trip.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import click
from ray.autoscaler.command_runner import CommandRunnerInterface
from ray.autoscaler.node_provider import NodeProvider

from ray_slurm_provider import proc
from ray_slurm_provider.config import ConfigError, ProviderConfig
from ray_slurm_provider.provider import validation, wire
from ray_slurm_provider.provider.handoff import runner_error
from ray_slurm_provider.provider.teardown import shorten_ray_down_poll
from ray_slurm_provider.provider.transfer import copy
from ray_slurm_provider.slurm.ssh import SshError, SshLink

MODULE = "ray_slurm_provider.provider.laptop.LaptopNodeProvider"
#: A provider call (a listing, a cancel and its wait) is done well within this.
CALL_TIMEOUT_S = 600.0


class LoginError(RuntimeError):
    """The login node's side failed in a way that has no Ray type (one line)."""


class Transport(Protocol):
    """How a request reaches serve.handle on the login node (SSH; in-process in tests)."""

    def call(self, request: dict[str, Any], timeout: float | None) -> Any: ...


def raise_reply(error: dict[str, Any]) -> None:
    """Re-raise serve.error_reply's error as the laptop's Ray expects it."""
    kind = error.get("kind")
    message = str(error.get("message", ""))
    if kind == "click":
        raise click.ClickException(message)
    if kind == "runner":
        raise runner_error(message, error.get("code"), str(error.get("cmd", "")))
    raise LoginError(f"{kind} on the login node: {message}")


def parse_reply(stdout: str) -> tuple[str, Any]:
    """(what the call printed, its reply) from serve.main's stdout."""
    printed, sep, line = stdout.rpartition("\n" + wire.MARKER)
    if not sep:
        if stdout.startswith(wire.MARKER):
            printed, line = "", stdout[len(wire.MARKER):]
        else:
            raise LoginError("the login node's provider.python gave no reply: "
                             + (stdout.strip().splitlines() or ["no output"])[-1])
    reply = json.loads(line)
    if "error" in reply:
        raise_reply(reply["error"])
    return printed, reply.get("ok")


#: What a shown call keeps of its output besides showing it: the reply line is the last.
SHOWN_KEPT = 1024 * 1024


class Shown:
    """Writes what a call prints to stdout as it comes, but not the reply: a line that
    starts with MARKER, and the empty line serve's separator makes before it when the
    output ended with a newline (held back until the next line tells which it is)."""

    def __init__(self) -> None:
        self.held = False

    def line(self, text: str) -> None:
        if text.startswith(wire.MARKER):
            self.held = False
            return
        self.end()
        if text == "\n":
            self.held = True
            return
        sys.stdout.write(text)
        sys.stdout.flush()

    def err(self, text: str) -> None:
        sys.stderr.write(text)
        sys.stderr.flush()

    def end(self) -> None:
        """An empty line held back was the output's own."""
        if self.held:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.held = False


class SshTransport:
    """`<python> -m <module>` on the login node, per request: the provider's calls
    (provider/serve.py), or a `ray-slurm` command (cli/serve.py)."""

    def __init__(self, link: SshLink, python: str,
                 module: str = "ray_slurm_provider.provider.serve") -> None:
        self.link = link
        self.python = python
        self.module = module

    def call(self, request: dict[str, Any], timeout: float | None) -> Any:
        """The reply of one request; what the call prints is shown as it comes. ssh's
        failure, or a call that outran `timeout` (None: none), ends the `ray` command with
        one line (Ray prints a ClickException without a traceback)."""
        shown = Shown()
        try:
            return self._exchange(request, timeout, shown.line, shown.err, keep=SHOWN_KEPT)[2]
        finally:
            shown.end()

    def ask(self, request: dict[str, Any], timeout: float | None) -> tuple[str, str, Any]:
        """What the call printed on stdout and on stderr, and its reply; nothing is shown
        (the Python API reads a command's output)."""
        return self._exchange(request, timeout, lambda _: None, lambda _: None)

    def _exchange(self, request: dict[str, Any], timeout: float | None,
                  on_line: Callable[[str], None],
                  on_err: Callable[[str], None],
                  keep: int | None = None) -> tuple[str, str, Any]:
        """(what the call printed, or its end with `keep`; its stderr; its reply)."""
        try:
            res = self.link.stream([self.python, "-m", self.module], on_line=on_line,
                                   on_err=on_err, input=json.dumps(request), timeout=timeout,
                                   keep=keep)
        except SshError as e:
            raise click.ClickException(f"provider.ssh: {e}") from e
        except proc.CommandError as e:
            raise click.ClickException(f"provider.ssh: {request.get('op', 'a call')} on "
                                       f"{self.link.cfg.host}: {e}") from e
        if res.returncode != 0 and wire.MARKER not in res.stdout:
            said = (res.stderr.strip().splitlines() or [f"exit code {res.returncode}"])[-1]
            raise LoginError(f"{self.python} -m {self.module} failed on "
                             f"{self.link.cfg.host}: {said}")
        printed, value = parse_reply(res.stdout)
        return printed, res.stderr, value


def login_python(pcfg: ProviderConfig) -> str:
    if not pcfg.python:
        raise ConfigError("provider.python: with provider.ssh, name the login node's Python "
                          "that has ray and ray_slurm_provider installed")
    return pcfg.python


class LoginLink(Protocol):
    """What preflight asks of the connection (SshLink is one)."""

    @property
    def host(self) -> str: ...
    def missing_commands(self) -> list[str]: ...
    def package_version(self, python: str) -> str | None: ...


def preflight(link: LoginLink, python: str) -> dict[str, Any]:
    """Before anything is submitted: the login node answers, has Slurm's commands, and
    `python` has this package. Raises click.ClickException with one line; returns the far
    side's versions."""
    try:
        missing = link.missing_commands()
        if missing:
            raise click.ClickException(f"provider.ssh: the login node {link.host} lacks "
                                       f"Slurm's {', '.join(missing)} on its PATH")
        version = link.package_version(python)
    except SshError as e:
        raise click.ClickException(f"provider.ssh: {e}") from e
    except proc.CommandError as e:
        raise click.ClickException(f"provider.ssh: {e}") from e
    if version is None:
        raise click.ClickException(f"provider.ssh: {python} on {link.host} cannot import "
                                   "ray_slurm_provider (provider.python must be the login "
                                   "node's Python with this package)")
    return {"package": version}


def head_config(cluster_config: dict[str, Any]) -> dict[str, Any]:
    """The config the head gets: the login node's (no `ssh`, the provider's own module)."""
    out = dict(cluster_config)
    out["provider"] = wire.login_config(cluster_config["provider"])
    return out


class LaptopNodeProvider(NodeProvider):
    """SlurmNodeProvider's calls, run on the login node."""

    def __init__(self, provider_config: dict[str, Any], cluster_name: str,
                 transport: Transport | None = None) -> None:
        super().__init__(provider_config, cluster_name)
        self.pcfg = validation.check_section(provider_config, cluster_name).provider
        if transport is None:
            assert self.pcfg.ssh is not None
            transport = SshTransport(SshLink(self.pcfg.ssh), login_python(self.pcfg))
        self.transport = transport
        self._nodes: dict[str, dict[str, Any]] = {}

    def call(self, op: str, *args: Any, timeout: float = CALL_TIMEOUT_S,
             **fields: Any) -> Any:
        request = {"op": op, "args": list(args), "cluster_name": self.cluster_name,
                   "provider": self.provider_config, **fields}
        return self.transport.call(request, timeout)

    def _changed(self) -> None:
        self._nodes = {}

    def _known(self, node_id: str) -> dict[str, Any] | None:
        return self._nodes.get(str(node_id))

    def non_terminated_nodes(self, tag_filters: dict[str, str]) -> list[str]:
        reply = self.call("non_terminated_nodes", tag_filters)
        self._nodes.update(reply["nodes"])
        return list(reply["ids"])

    def nodes_for_teardown(self, tag_filters: dict[str, str]) -> list[str]:
        shorten_ray_down_poll()  # this process runs Ray's teardown loop
        return self.non_terminated_nodes(tag_filters)

    def node_tags(self, node_id: str) -> dict[str, str]:
        known = self._known(node_id)
        return dict(known["tags"]) if known else dict(self.call("node_tags", node_id))

    def is_running(self, node_id: str) -> bool:
        known = self._known(node_id)
        return bool(known["running"]) if known else bool(self.call("is_running", node_id))

    def is_terminated(self, node_id: str) -> bool:
        if self._known(node_id):
            return False  # listed: not terminated
        return bool(self.call("is_terminated", node_id))

    def internal_ip(self, node_id: str) -> str | None:  # type: ignore[override]
        known = self._known(node_id)
        ip = known["internal_ip"] if known else self.call("internal_ip", node_id)
        return str(ip) if ip is not None else None

    def external_ip(self, node_id: str) -> str | None:  # type: ignore[override]
        known = self._known(node_id)
        ip = known["external_ip"] if known else self.call("external_ip", node_id)
        return str(ip) if ip is not None else None

    def set_node_tags(self, node_id: str, tags: dict[str, str]) -> None:
        self.call("set_node_tags", node_id, tags)
        known = self._known(node_id)
        if known:
            known["tags"] = {**known["tags"], **tags}

    def create_node(self, node_config: dict[str, Any], tags: dict[str, str],
                    count: int) -> dict[str, Any] | None:
        self._changed()
        out: dict[str, Any] | None = self.call("create_node", node_config, tags, count)
        return out

    def terminate_node(self, node_id: str) -> dict[str, Any] | None:
        return self.terminate_nodes([node_id])

    def terminate_nodes(self, node_ids: list[str]) -> dict[str, Any] | None:
        self._changed()
        out: dict[str, Any] | None = self.call("terminate_nodes", [str(i) for i in node_ids])
        return out

    def cleanup_cluster_resources(self) -> Any:
        out = self.call("cleanup_cluster_resources")
        if isinstance(self.transport, SshTransport):  # `ray down`: its tunnels go with it
            try:
                self.transport.link.close_tunnels(self.cluster_name)
            except (SshError, proc.CommandError) as e:  # the cluster is down all the same
                click.echo(f"provider.ssh: could not close the tunnels of "
                           f"{self.cluster_name}: {e}", err=True)
        return out

    def prepare_for_head_node(self, cluster_config: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = self.call("prepare_for_head_node", head_config(cluster_config))
        return out

    def get_command_runner(self, log_prefix: str, node_id: str, auth_config: dict[str, Any],
                           cluster_name: str, process_runner: Any, use_internal_ip: bool,
                           docker_config: dict[str, Any] | None = None) -> Any:
        return LaptopRunner(self, str(node_id), log_prefix)


def until_stopped() -> None:
    """Sleep until Ctrl-C, a TERM or a HUP (a closed terminal), then return: the caller's
    clean-up runs whichever came (Python's default TERM and HUP would end the process
    without it, and the forwards' SSH master would outlive `ray dashboard`). A signal the
    process ignores (HUP under nohup) stays ignored."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    saved = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)
             if signal.getsignal(s) == signal.SIG_DFL}
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        click.echo("Forwarding stopped.")
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)


class LaptopRunner(CommandRunnerInterface):
    """SrunCommandRunner's calls, run on the login node."""

    def __init__(self, provider: LaptopNodeProvider, node_id: str, log_prefix: str) -> None:
        self.provider = provider
        self.node_id = node_id
        self.log_prefix = log_prefix

    def _timeout(self) -> float:
        # A command may wait for a queued head and its `ray start` (bootstrap's limits).
        return CALL_TIMEOUT_S + self.provider.pcfg.head_wait_s \
            + self.provider.pcfg.head_start_timeout_s

    def run(self, cmd: str | None = None, timeout: int = 120, exit_on_fail: bool = False,
            port_forward: Any = None, with_output: bool = False,
            environment_variables: dict[str, object] | None = None, run_env: str = "auto",
            ssh_options_override_ssh_key: str = "", shutdown_after_run: bool = False) -> Any:
        if port_forward:
            with self.forwarding(port_forward):
                if cmd is None:  # `ray dashboard`: forward until Ctrl-C (or TERM, HUP)
                    click.echo("Press Ctrl-C to stop forwarding.")
                    until_stopped()
                    return None
                return self.run(cmd, timeout, exit_on_fail, None, with_output,
                                environment_variables, run_env, ssh_options_override_ssh_key,
                                shutdown_after_run)
        kwargs = {"cmd": cmd, "timeout": timeout, "exit_on_fail": exit_on_fail,
                  "with_output": with_output, "environment_variables": environment_variables,
                  "run_env": run_env, "shutdown_after_run": shutdown_after_run}
        out = self.provider.call("run", timeout=self._timeout(), node_id=self.node_id,
                                 log_prefix=self.log_prefix, kwargs=kwargs)
        self.provider._changed()  # a `shutdown` cancels the job
        return out.encode() if with_output else out

    @contextlib.contextmanager
    def forwarding(self, port_forward: Any) -> Iterator[None]:
        """Ray's (local, remote) ports as tunnels of their own over the connection, to the
        head as the login node sees it (its dashboard where it really is), for as long as
        the command runs; only ever bound to 127.0.0.1 here."""
        pairs = [port_forward] if isinstance(port_forward, tuple) else list(port_forward)
        found = self.provider.call("forward_targets", [list(p) for p in pairs],
                                   node_id=self.node_id, log_prefix=self.log_prefix)
        transport = self.provider.transport
        if not isinstance(transport, SshTransport):
            raise click.ClickException("provider.ssh: forwarding needs the SSH connection")
        name = f"{self.provider.cluster_name}:forward:{os.getpid()}"  # not `env`'s tunnels
        try:
            for local, host, remote in found:
                transport.link.forward(name, int(local), str(host), int(remote))
                click.echo(f"Forwarding 127.0.0.1:{local} -> {host}:{remote} (over ssh to "
                           f"{transport.link.cfg.host})")
            yield
        except SshError as e:
            raise click.ClickException(f"provider.ssh: {e}") from e
        finally:
            transport.link.close_tunnels(name)

    def run_rsync_up(self, source: str, target: str, options: Any = None) -> None:
        files, name = wire.pack(source)
        self.provider.call("rsync_up", files, name, target, node_id=self.node_id,
                           log_prefix=self.log_prefix)

    def run_rsync_down(self, source: str, target: str, options: Any = None) -> None:
        """The login node copies `source` off the node and sends it as one archive; it is
        copied here as the login node's runner copies (a `dir/` gives its contents)."""
        got = self.provider.call("rsync_down", source, node_id=self.node_id,
                                 log_prefix=self.log_prefix)
        stage = tempfile.mkdtemp(prefix="rsp-down-")  # 0700
        try:
            wire.unpack(got["files"], stage)
            copy(os.path.join(stage, got["name"].rstrip("/")), os.path.expanduser(target))
        finally:
            shutil.rmtree(stage, ignore_errors=True)

    def remote_shell_command_str(self) -> str:
        raise click.ClickException("provider.ssh: `ray attach` from a laptop is not "
                                   "supported yet")

    def run_init(self, *, as_head: bool, file_mounts: dict[str, str],
                 sync_run_yet: bool) -> bool | None:
        return None  # as SrunCommandRunner's: nothing to set up before commands
