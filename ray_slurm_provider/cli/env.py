"""`ray-slurm` commands that work on a cluster config (env, ...)."""

from __future__ import annotations

import argparse
import shlex
from typing import Any

from ray_slurm_provider import auth
from ray_slurm_provider.cli.common import (
    CliError,
    Cluster,
    config_command,
    load_cluster,
    run_command,
)
from ray_slurm_provider.state import HeadInfo


def head_env(cluster: Cluster) -> tuple[HeadInfo, dict[str, str]]:
    """The running head and the variables that point Ray's client tools at it (with the
    cluster's auth token); CliError when no head is recorded."""
    pcfg, cdir = cluster.pcfg, cluster.cdir
    head = cdir.read_head()
    if not head:
        raise CliError(f"cluster {cluster.name!r} has no running head "
                       f"({cdir.head_file} missing): run `ray up {cluster.path}` first")
    dash = f"http://{head.ip}:{head.dashboard_port}"
    gcs = f"{head.ip}:{head.gcs_port}"
    env = {
        # ray.init() and `ray status` want the GCS address; the jobs CLI and SDK read
        # RAY_API_SERVER_ADDRESS first and want the dashboard's URL.
        "RAY_ADDRESS": gcs,
        "RAY_API_SERVER_ADDRESS": dash,
        "RAY_DASHBOARD_URL": dash,
        "RAY_GCS_ADDRESS": gcs,
        **auth.auth_env(pcfg.auth.mode, cdir.root / auth.TOKEN_FILE),
    }
    return head, env


def env_lines(path: str, close: bool = False) -> list[str]:
    """Shell lines that point Ray's client tools at the cluster (with its auth token). With
    provider.ssh: through tunnels over the connection to the login node (`close` ends them)."""
    cluster = load_cluster(path)
    if cluster.pcfg.ssh is not None:
        from ray_slurm_provider.cli import tunnels

        return tunnels.close_tunnels(cluster) if close else tunnels.open_tunnels(cluster)
    if close:
        raise CliError("--close: no tunnels without provider.ssh")
    head, env = head_env(cluster)
    lines = [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
    lines.append(f"# From a laptop: ssh -L 8265:{head.ip}:{head.dashboard_port} "
                 "<login node>, then open http://localhost:8265")
    return lines


def cmd_env(args: argparse.Namespace) -> int:
    def body() -> int:
        print("\n".join(env_lines(args.config, close=args.close)))
        return 0

    return run_command(body)


def register(sub: Any) -> None:
    p = config_command(sub, "env", "print the exports that point Ray's tools at a cluster "
                       "(with provider.ssh: over tunnels it opens)", cmd_env)
    p.add_argument("--close", action="store_true",
                   help="with provider.ssh: close the tunnels and remove the token copy")
