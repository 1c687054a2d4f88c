"""The runs of `ray-slurm sbatch`: each is its own cluster, so any number can queue side by side.

A run of config `C` is the cluster `C-<run id>` (its own Slurm job name, cluster dir, logs and
teardown: the end of one run cancels only its own jobs). A record in the run's dir ties it to
its config; `ray-slurm status|logs CONFIG --run ID` find the run by it. `sweep` keeps the state
dir from filling up: an ended run's staged working dir goes (a head scancelled while pending
never ran to remove it), and of the ended runs only the newest `provider.oneshot_runs_kept`
keep their dir.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ray_slurm_provider.agent.oneshot import staged_dir
from ray_slurm_provider.cli.common import CliError, Cluster
from ray_slurm_provider.jobs import job_name
from ray_slurm_provider.slurm.client import Job
from ray_slurm_provider.state import ClusterDir, write_json

RECORD = "oneshot-run.json"
ID_LEN = 6
NAME_MAX = 63  # cluster.NAME_RE
#: A record without a head this old is a `sbatch` that died before Slurm took the head.
UNSUBMITTED_S = 3600.0


@dataclass(frozen=True)
class Run:
    """One `sbatch` run as its record says."""

    run_id: str
    name: str  # the run's cluster name
    config_name: str  # the config's cluster_name
    created: float
    head: str = ""  # the head's job id, once Slurm took it
    ended: bool = False  # no job of the run is listed any more


def run_name(cluster_name: str, run_id: str) -> str:
    """`<cluster_name>-<run id>`, the config's name shortened to keep the cluster-name limit."""
    return f"{cluster_name[:NAME_MAX - len(run_id) - 1]}-{run_id}"


def of_run(cluster: Cluster, run: Run) -> Cluster:
    """The run's cluster: the config under the run's name, its own dir, the same Slurm."""
    config = {**cluster.config, "cluster_name": run.name}
    return dataclasses.replace(cluster, config=config,
                               cdir=ClusterDir(cluster.pcfg.state_dir, run.name))


def _record_path(cdir: ClusterDir) -> Path:
    return cdir.root / RECORD


def save(cluster: Cluster, run: Run) -> None:
    cdir = ClusterDir(cluster.pcfg.state_dir, run.name)
    cdir.create()
    write_json(_record_path(cdir), dataclasses.asdict(run))


def _load(path: Path) -> Run | None:
    try:
        data = json.loads(path.read_text())
        return Run(**data)
    except (OSError, ValueError, TypeError):
        return None  # half written or not ours: not a run


def runs_of(cluster: Cluster) -> list[Run]:
    """The config's runs, newest first."""
    root = ClusterDir(cluster.pcfg.state_dir, "x").root.parent
    found = [_load(p) for p in root.glob(f"*/{RECORD}")]
    runs = [r for r in found if r is not None and r.config_name == cluster.name]
    return sorted(runs, key=lambda r: r.created, reverse=True)


def new_run(cluster: Cluster, clock: Callable[[], float] = time.time) -> Run:
    """A new run of the config, recorded (its dir made) before anything is staged in it."""
    taken = {r.run_id for r in runs_of(cluster)}
    run_id = uuid.uuid4().hex[:ID_LEN]
    while run_id in taken:
        run_id = uuid.uuid4().hex[:ID_LEN]
    run = Run(run_id, run_name(cluster.name, run_id), cluster.name, clock())
    save(cluster, run)
    return run


def find(cluster: Cluster, ref: str) -> Cluster:
    """The run named by its id or its cluster name, as a cluster; CliError when none."""
    runs = runs_of(cluster)
    for r in runs:
        if ref in (r.run_id, r.name):
            return of_run(cluster, r)
    known = ", ".join(r.run_id for r in runs[:10]) or "none"
    raise CliError(f"no one-shot run {ref!r} of {cluster.name!r} (its runs, newest first: "
                   f"{known})")


def remove(cluster: Cluster, run: Run) -> None:
    """The run's whole dir (a run whose head Slurm refused, or one past the kept number)."""
    shutil.rmtree(ClusterDir(cluster.pcfg.state_dir, run.name).root, ignore_errors=True)


def sweep(cluster: Cluster, clock: Callable[[], float] = time.time) -> list[tuple[Run, Job]]:
    """Clean up after the config's ended runs; the live runs with their head's job. Slurm is
    asked once per run not yet known to have ended (SlurmError propagates)."""
    live: list[tuple[Run, Job]] = []
    ended: list[Run] = []
    for run in runs_of(cluster):
        if not run.ended:
            if not run.head and clock() - run.created < UNSUBMITTED_S:
                continue  # a `sbatch` still on its way to Slurm
            listed = cluster.ask(f"listing run {run.run_id}'s jobs",
                                 functools.partial(cluster.client.list_jobs, job_name(run.name)))
            jobs = [j for j in listed if j.active]
            head = next((j for j in jobs if j.job_id == run.head), None)
            if head is not None:
                live.append((run, head))
                continue
            cdir = ClusterDir(cluster.pcfg.state_dir, run.name)
            shutil.rmtree(staged_dir(cdir, "x").parent, ignore_errors=True)
            if jobs:
                continue  # the head is gone, its workers are still ending
            run = dataclasses.replace(run, ended=True)
            save(cluster, run)
        ended.append(run)
    for run in ended[cluster.pcfg.oneshot_runs_kept:]:
        remove(cluster, run)
    return live
