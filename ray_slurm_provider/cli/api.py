"""`SlurmCluster`: a cluster from Python (a notebook, a script), in the habit of
dask-jobqueue: `with SlurmCluster("cluster.yaml") as c: ray.init(c.address)`.

`up` and `down` run the `ray` CLI in a child process through `ray-slurm run`'s helper
(proc.run_in_group), not Ray's in-process SDK (`create_or_update_cluster`): its output comes
line by line on stderr (a notebook shows it under the cell as it comes), it reads no stdin
(`-y`: no prompt can hang a kernel), an interrupted kernel ends its whole process group, and
nothing of `ray up`'s process-wide state (Ray's CLI logger, the provider's hooks and patches,
`sys.exit` on Ray's CLI error paths) lands in the caller's interpreter. The rest is the
commands' own code: the addresses and token of `ray-slurm env`, the data of `ray-slurm
status`, the logs of `ray-slurm logs`. Every failure is a ClusterError; nothing here exits.

On the login node only for now (Slurm's commands and the cluster directory local); every
outside access goes through the loaded `Cluster` and the `ray` callable, the seams a remote
login node would replace.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ray_slurm_provider import proc, rayapi
from ray_slurm_provider.agent import oneshot
from ray_slurm_provider.cli import env, logs, remote, run, status, tunnels
from ray_slurm_provider.cli.common import CliError, Cluster, load_cluster
from ray_slurm_provider.slurm.client import SlurmError
from ray_slurm_provider.state import HeadInfo

#: `ray ARGS` with a timeout -> its exit code (run.ray_cli; tests pass a recorder).
RayCli = Callable[[list[str], float], int]
#: What runs on the head for `request_resources`: Ray's public call needs a driver of the
#: cluster, which a process off the cluster (or a Ray Client) is not.
_REQUEST = ("import json, sys, ray; from ray.autoscaler.sdk import request_resources; "
            "ray.init(); request_resources(**json.loads(sys.argv[1]))")
REQUEST_TIMEOUT_S = 120.0


class ClusterError(Exception):
    """The cluster could not be started, read or stopped; the message says why."""


@contextlib.contextmanager
def _typed(what: str) -> Iterator[None]:
    """The commands' and Slurm's errors as ClusterError (`what` is what was being done)."""
    try:
        yield
    except CliError as e:
        raise ClusterError(str(e)) from e
    except (SlurmError, proc.CommandError, OSError) as e:
        raise ClusterError(f"{what}: {e}") from e


class SlurmCluster:
    """A Ray cluster on Slurm, described by a cluster YAML (`ray up`'s).

    `up()` (or `with`) brings it up; leaving the `with` block takes down what `up()` brought
    up. Without `up()` the object reads a cluster that is already up (`ray up` in a shell).
    `reuse`: `up()` on a cluster that is already up uses it (and leaves it up), else it is
    refused, as `ray-slurm run` does."""

    def __init__(self, config: str | os.PathLike[str], *, reuse: bool = False,
                 ray: RayCli = run.ray_cli,
                 sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = os.fspath(config)
        with _typed(f"cannot read {self.path}"):
            #: The loaded config, as the `ray-slurm` commands see it.
            self.cluster: Cluster = load_cluster(self.path, starts=True)
        self.reuse = reuse
        self._ray = ray
        self._sleep = sleep
        self._clock = clock
        #: Whether this object brought the cluster up (and so takes it down on exit).
        self.created = False

    def __repr__(self) -> str:
        return f"SlurmCluster({self.path!r}, name={self.cluster.name!r})"

    def __enter__(self) -> SlurmCluster:
        return self.up()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def laptop(self) -> bool:
        """The config has provider.ssh: Slurm and the cluster directory are the login
        node's, reached over the connection (cli/remote.py, cli/tunnels.py)."""
        return self.cluster.pcfg.ssh is not None

    def _heads(self) -> tuple[str | None, tuple[str, str] | None]:
        """The head's job id while its Ray is up, and (job id, state) of a head job that
        Slurm lists but whose Ray is not up yet."""
        if not self.laptop:
            live = run.running_head(self.cluster)
            starting = run.starting_head(self.cluster, live)
            return live, (starting.job_id, starting.state) if starting else None
        heads = [r for r in self.status()["nodes"] if r["kind"] == "head"]
        live = next((str(r["job_id"]) for r in heads if r["ray_up"]), None)
        other = next((r for r in heads if not r["ray_up"] and str(r["job_id"]) != live), None)
        return live, (str(other["job_id"]), str(other["state"])) if other else None

    def up(self) -> SlurmCluster:
        """`ray up`: submit the head and wait until its Ray is up. A failed or interrupted
        `ray up` is followed by `ray down`, so that no job of it is left."""
        with _typed("cannot ask Slurm whether the cluster is up"):
            live, starting = self._heads()
        if starting is not None:
            raise ClusterError(f"cluster {self.cluster.name!r} is not up yet: its head job "
                               f"{starting[0]} is {starting[1]}; wait until it is up "
                               "(then pass reuse=True), or take it down: down()")
        if live is not None:
            if not self.reuse:
                raise ClusterError(f"cluster {self.cluster.name!r} is already up (head job "
                                   f"{live}); pass reuse=True to use it, or down() it first")
            return self
        self.created = True
        wait = self.cluster.pcfg.head_wait_s + 600.0
        try:
            # Resolved afresh, as `ray-slurm run` does: Ray's cache is keyed by the YAML alone.
            with _typed("`ray up` failed"):
                code = self._ray(["up", "-y", "--no-config-cache", self.path], wait)
            if code != 0:
                raise ClusterError(f"`ray up` failed with exit code {code} (its output is "
                                   "above)")
        except BaseException:
            with contextlib.suppress(ClusterError):
                self.down()
            raise
        return self

    def down(self) -> None:
        """`ray down`: cancel every job of the cluster and wait until Slurm has ended them."""
        self.created = False
        rayapi.drop_config_cache(self.path)  # `ray down` has no --no-config-cache
        with _typed("`ray down` failed"):
            code = self._ray(["down", "-y", self.path], run.DOWN_TIMEOUT_S)
        if code != 0:
            raise ClusterError(f"`ray down` failed with exit code {code} (its output is "
                               f"above): run `ray down -y {self.path}`")

    def close(self) -> None:
        """Take the cluster down if this object brought it up."""
        if self.created:
            self.down()

    # --- addresses ---------------------------------------------------------------------------

    def _head(self) -> tuple[HeadInfo, dict[str, str]]:
        """The head, and the exports that reach it: from a laptop, through the tunnels of
        `ray-slurm env` (opened, or reopened, here)."""
        with _typed("no head"):
            if self.laptop:
                head, variables, _ = tunnels.tunnel_env(self.cluster)
                return head, variables
            return env.head_env(self.cluster)

    @property
    def env(self) -> dict[str, str]:
        """What `ray-slurm env` exports (RAY_ADDRESS, RAY_API_SERVER_ADDRESS, the token's
        path): for a child process, e.g. `ray job submit`, as `{**os.environ, **c.env}`."""
        return self._head()[1]

    @property
    def address(self) -> str:
        """The Ray Client address, for `ray.init(c.address)` from a process that is not a
        node of the cluster. Reading it points this process's Ray at the cluster's token
        (Ray reads it from the environment), as `eval "$(ray-slurm env ...)"` would."""
        head, variables = self._head()
        rayapi.use_auth({k: v for k, v in variables.items() if k.startswith("RAY_AUTH_")})
        if self.laptop:
            return variables["RAY_ADDRESS"]  # the tunnel's ray://127.0.0.1:<port>
        return f"ray://{head.ip}:{head.client_port}"

    @property
    def dashboard_url(self) -> str:
        """The dashboard and job API: `ray job submit --address`, a browser."""
        return self._head()[1]["RAY_DASHBOARD_URL"]

    @property
    def gcs_address(self) -> str:
        """The head's GCS: `ray status --address`, `ray.init` on a node of the cluster."""
        if self.laptop:
            raise ClusterError("the head's GCS is not reachable from a laptop (no tunnel "
                               "goes there): use address (Ray Client) or dashboard_url")
        return self._head()[1]["RAY_GCS_ADDRESS"]

    def job_client(self) -> Any:
        """Ray's JobSubmissionClient for the cluster's dashboard, with its token."""
        head, variables = self._head()
        with _typed("cannot reach the dashboard"):
            if self.laptop:  # the tunnel, with the laptop's copy of the token
                token = variables.get("RAY_AUTH_TOKEN_PATH")
                return oneshot.client_at(variables["RAY_DASHBOARD_URL"],
                                         Path(token).read_text().strip() if token else None)
            return oneshot.job_client(self.cluster.cdir, head, self.cluster.pcfg.auth.mode)

    # --- what the commands show --------------------------------------------------------------

    def status(self, ended: int = 0) -> dict[str, Any]:
        """`ray-slurm status --json`'s data: one record per node (job, state, Ray up?, time
        left), the head's addresses, launch errors; `ended`: how the last N nodes that left
        the queue ended (sacct)."""
        with _typed("cannot list the cluster's jobs"):
            if self.laptop:
                out = remote.run_there(self.cluster, ["status", remote.CONFIG_ARG, "--json",
                                                      "--ended", str(ended)])
                return dict(json.loads(out))
            return status.status_data(self.cluster, ended)

    def status_table(self, ended: int = 0) -> str:
        """`ray-slurm status`'s table."""
        return "\n".join(status.status_lines(self.status(ended)))

    def logs(self, node: str = "head", lines: int = 0) -> str:
        """What node `node` (a Slurm job id, or `head`) printed: its agent's and Ray's
        start-up output; `lines`: only the last N."""
        with _typed(f"cannot read the log of {node}"):
            if self.laptop:
                lines_arg = ["--lines", str(lines)] if lines else []
                return remote.run_there(self.cluster,
                                        ["logs", remote.CONFIG_ARG, node, *lines_arg])
            job = logs.resolve_job(self.cluster, node)
            if job is None:
                raise ClusterError("name a node: a Slurm job id, or `head`")
            text = logs.job_log(self.cluster, job).read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:]) if lines else text

    # --- autoscaling -------------------------------------------------------------------------

    def request_resources(self, num_cpus: int | None = None,
                          bundles: list[dict[str, float]] | None = None,
                          timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        """Ray's `ray.autoscaler.sdk.request_resources`, called by a driver on the head (a
        Ray job): the autoscaler keeps that many CPUs / those bundles until the next call
        (`request_resources(num_cpus=0)` withdraws it)."""
        args = {k: v for k, v in (("num_cpus", num_cpus), ("bundles", bundles)) if v is not None}
        python = self.cluster.pcfg.python or sys.executable  # the head's, as doctor checks it
        client = self.job_client()
        with _typed("cannot submit request_resources"):
            job = client.submit_job(entrypoint=shlex.join([python, "-c", _REQUEST,
                                                           json.dumps(args)]))
        deadline = self._clock() + timeout_s
        while True:
            with _typed("cannot follow request_resources"):
                state = client.get_job_status(job)
            if state.is_terminal():
                break
            if self._clock() >= deadline:
                raise ClusterError(f"request_resources: Ray job {job} did not end within "
                                   f"{timeout_s:g}s (still {state})")
            self._sleep(0.5)
        if str(state) != "SUCCEEDED":
            raise ClusterError(f"request_resources: Ray job {job} {state}: "
                               f"{client.get_job_logs(job)[-2000:]}")
