"""`ray-slurm run CONFIG [options] -- ENTRYPOINT...`: a cluster for one entrypoint.

`ray up`, the entrypoint as a Ray job with its output streamed to stdout, then the job stopped
and `ray down` on every way out: success, failure, Ctrl-C, SIGTERM, SIGHUP, the head's end
(walltime, scancel). The cluster autoscales as usual while the entrypoint runs. `ray up` and
`ray down` run in their own sessions (their output on stderr), so a terminal's Ctrl-C reaches
only this process, which then stops them in order.

Exit code: the entrypoint's; 130, 143, 129 after SIGINT, SIGTERM, SIGHUP; `CLUSTER_FAILED` when
the cluster failed (did not come up, its head ended, Ray could not run the entrypoint) rather
than the entrypoint; 2 for bad input, with nothing submitted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from ray_slurm_provider import proc, rayapi
from ray_slurm_provider.agent import oneshot
from ray_slurm_provider.cli import oneshots
from ray_slurm_provider.cli.common import CliError, Cluster, config_command, load_cluster
from ray_slurm_provider.jobs import decode_tags
from ray_slurm_provider.slurm.client import Job, SlurmError

CLUSTER_FAILED = oneshot.CLUSTER_FAILED
SIGNAL_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGHUP: 129}
HEAD_CHECK_EVERY = 10  # polls between asking Slurm whether the head job still runs
DOWN_TIMEOUT_S = 600.0
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_HINT_HEADINGS = ("To terminate the cluster:", "To monitor autoscaling:")
_NOT_FOR_RUN = re.compile(r"\bray down\b|/monitor\*")


class Interrupted(BaseException):
    """A signal arrived; the run ends with its exit code after cleaning up. A BaseException,
    so that no `except Exception` on the way (Ray's client, requests) swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class ClusterFailed(Exception):
    """The cluster, not the entrypoint, failed."""


@dataclass
class Plan:
    """A checked `ray-slurm run` request."""

    config: str
    entrypoint: list[str]
    runtime_env: dict[str, Any] = field(default_factory=dict)
    down: bool = True
    reuse: bool = False


def _add_options(p: argparse.ArgumentParser, defaults: bool = True, run: bool = True) -> None:
    """The options of `run` (`run=False`: only those `sbatch` shares with it)."""
    d: Any = argparse.SUPPRESS if not defaults else None
    p.add_argument("--working-dir", default=d, help="uploaded as the job's working dir")
    p.add_argument("--runtime-env-json", default=d, metavar="JSON",
                   help="the job's runtime_env, as JSON (merged with --working-dir)")
    if not run:
        return
    p.add_argument("--no-down", action="store_true", default=argparse.SUPPRESS if not defaults
                   else False, help="leave the cluster up afterwards")
    p.add_argument("--reuse", action="store_true", default=argparse.SUPPRESS if not defaults
                   else False, help="run on the cluster of that name if it is already up "
                   "(it is then left up)")


def plan(args: argparse.Namespace, run: bool = True) -> Plan:
    """Check the request; CliError (nothing submitted) when it cannot run."""
    rest = list(args.rest)
    if "--" not in rest:
        # argparse drops a `--` that directly follows CONFIG: then all of `rest` is the
        # entrypoint. Anything else that starts with an option lacks its `--`.
        if not rest or rest[0].startswith("-"):
            raise CliError("no entrypoint: put the command after `--`, e.g. "
                           f"`ray-slurm run {args.config} -- python train.py`")
        rest = ["--", *rest]
    i = rest.index("--")
    opts = argparse.ArgumentParser(prog="ray-slurm run", add_help=False)
    _add_options(opts, defaults=False, run=run)
    try:
        late = opts.parse_args(rest[:i])
    except SystemExit as e:
        raise CliError(f"unknown options before `--`: {shlex.join(rest[:i])}") from e
    vars(args).update(vars(late))
    entrypoint = rest[i + 1:]
    if not entrypoint:
        raise CliError("no entrypoint after `--`")
    runtime_env: dict[str, Any] = {}
    if args.runtime_env_json:
        try:
            runtime_env = json.loads(args.runtime_env_json)
        except json.JSONDecodeError as e:
            raise CliError(f"--runtime-env-json is not valid JSON: {e}") from e
        if not isinstance(runtime_env, dict):
            raise CliError("--runtime-env-json must be a JSON object")
    if args.working_dir is not None:
        wd = Path(args.working_dir).expanduser()
        if not wd.is_dir():
            raise CliError(f"--working-dir {args.working_dir}: no such directory")
        if "working_dir" in runtime_env:
            raise CliError("give the working dir once: --working-dir or runtime_env's")
        runtime_env["working_dir"] = str(wd.resolve())
    return Plan(args.config, entrypoint, runtime_env, down=not args.no_down, reuse=args.reuse)


def running_head(cluster: Cluster) -> str | None:
    """The head's job id while Slurm runs it, else None."""
    head = cluster.cdir.read_head()
    if head is None or not head.job_id:
        return None
    jobs = cluster.ask("listing the cluster's jobs",
                       lambda: cluster.client.list_jobs(cluster.job_name))
    return head.job_id if any(j.job_id == head.job_id and j.active for j in jobs) else None


def starting_head(cluster: Cluster, up: str | None) -> Job | None:
    """A head job of the cluster that Slurm lists but that is not up (PENDING, CONFIGURING,
    or running while Ray starts): a second `ray up` now would bring up the same cluster."""
    from ray.autoscaler.tags import NODE_KIND_HEAD, TAG_RAY_NODE_KIND

    for j in cluster.ask("listing the cluster's jobs",
                         lambda: cluster.client.list_jobs(cluster.job_name)):
        tags = decode_tags(j.comment) or {}
        if j.active and j.job_id != up and tags.get(TAG_RAY_NODE_KIND) == NODE_KIND_HEAD:
            return j
    return None


def own_env() -> dict[str, str]:
    """Our environment with this Python's bin dir first on PATH. The head job inherits it:
    an entrypoint's `python` is then the one `ray-slurm` runs in, even if not activated."""
    bindir = Path(sys.executable).parent
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}"}


def relay(src: Iterable[str], out: TextIO) -> None:
    """Copy `ray`'s output line by line, less the hints that do not apply to `run`: to
    `ray down` (run does) and to tail monitor logs under /tmp/ray (not where Ray logs here)."""
    skipped = False
    for line in src:
        plain = _ANSI.sub("", line).strip()
        if plain in _HINT_HEADINGS or _NOT_FOR_RUN.search(plain) or (skipped and not plain):
            skipped = bool(plain)  # the blank line after a dropped hint goes with it
            continue
        skipped = False
        out.write(line)
        out.flush()


def ray_cli(args: list[str], timeout: float) -> int:
    """`ray ARGS` from this Python's environment, output on stderr (through `relay`), in its
    own session."""
    ray = Path(sys.executable).with_name("ray")
    r, w = os.pipe()
    reader = threading.Thread(target=relay, args=(os.fdopen(r, errors="replace"), sys.stderr),
                              daemon=True, name="ray-output")
    reader.start()
    try:
        return proc.run_in_group([str(ray) if ray.exists() else "ray", *args],
                                 timeout=timeout, stdout=w, env=own_env())
    finally:
        os.close(w)
        reader.join(10)  # Ray's last lines before ours


def connect(cluster: Cluster) -> Any:
    """A Ray job client for the cluster's head (with its token)."""
    head = cluster.cdir.read_head()
    if head is None:
        raise ClusterFailed(f"`ray up` ended but no head is recorded in {cluster.cdir.root}")
    return oneshot.job_client(cluster.cdir, head, cluster.pcfg.auth.mode)


class Runner:
    """One `ray-slurm run`: its steps, with the outside world injectable for tests."""

    def __init__(self, cluster: Cluster, p: Plan, *,
                 ray: Callable[[list[str], float], int] = ray_cli,
                 client: Callable[[Cluster], Any] = connect,
                 sleep: Callable[[float], None] = time.sleep,
                 out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> None:
        self.cluster = cluster
        self.plan = p
        self.ray = ray
        self.client = client
        self.sleep = sleep
        self.out = out
        self.err = err
        self.job_id: str | None = None
        self.head: str | None = None

    def say(self, text: str) -> None:
        print(f"ray-slurm run: {text}", file=self.err, flush=True)

    def run(self) -> int:
        try:
            oneshots.sweep(self.cluster)
            up = running_head(self.cluster)
            starting = starting_head(self.cluster, up)
        except SlurmError as e:
            raise CliError(f"cannot ask Slurm whether the cluster is up: {e}") from e
        if starting is not None:
            raise CliError(f"cluster {self.cluster.name!r} is not up yet: its head job "
                           f"{starting.job_id} is {starting.state}; wait until it is up "
                           f"(then add --reuse), or cancel it: ray down -y {self.plan.config}")
        if up and not self.plan.reuse:
            raise CliError(f"cluster {self.cluster.name!r} is already up (head job {up}); "
                           "add --reuse to run on it, or `ray down` it first")
        created = up is None
        old = {s: signal.signal(s, self._raise) for s in SIGNAL_EXIT}
        client = None
        try:
            if created:
                wait = self.cluster.pcfg.head_wait_s + 600.0
                # Resolved afresh, as `sbatch` does: Ray's cache is keyed by the YAML alone
                # and keeps values from before an edit of a defaults file.
                if self.ray(["up", "-y", "--no-config-cache", self.plan.config], wait) != 0:
                    raise ClusterFailed("`ray up` failed (its output is above)")
            self.head = running_head(self.cluster)
            client = self.client(self.cluster)
            self.job_id = client.submit_job(entrypoint=shlex.join(self.plan.entrypoint),
                                            runtime_env=self.plan.runtime_env or None)
            self.say(f"Ray job {self.job_id} on head job {self.head}")
            return self.watch(client)
        except Interrupted as e:
            self.say(f"{e}: stopping the job and the cluster")
            return SIGNAL_EXIT[signal.Signals(e.signum)]
        except (ClusterFailed, proc.CommandError) as e:
            self.say(f"the cluster failed, not the entrypoint: {e}")
            return CLUSTER_FAILED
        except Exception as e:  # Ray's client refused or broke: still clean up, then say so
            self.say(f"the cluster failed, not the entrypoint: {type(e).__name__}: {e}")
            return CLUSTER_FAILED
        finally:
            for s in SIGNAL_EXIT:  # cleanup runs to the end; later signals are only noted
                signal.signal(s, lambda n, f: self.say(f"{signal.Signals(n).name}: still "
                                                       "cleaning up"))
            try:
                self.cleanup(client, down=created and self.plan.down)
            finally:
                for s, h in old.items():
                    signal.signal(s, h)

    @staticmethod
    def _raise(signum: int, frame: Any) -> None:
        raise Interrupted(signum)

    def watch(self, client: Any) -> int:
        polls = 0

        def check(answered: bool) -> None:
            nonlocal polls
            polls += 1
            if answered and polls % HEAD_CHECK_EVERY:
                return
            try:
                now = running_head(self.cluster)
            except SlurmError:
                return  # Slurm's hiccup is not the cluster's end: ask again later
            if self.head is not None and now != self.head:
                raise ClusterFailed(f"the head job {self.head} ended while the entrypoint "
                                    "ran (walltime, scancel?)")

        info = oneshot.follow(client, str(self.job_id), self.out, sleep=self.sleep,
                              check=check, say=self.say)
        code = oneshot.exit_code(info)
        if code is None:
            raise ClusterFailed(f"Ray job {self.job_id} {info.status}: {info.message}")
        self.say(f"the entrypoint exited with {code}")
        return code

    def cleanup(self, client: Any, down: bool) -> None:
        if client is not None and self.job_id is not None:
            try:
                if not client.get_job_info(self.job_id).status.is_terminal():
                    client.stop_job(self.job_id)
            except Exception as e:  # the head may be gone already
                self.say(f"could not stop Ray job {self.job_id}: {e}")
        if down:
            self.say("ray down")
            try:
                rayapi.drop_config_cache(self.plan.config)
                if self.ray(["down", "-y", self.plan.config], DOWN_TIMEOUT_S) != 0:
                    self.say(f"`ray down` failed: run `ray down -y {self.plan.config}`")
            except proc.CommandError as e:
                self.say(f"`ray down` failed ({e}): run `ray down -y {self.plan.config}`")


def cmd_run(args: argparse.Namespace) -> int:
    try:
        p = plan(args)
        return Runner(load_cluster(p.config, starts=True), p).run()
    except CliError as e:
        print(f"ray-slurm: {e}", file=sys.stderr)
        return 2


def register(sub: Any) -> None:
    p = config_command(sub, "run", "ray up, run one entrypoint as a Ray job, ray down",
                       cmd_run)
    _add_options(p)
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="-- ENTRYPOINT ...",
                   help="the command to run on the cluster, after `--`")
