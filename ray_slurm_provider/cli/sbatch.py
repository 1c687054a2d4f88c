"""`ray-slurm sbatch CONFIG [options] -- ENTRYPOINT...`: a one-shot cluster, fire and forget.

Prints the head's Slurm job id and returns; nothing keeps running on the login node. What
`ray up` would do before the head runs is done here: Ray's own config preparation (with this
provider's hooks), the autoscaler config and file mounts written to the shared filesystem, the
head job submitted, and its start program handed over with the entrypoint (`start.json`). The
head job starts Ray, runs the entrypoint as a Ray job (workers autoscale), cancels its workers
and ends with the entrypoint's exit code (agent/head.py, agent/oneshot.py). The entrypoint's
output is in the head job's log; `scancel` of the head ends everything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid
from typing import Any

import click

from ray_slurm_provider import rayapi, shellcmd
from ray_slurm_provider.agent.oneshot import staged_dir
from ray_slurm_provider.cli.common import CliError, Cluster, config_command, load_cluster
from ray_slurm_provider.cli.run import Plan, own_env, plan, running_head
from ray_slurm_provider.config import ConfigError
from ray_slurm_provider.provider import handoff, transfer
from ray_slurm_provider.slurm.client import SlurmError


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
    (head,) = provider.create_node(
        dict(config["available_node_types"][head_type].get("node_config") or {}), tags, 1)
    handoff.request_start(cdir.node(head), prog, env, entrypoint=p.entrypoint,
                          runtime_env=runtime_env)
    return str(head)


def cmd_sbatch(args: argparse.Namespace) -> int:
    try:
        args.no_down, args.reuse = False, False
        p = plan(args, run=False)
        cluster = load_cluster(p.config, starts=True)
        try:
            up = running_head(cluster)
        except SlurmError as e:
            raise CliError(f"cannot ask Slurm whether the cluster is up: {e}") from e
        if up:
            raise CliError(f"cluster {cluster.name!r} is already up (head job {up}); "
                           "`ray down` it first, or use `ray-slurm run --reuse`")
        os.environ.update(own_env())  # the head job's environment (see own_env)
        head = submit(cluster, p)
    except CliError as e:
        print(f"ray-slurm: {e}", file=sys.stderr)
        return 2
    print(head)
    print(f"ray-slurm sbatch: head job {head} runs the entrypoint; its output: ray-slurm logs "
          f"{p.config} {head} -f; cancel everything: scancel {head}", file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    p = config_command(sub, "sbatch", "submit a one-shot cluster whose head runs the "
                       "entrypoint and ends with it (prints the head's job id)", cmd_sbatch)
    p.add_argument("--working-dir", help="copied to the shared filesystem, then uploaded as "
                   "the job's working dir")
    p.add_argument("--runtime-env-json", metavar="JSON", help="the job's runtime_env, as JSON")
    p.add_argument("rest", nargs=argparse.REMAINDER, metavar="-- ENTRYPOINT ...",
                   help="the command to run on the cluster, after `--`")
