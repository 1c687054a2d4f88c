"""`ray-slurm sbatch CONFIG [options] -- ENTRYPOINT...`: a one-shot cluster, fire and forget.

Prints the head's Slurm job id and returns; nothing keeps running on the login node. What
`ray up` would do before the head runs is done here: Ray's own config preparation (with this
provider's hooks), the autoscaler config and file mounts written to the shared filesystem, the
head job submitted, and its start program handed over with the entrypoint (`start.json`). The
head job starts Ray, runs the entrypoint as a Ray job (workers autoscale), cancels its workers
and ends with the entrypoint's exit code (agent/head.py, agent/oneshot.py). The entrypoint's
output is in the head job's log; `scancel` of the head ends everything. Each run is its own
cluster, `<cluster_name>-<run id>` (cli/oneshots.py), so runs of one config never meet.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import uuid
from typing import Any

import click

from ray_slurm_provider import rayapi, shellcmd
from ray_slurm_provider.agent.oneshot import staged_dir
from ray_slurm_provider.cli import oneshots
from ray_slurm_provider.cli.common import CliError, Cluster, config_command, load_cluster
from ray_slurm_provider.cli.run import Plan, own_env, plan
from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.provider import handoff, transfer
from ray_slurm_provider.slurm.client import Job, SlurmError


def resolve(config: dict[str, Any]) -> dict[str, Any]:
    """The config as `ray up` resolves it: Ray's defaults, then this provider's hooks
    (defaults files, partition shapes, checks). Ray's progress lines go to stderr."""
    return rayapi.bootstrap_config(config)


def head_start(config: dict[str, Any], head_type: str) -> tuple[shellcmd.Program,
                                                                dict[str, str]]:
    """The head's start program (its commands as Ray's updater runs them, `ray start` last)
    and the variables Ray's updater would give it. `config` is resolved (`resolve`)."""
    resources_var, labels_var = rayapi.start_env_names()
    nt = config["available_node_types"][head_type]
    prog = shellcmd.parse_commands(rayapi.head_commands(config))
    if prog.ray_start is None:
        raise CliError("head_start_ray_commands has no `ray start`")
    env = {"RAY_USAGE_STATS_ENABLED": "0", resources_var: json.dumps(nt.get("resources") or {})}
    if nt.get("labels"):
        env[labels_var] = json.dumps(nt["labels"])
    return prog, env


def submit(cluster: Cluster, p: Plan, provider_cls: Any = None) -> str:
    """Everything up to the head job's submission; its job id."""
    from ray.autoscaler.tags import (
        NODE_KIND_HEAD,
        TAG_RAY_NODE_KIND,
        TAG_RAY_NODE_NAME,
        TAG_RAY_NODE_STATUS,
        TAG_RAY_USER_NODE_TYPE,
    )

    from ray_slurm_provider.provider.provider import SlurmNodeProvider

    try:
        config = resolve(cluster.config)
    except (ConfigError, SlurmError) as e:
        raise CliError(str(e)) from e
    except click.ClickException as e:  # bootstrap_config's verdict
        raise CliError(e.message) from e
    except (Exception, SystemExit) as e:  # Ray's own checks (schema, cli_logger.abort)
        raise CliError(f"the cluster config was rejected: {e}") from e
    head_type = str(config["head_node_type"])
    prog, env = head_start(config, head_type)
    provider = (provider_cls or SlurmNodeProvider)(config["provider"], cluster.name)
    cdir = provider.cluster_dir
    cdir.create()
    runtime_env = dict(p.runtime_env)
    if "working_dir" in runtime_env:  # staged on the shared filesystem for the head
        dst = staged_dir(cdir, uuid.uuid4().hex[:12])
        shutil.copytree(runtime_env["working_dir"], dst)
        runtime_env["working_dir"] = str(dst)
    transfer.write_bootstrap_config(config, str(cdir.bootstrap_config))
    for remote, local in (config.get("file_mounts") or {}).items():
        transfer.copy(str(local), transfer.remote_path(cdir, str(remote)))
    tags = {TAG_RAY_NODE_KIND: NODE_KIND_HEAD, TAG_RAY_USER_NODE_TYPE: head_type,
            TAG_RAY_NODE_NAME: f"ray-{cluster.name}-head",
            TAG_RAY_NODE_STATUS: "uninitialized"}
    try:
        (head,) = provider.create_node(
            dict(config["available_node_types"][head_type].get("node_config") or {}), tags, 1)
    except click.ClickException as e:  # Slurm refused the head (partition, account, QOS)
        raise CliError(" ".join(e.message.split())) from e
    handoff.request_start(cdir.node(head), prog, env, entrypoint=p.entrypoint,
                          runtime_env=runtime_env)
    return str(head)


def pinned_ports_clash(config: Cluster, live: list[tuple[oneshots.Run, Job]]) -> str | None:
    """Why a new run cannot share the config's pinned ports with a live run, or None."""
    base = config.pcfg.ports.base
    if base is None or not live:
        return None
    run, head = live[0]
    return (f"provider.ports.base pins every run of {config.name!r} to ports {base}-"
            f"{base + 9}, and run {run.run_id} (head job {head.job_id} {head.state}) has not "
            "ended: two heads on one node cannot both take them. Leave provider.ports.base "
            "unset (each run then gets its own ports), or submit once that run has ended")


def cmd_sbatch(args: argparse.Namespace) -> int:
    try:
        args.no_down, args.reuse = False, False
        p = plan(args, run=False)
        config = load_cluster(p.config, starts=True)
        try:
            live = oneshots.sweep(config)
        except SlurmError as e:
            raise CliError(f"cannot ask Slurm about the runs of {config.name!r}: {e}") from e
        clash = pinned_ports_clash(config, live)
        if clash:
            raise CliError(clash)
        os.environ.update(own_env())  # the head job's environment (see own_env)
        run = oneshots.new_run(config)
        try:
            head = submit(oneshots.of_run(config, run), p)
        except BaseException:
            oneshots.remove(config, run)  # nothing runs: nothing of it stays
            raise
        oneshots.save(config, dataclasses.replace(run, head=head))
    except CliError as e:
        print(f"ray-slurm: {e}", file=sys.stderr)
        return 2
    print(head)
    print(f"ray-slurm sbatch: run {run.run_id} (cluster {run.name}): head job {head} runs the "
          f"entrypoint; its output: ray-slurm logs {p.config} head --run {run.run_id} -f; its "
          f"nodes: ray-slurm status {p.config} --run {run.run_id}; cancel everything: scancel "
          f"{head}", file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    p = config_command(sub, "sbatch", "submit a one-shot cluster whose head runs the "
                       "entrypoint and ends with it (prints the head's job id)", cmd_sbatch)
    p.add_argument("--working-dir", help="copied to the shared filesystem, then uploaded as "
                   "the job's working dir")
    p.add_argument("--runtime-env-json", metavar="JSON", help="the job's runtime_env, as JSON")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="-- ENTRYPOINT ...",
                   help="the command to run on the cluster, after `--`")
